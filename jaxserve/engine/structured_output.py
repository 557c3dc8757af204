"""Structured output: a grammar per request, enforced as a token mask on the device.

llguidance (a Rust grammar engine from PyPI, no other dependencies) compiles each
constraint (JSON Schema, any JSON object, regex, choice, Lark or GBNF grammar) against the
tokenizer's vocabulary and keeps a matcher per request. Before a step that samples a
constrained request, the host fills that row of a packed bitmask `[S, ceil(V/32)]` (bit t
of a row set = token t allowed; rows of free requests all ones) and the sampler applies it
before everything else (jaxserve/engine/sampler.py). EOS is allowed exactly when the
grammar can end. After the step each matcher consumes its token; a matcher that has
nothing left to match (EOS taken, or no further text possible) ends its request.

We chose llguidance over xgrammar by measurement (benchmarks/structured_output.py): masks
cost about the same per row on this machine, llguidance makes a matcher for a JSON schema
several times faster, and xgrammar needs torch, transformers and triton (a 1 GB install)
at run time, which a JAX server should not carry.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.numpy as llg_numpy
from llguidance.gbnf_to_lark import gbnf_to_lark
import numpy as np

from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.sampling_params import REASONING_END, REASONING_START, StructuredOutputsParams

log = logging.getLogger(__name__)

# Compiled constraints kept (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256
# llguidance's JSON options for JSON without free whitespace (also as a schema's
# "x-guidance" in a Lark grammar's %json).
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_source(c: StructuredOutputsParams) -> str:
    """llguidance's grammar for a constraint (not yet checked), after a free reasoning
    block (or harmony's analysis messages) when `c.reasoning` asks for one."""
    source = _constraint_source(c)
    if c.reasoning is None:
        return source
    # The constraint's grammars (a JSON TopLevelGrammar, or Lark text), the first renamed
    # so that a Lark grammar of the block can refer to it (`@constraint`).
    grammars = (json.loads(source)["grammars"] if source.lstrip().startswith("{")
                else [{"lark_grammar": source}])
    grammars[0] = {**grammars[0], "name": "constraint"}
    if c.reasoning == "harmony":
        lark = harmony_grammar('"final" (" "? <|constrain|> /[a-zA-Z]+/)? <|message|> @constraint')
        return json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]})
    block = "thought /[ \\t\\r\\n]*/"
    start = (f"start: {block} @constraint" if c.reasoning == "open"
             else f"start: ({json.dumps(REASONING_START)} {block})? @constraint")
    thought = "thought[lazy]: /(?s:.*)" + re.escape(REASONING_END).replace("/", "\\/") + "/"
    return json.dumps({"grammars": [{"lark_grammar": f"{start}\n{thought}\n"}, *grammars]})


def harmony_grammar(message: str, rules: str = "") -> str:
    """Lark for gpt-oss's harmony turn after the generation prompt's `<|start|>assistant`:
    any analysis messages (free text, each ended by `<|end|>` and the next header), then
    one message `<|channel|>` + `message` (the rest of its header and its text; `rules`
    defines what it refers to). The markers are the tokenizer's special tokens, which a
    text pattern never matches: THOUGHT runs up to the next one."""
    return (f'start: (<|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> '
            f'"assistant")* <|channel|> {message}\nTHOUGHT: /(?s:.*)/\n{rules}')


def _constraint_source(c: StructuredOutputsParams) -> str:
    if c.json is not None or c.json_object:
        schema = c.json if c.json is not None else {"type": "object"}
        options = COMPACT_JSON if c.disable_any_whitespace else {"whitespace_flexible": True}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: {e}") from None
    if c.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(c.regex)
    if c.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in c.choice))
    grammar = c.grammar
    if "::=" in grammar:  # GBNF (llama.cpp's EBNF)
        try:
            grammar = gbnf_to_lark(grammar)
        except Exception as e:  # noqa: BLE001 - the converter raises what it likes
            raise ValueError(f"structured_outputs.grammar is not valid GBNF: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(grammar)


def _llg_tokenizer(tokenizer: Tokenizer, vocab_size: int,
                   eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance sees it, padded to the model's logits width (ids past
    the tokenizer are never allowed): tokenizer.json read by llguidance itself, or, where
    it cannot read one (a decoder it does not know, e.g. the demo model's Fuse) or there
    is none (sentencepiece), every token's bytes."""
    eos = list(eos_token_ids)
    hf_json = tokenizer.tokenizer_json()
    if hf_json is not None:
        try:
            return llguidance.LLTokenizer(hf_json, n_vocab=vocab_size, eos_token=eos)
        except Exception as e:  # noqa: BLE001 - the Rust side raises what it likes
            log.info("llguidance cannot read tokenizer.json (%s); giving it token bytes", e)
    wrapper = _TokenBytes(tokenizer, tokenizer.token_bytes(), vocab_size)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), eos_token=eos)


class _TokenBytes:
    """What llguidance.TokenizerWrapper reads from a tokenizer it cannot load itself: the
    tokens' bytes, padded to the model's logits width with empty special tokens (never
    allowed)."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], vocab_size: int):
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = tokens + [b""] * (vocab_size - len(tokens))
        self.special_token_ids = sorted(tokenizer.all_special_ids
                                        | set(range(len(tokens), vocab_size)))
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Compiles constraints against one tokenizer and makes a matcher per request.

    A compiled constraint is kept as a fresh matcher (least recently used dropped first);
    each request gets a copy of it (under a microsecond). Thread-safe: the servers compile
    in their tokenizer pool, so the engine thread only copies."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._args = (tokenizer, vocab_size, tuple(eos_token_ids))
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @functools.cached_property
    def _tokenizer(self) -> llguidance.LLTokenizer:  # ~0.2 s for a 32k vocabulary: lazily
        return _llg_tokenizer(*self._args)

    def compile(self, constraint: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for the constraint (not to be advanced: see `matcher`);
        ValueError naming what is wrong with the constraint."""
        key = constraint.key()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        grammar = grammar_source(constraint)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{constraint.kind}: {error.strip()}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{constraint.kind}: {matcher.get_error()}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, constraint: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A request's own matcher, at the start of the output."""
        return self.compile(constraint).deep_copy()


class MaskFiller:
    """Fills the bitmask rows of a step's constrained requests, in parallel threads
    (llguidance's executor releases the GIL)."""

    def __init__(self):
        self._executor = llguidance.LLExecutor()

    def fill(self, rows: list[tuple[llguidance.LLMatcher, int]], num_rows: int,
             vocab_size: int) -> np.ndarray:
        mask = llg_numpy.allocate_token_bitmask(num_rows, vocab_size)
        if len(rows) == 1:
            llg_numpy.fill_next_token_bitmask(rows[0][0], mask, rows[0][1])
        else:
            llg_numpy.fill_next_token_bitmask_par(self._executor, rows, mask)
        return mask
