"""Per-request sampling and stopping parameters, named as in vLLM."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

# Device-side limits: the step takes fixed-width arrays for these.
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 24  # stop_token_ids (<= 16) plus EOS ids
MAX_LOGIT_BIAS = 32  # logit_bias entries per request
MAX_BAD_WORDS = 128  # bad_words per request (each checked on the host every step)
# A thinking model's reasoning block (DeepSeek-R1, QwQ, Qwen3): StructuredOutputsParams'
# `reasoning`, and the servers' --reasoning-parser (server/reasoning.py).
REASONING_START, REASONING_END = "<think>", "</think>"


@dataclasses.dataclass
class StructuredOutputsParams:
    """A constraint every output token must keep to (vLLM's fields; set exactly one):

    - `json`: a JSON Schema (a dict, or its JSON text) the output must validate against;
    - `json_object`: True for any JSON object;
    - `regex`: a regular expression the whole output must match;
    - `choice`: the output is one of these strings;
    - `grammar`: a context-free grammar, in Lark syntax (llguidance's dialect) or GBNF
      (recognised by its `::=` rules).

    JSON comes out compact (`", "` and `": "` separators, no other whitespace) unless
    `disable_any_whitespace` is False: free whitespace lets a model pad the output until
    max_tokens runs out.

    `reasoning` leaves a thinking model's reasoning block free before the constraint
    holds (the servers' --reasoning-parser sets it): "open" when the prompt opened the
    block (free text up to REASONING_END first), "optional" when the output may open one
    with REASONING_START; whitespace may follow the block. "harmony" is gpt-oss's turn
    (server/harmony.py): any analysis messages first, then the constraint holds as the
    text of the final message (`<|channel|>final<|message|>`, the tokenizer's special
    tokens); the prompt must end with the generation prompt's `<|start|>assistant`.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs: set exactly one of json, json_object, "
                             f"regex, choice, grammar (got {kinds or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON Schema (an object)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.reasoning not in (None, "open", "optional", "harmony"):
            raise ValueError(f"structured_outputs.reasoning must be 'open', 'optional' or "
                             f"'harmony', got {self.reasoning!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar")
                    if getattr(self, k) is not None) if not self.json_object else "json_object"

    def key(self) -> str:
        """What identifies the compiled constraint (for caching)."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace, self.reasoning],
                          sort_keys=True)


@dataclasses.dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k -1 (or 0) and top_p 1.0 and min_p 0.0 switch those
    filters off. Penalties follow vLLM: presence and frequency apply to generated tokens,
    repetition to prompt and generated tokens (1.0 = off). `seed` makes the request's
    tokens reproducible whatever else shares its batch. `logprobs=N` returns the sampled
    token's log-probability and the N most likely tokens of the model's distribution;
    `prompt_logprobs=N` the same for every prompt token after the first (its
    log-probability given the tokens before it, and the N most likely there), as vLLM's
    RequestOutput.prompt_logprobs: the prompt is computed whole (no prefix cache hit).
    `speculative` False keeps this request from speculative decoding when the engine
    has it on (its tokens are the same either way; docs/speculative.md).
    `include_stop_str_in_output` keeps the stop string that ended the output in its text
    (and the text of a stop token id that did), as vLLM's. `allowed_token_ids`: only
    these may be sampled; `bad_words`: words the output never writes (vLLM's rule:
    engine/token_filters.py).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    speculative: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        for field in ("allowed_token_ids", "bad_words"):
            value = getattr(self, field)
            if isinstance(value, (list, tuple)):
                setattr(self, field, list(value))
            elif value is not None:
                raise ValueError(f"SamplingParams.{field} must be a list (got {value!r})")
        self.bad_words = self.bad_words or []
        self.validate()
        self.bad_words = list(dict.fromkeys(self.bad_words))

    def validate(self) -> None:
        """Raise ValueError naming the first field with a bad value."""

        def bad(field: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{field} {why} (got {getattr(self, field)!r})")

        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            bad("top_k", "must be -1 or 0 (off) or a positive integer")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                bad(field, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be a finite number > 0 (1.0 means off)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be a positive integer or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS - 8:
            bad("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS - 8} ids")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**32):
            bad("seed", "must be an integer in [0, 2**32)")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(field, f"must be an integer in [0, {MAX_LOGPROBS}] or None")

        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                bad("logit_bias", f"keys must be non-negative token ids ({token!r} is not)")
            if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                bad("logit_bias", f"values must be in [-100, 100] ({bias!r} is not)")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        for field in ("speculative", "include_stop_str_in_output"):
            if not isinstance(getattr(self, field), bool):
                bad(field, "must be true or false")
        if self.allowed_token_ids is not None and not (
                self.allowed_token_ids
                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", "must be a list of words (non-empty strings)")
        if len(self.bad_words) > MAX_BAD_WORDS:
            bad("bad_words", f"may hold at most {MAX_BAD_WORDS} words")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def samples_full(self) -> bool:
        """Whether its sampling needs top-k / top-p's sort or logprobs (sampler.FULL:
        where the host settles the sampling's branches, ModelRunner.branch_free)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.logprobs is not None

    @property
    def needs_history(self) -> bool:
        """Its sampling needs every token it has so far on the host (penalties, a grammar
        mask, bad words) or a mask made there (allowed_token_ids): its steps are sampled
        apart, after the step before is collected."""
        return (self.uses_penalties or self.structured_outputs is not None
                or self.filters_tokens)

    @property
    def filters_tokens(self) -> bool:
        """Whether it has allowed_token_ids or bad_words (engine/token_filters.py)."""
        return self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    """A finite int or float (NaN and ±inf are not numbers a request may set)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
