"""Structured output on a random-weight model (which, unconstrained, emits garbage): every
constrained output parses and validates by an oracle of its own (jsonschema, re.fullmatch,
lark's parser), mixed with free requests in one batch, greedy and sampled, through
chunked prefill, prefix-cache hits and preemption. (The masked sampler against numpy is in
test_sampler.py.)"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import lark
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine import engine as engine_module
from jaxserve.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
CHOICES = ["red", "green", "blue", "yellow"]
# Nested, so beyond a regular expression; finite, so a random model's walk ends.
LARK = """
start: sum
sum: term | term OP term | term OP term OP term
term: NUMBER | "(" inner ")"
inner: NUMBER OP NUMBER
OP: "+" | "-"
NUMBER: /[0-9]{1,3}/
"""
GBNF = 'root ::= year "-" month\nyear ::= [12] [0-9] [0-9] [0-9]\nmonth ::= "0" [1-9] | "1" [0-2]'
GBNF_AS_REGEX = r"[12][0-9]{3}-(0[1-9]|1[0-2])"

ENGINE = dict(dtype="float32", max_model_len=256, page_size=4, max_num_seqs=8,
              max_num_batched_tokens=64, token_buckets=(16, 64), enable_prefix_caching=True,
              num_pages=80)  # 8 sequences of up to ~200 tokens do not fit: some are preempted


def check(kind: str, text: str) -> None:
    """Raises unless `text` is what the constraint allows (by an oracle of its own)."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "lark":
        lark.Lark(LARK, parser="lalr").parse(text)
    elif kind == "gbnf":
        assert re.fullmatch(GBNF_AS_REGEX, text), text
    else:
        raise AssertionError(kind)


CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "lark": StructuredOutputsParams(grammar=LARK),
    "gbnf": StructuredOutputsParams(grammar=GBNF),
}


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints("llama")[0]), **ENGINE)


def run_batch(llm, prompts, seeds):
    """Every constraint greedy and with each seed, and free requests, in one batch."""
    kinds, params = [], []
    for seed in [None, *seeds]:
        for kind, constraint in [*CONSTRAINTS.items(), (None, None)]:
            if kind == "json_object" and seed is not None:
                # Any object allows strings of any length, and a random model sampling at
                # temperature 1 closes one with a chance of ~1/250 a token: greedy only.
                continue
            kinds.append(kind)
            params.append(SamplingParams(
                temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=120,
                structured_outputs=constraint, logprobs=1))
    batch = [prompts[i % len(prompts)] for i in range(len(params))]
    return kinds, params, llm.generate(batch, params)


def test_every_constrained_output_parses(llm, prompts):
    engine = llm.engine
    # A long prompt is prefilled in chunks (64-token budget); repeated prompts hit the
    # prefix cache; the small pool preempts running requests.
    long_prompt = (prompts[3] * 3)[:100]
    kinds, params, outs = run_batch(llm, [long_prompt, *prompts], seeds=[1, 2])
    finished = {}
    for kind, p, out in zip(kinds, params, outs):
        o = out.outputs[0]
        if kind is None:
            continue
        assert o.finish_reason == "stop", (kind, p.seed, o.finish_reason, o.text)
        check(kind, o.text)
        finished[kind] = finished.get(kind, 0) + 1
        # Logprobs are the masked distribution's: the sampled token is never ruled out.
        assert all(lp[t].logprob > -9999.0 for t, lp in zip(o.token_ids, o.logprobs))
    assert finished == {kind: 1 if kind == "json_object" else 3 for kind in CONSTRAINTS}
    free = [o.outputs[0].text for k, o in zip(kinds, outs) if k is None]
    assert not any(_parses_as_anything(t) for t in free)  # the model alone emits garbage
    assert engine.scheduler.num_preemptions > 0
    assert max(o.num_cached_tokens for o in outs) > 0
    assert engine.scheduler.num_used_pages == 0


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_a_constraint_holds_after_a_free_reasoning_block(llm, prompts, kind):
    """`reasoning` ("open": the prompt opened a block; "optional": the output may open
    one): the reasoning is free text up to </think>, then the constraint holds (an
    answer the engine wrote under the plain constraint, checked by its own oracle)."""
    import dataclasses

    plain = CONSTRAINTS[kind]
    answer = llm.generate([prompts[1]], SamplingParams(
        temperature=0.0, max_tokens=120, structured_outputs=plain))[0].outputs[0].text
    check(kind, answer)
    tokenizer, grammars = llm.get_tokenizer(), llm.engine.grammars
    thought = 'some {"json": no} </b> <thin < / >\n'

    def walk(mode: str, text: str) -> bool:
        matcher = grammars.matcher(dataclasses.replace(plain, reasoning=mode))
        return all(matcher.consume_token(t) for t in tokenizer.encode(
            text, add_special_tokens=False)) and matcher.is_accepting()

    assert walk("optional", f"<think>{thought}</think>\n\n{answer}")
    assert walk("optional", answer)  # no block
    assert walk("open", f"{thought}</think> {answer}")
    for mode, text in [("optional", f"<think>{thought}</think>!{answer}"),
                       ("open", f"{thought}</think>!"), ("open", thought),
                       ("optional", f"{thought}</think>{answer}")]:
        assert not walk(mode, text), (mode, text)
    assert not walk(None, f"<think>{thought}</think>{answer}")  # without it: from the start


def _parses_as_anything(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return bool(re.fullmatch(REGEX, text))


def test_masks_are_filled_while_the_forward_pass_runs(llm, prompts, monkeypatch):
    """With async scheduling a constrained step starts its forward pass before the step
    before it is collected; the host then collects, fills the masks and starts the
    sampling (issue: the mask is made while the device runs). Greedy outputs are those
    of the engine without async scheduling, where each step is collected first."""
    engine, events = llm.engine, []
    for name in ("dispatch", "dispatch_forward", "dispatch_sample"):
        method = getattr(engine.runner, name)
        monkeypatch.setattr(engine.runner, name, lambda *a, _m=method, _n=name:
                            events.append(_n) or _m(*a))
    fill = engine.masks.fill
    monkeypatch.setattr(engine.masks, "fill", lambda *a: events.append("mask") or fill(*a))
    fetch = engine_module.fetch
    monkeypatch.setattr(engine_module, "fetch", lambda *a: events.append("collect") or fetch(*a))
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=c)
              for c in (CONSTRAINTS["regex"], CONSTRAINTS["json"])]
    params.append(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    overlapped = llm.generate(prompts[:3], params)
    # Each constrained step after the first: forward N, collect N-1, masks, sample N.
    steps = [c.split() for c in " ".join(events).split("dispatch_forward")[1:]]
    masked = [c for c in steps[1:] if "mask" in c]
    assert len(masked) >= 10 and all(c[:3] == ["collect", "mask", "dispatch_sample"]
                                     for c in masked), events
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config,
                                                              async_scheduling=False))
    serial = llm.generate(prompts[:3], params)
    assert [o.outputs[0].token_ids for o in overlapped] == [o.outputs[0].token_ids
                                                            for o in serial]
    check("regex", overlapped[0].outputs[0].text)
    check("json", overlapped[1].outputs[0].text)


def test_masks_need_no_new_program(llm):
    assert llm.engine.runner.compiles_after_warmup == 0


@pytest.mark.parametrize("constraint, problem", [
    (dict(regex="[a-"), "unclosed character class"),
    (dict(json={"type": "nonsense"}), "nonsense"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
    (dict(grammar='root ::= missing'), "missing"),
])
def test_bad_constraints_fail_at_add_naming_the_problem(llm, constraint, problem):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match="structured_outputs") as e:
        llm.engine.add_request("bad", [5, 6, 7], params)
    assert problem in str(e.value)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("fields, problem", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(choice=[]), "non-empty list"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="a", reasoning="closed"), "reasoning must be 'open', 'optional' or 'harmony'"),
])
def test_constraint_fields_are_checked(fields, problem):
    with pytest.raises(ValueError, match=problem):
        StructuredOutputsParams(**fields)


def test_a_grammar_that_cannot_finish_ends_with_length(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=5,
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{10}"))
    out = llm.generate([prompts[0]], params)[0].outputs[0]
    assert out.finish_reason == "length" and re.fullmatch(r"[a-z]{5}", out.text)


def test_eos_is_allowed_exactly_where_the_grammar_may_end(llm):
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    (eos,) = engine.eos_token_ids
    matcher = engine.grammars.matcher(StructuredOutputsParams(regex="ab(cd)?"))

    def allowed() -> set[str]:
        mask = engine.masks.fill([(matcher, 0)], 1, engine.model_config.vocab_size)[0]
        ids = [t for t in range(engine.model_config.vocab_size) if mask[t // 32] >> (t % 32) & 1]
        return {"EOS" if t == eos else tokenizer.decode([t]) for t in ids}

    steps = []
    for text in ["", "a", "b", "c", "d"]:
        for t in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.consume_token(t)
        steps.append(allowed() if not matcher.is_stopped() else "done")
    assert steps == [{"a"}, {"b"}, {"c", "EOS"}, {"d"}, "done"]


def _allowed(compiler, constraint, text: str, tokenizer, vocab: int) -> list[list[int]]:
    """The allowed ids before each token of `text`, walking its tokens."""
    from jaxserve.engine.structured_output import MaskFiller

    matcher, masks = compiler.matcher(constraint), []
    for t in tokenizer.encode(text, add_special_tokens=False) + [None]:
        row = MaskFiller().fill([(matcher, 0)], 1, vocab)[0]
        masks.append([i for i in range(vocab) if row[i // 32] >> (i % 32) & 1])
        if t is not None:
            assert matcher.consume_token(t), (text, t)
    return masks


def test_token_bytes_give_llguidance_what_tokenizer_json_does(llm, tmp_path):
    """Where llguidance cannot read tokenizer.json (the demo model's Fuse decoder) it gets
    each token's bytes instead. On the byte-level test tokenizer, which it reads, the bytes
    path gives the same masks at every token of a schema's document (non-ASCII included);
    on the demo model's, a choice allows exactly its first letters."""
    from jaxserve.demo import write_char_tokenizer
    from jaxserve.engine.structured_output import GrammarCompiler
    from jaxserve.loading.tokenizer import Tokenizer

    tokenizer, vocab = llm.get_tokenizer(), llm.engine.model_config.vocab_size
    eos = llm.engine.eos_token_ids
    from_json = GrammarCompiler(tokenizer, vocab, eos)
    from_bytes = GrammarCompiler(tokenizer, vocab, eos)
    from_bytes._tokenizer  # built before the JSON is hidden from it
    tokenizer.tokenizer_json, real = (lambda: None), tokenizer.tokenizer_json
    try:
        from_bytes.__dict__.pop("_tokenizer")
        from_bytes._tokenizer
    finally:
        tokenizer.tokenizer_json = real
    document = '{"name": "Zoë ☃", "age": 7, "ok": true, "tags": ["a"]}'
    constraint = StructuredOutputsParams(json=SCHEMA)
    assert (_allowed(from_bytes, constraint, document, tokenizer, vocab)
            == _allowed(from_json, constraint, document, tokenizer, vocab))

    write_char_tokenizer(tmp_path)
    demo = Tokenizer.from_pretrained(tmp_path)
    compiler = GrammarCompiler(demo, demo.vocab_size, [1])
    first = _allowed(compiler, StructuredOutputsParams(choice=["yes", "no"]), "", demo,
                     demo.vocab_size)[0]
    assert sorted(demo.decode([t]) for t in first) == ["n", "y"]
