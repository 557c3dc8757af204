"""Structured output: what a grammar costs per step, and which grammar engine to use.

On the random-weight checkpoint of benchmarks/peers.py (smollm2-135m shape; a 49,152-token
sentencepiece BPE vocabulary trained on local text, so tokens are real text pieces):

1. Grammar engines, on that vocabulary: llguidance (what jaxserve uses) and xgrammar (if
   installed): time to read the tokenizer, to compile a JSON Schema, and to fill one row's
   token mask at each token of a valid document (mean and p99), and 64 rows at once.
2. The engine, `--num-seqs` requests of `--tokens` output tokens each (sampled, seeded),
   free and constrained: output tokens/s, the host's mask time per step (filling the
   bitmask of the constrained rows), and the device's (the jitted sampler with the mask
   against without, same batch). Constraints: the inside of a JSON string (a regex that
   never closes it, so every request runs to --tokens, as free ones do: the same work), and
   a bounded JSON Schema (requests end when their object does: tokens/s is what compares).

    python benchmarks/structured_output.py [--dtype float32|bfloat16] [--num-seqs 64]
        [--tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import peers  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.engine.sampler import sample  # noqa: E402
from jaxserve.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 4},
        "address": {"type": "object", "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@engines.org",
                       "tags": ["math", "poetry"], "address": {"city": "London",
                                                                "zip": "10001"}})
JSON_STRING = r'\{"text": "[^"\\\x00-\x1f]*'  # an open JSON string that never closes


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def grammar_engines(model_dir: Path, vocab_size: int, eos: int) -> list[dict]:
    """llguidance's (ours) and xgrammar's (where installed) costs on the same schema and
    document: tokenizer set-up, compile, a mask row, 64 rows."""
    row, ids = llguidance_row(model_dir, vocab_size, eos)
    rows = [row]
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        rows.append(dict(engine="xgrammar: not installed (pip install xgrammar)"))
        return rows
    rows.append(xgrammar_row(model_dir, vocab_size, eos, ids))
    return rows


def llguidance_row(model_dir: Path, vocab_size: int, eos: int) -> tuple[dict, list[int]]:
    """llguidance's row, and the document's token ids (both engines run through them)."""
    import llguidance
    import llguidance.numpy as lnp

    tokenizer_json = (model_dir / "tokenizer.json").read_text()
    tok, t_tok = timed(lambda: llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                      eos_token=eos))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, overrides={"whitespace_flexible": False, "item_separator": ", ",
                           "key_separator": ": "})
    matcher, t_compile = timed(lambda: llguidance.LLMatcher(tok, grammar))
    ids = tok.tokenize_str(DOCUMENT)
    mask = lnp.allocate_token_bitmask(64, vocab_size)
    per_token = []
    for t in ids:
        _, dt = timed(lnp.fill_next_token_bitmask, matcher, mask, 0)
        per_token.append(dt)
        assert (mask[0, t // 32] >> (t % 32)) & 1 and matcher.consume_token(t)
    executor = llguidance.LLExecutor()
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(64)]
    batch = []
    for t in ids:
        _, dt = timed(lnp.fill_next_token_bitmask_par, executor,
                      [(m, i) for i, m in enumerate(matchers)], mask)
        batch.append(dt)
        for m in matchers:
            m.consume_token(t)
    return dict(engine=f"llguidance {importlib.metadata.version('llguidance')}",
                tokenizer_s=t_tok, compile_ms=1e3 * t_compile, mask_us=1e6 * np.mean(per_token),
                p99_us=1e6 * np.percentile(per_token, 99), rows64_ms=1e3 * np.mean(batch),
                tokens=len(ids)), ids


def xgrammar_row(model_dir: Path, vocab_size: int, eos: int, ids: list[int]) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    info, t_tok = timed(lambda: xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab_size, stop_token_ids=[eos]))
    compiler = xgr.GrammarCompiler(info)
    compiled, t_compile = timed(lambda: compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, strict_mode=True))
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(64, vocab_size)
    per_token = []
    for t in ids:
        _, dt = timed(matcher.fill_next_token_bitmask, mask, 0)
        per_token.append(dt)
        assert matcher.accept_token(t)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(64)]
    batch = []
    for t in ids:
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        batch.append(time.perf_counter() - start)
        for m in matchers:
            m.accept_token(t)
    return dict(engine=f"xgrammar {importlib.metadata.version('xgrammar')}", tokenizer_s=t_tok,
                compile_ms=1e3 * t_compile, mask_us=1e6 * np.mean(per_token),
                p99_us=1e6 * np.percentile(per_token, 99),
                rows64_ms=1e3 * np.mean(batch), tokens=len(ids))


def device_mask_cost(llm: LLM, num_seqs: int) -> tuple[float, float]:
    """ms of the jitted sampler over [num_seqs, vocab] logits, without and with a mask."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    batch = engine.builder.empty(engine.builder.bucket(num_seqs, False))
    s = batch.sampling.grammar_mask.shape[0]
    logits = jax.random.normal(jax.random.key(0), (s, vocab), jnp.float32)
    arrays = jax.tree.map(jnp.asarray, batch.sampling)
    arrays.temperature = jnp.full(s, 0.8, jnp.float32)
    masked = dataclasses.replace(arrays)
    masked.grammar_mask = jnp.asarray(
        np.random.default_rng(0).integers(-2**31, 2**31, arrays.grammar_mask.shape,
                                          dtype=np.int64).astype(np.int32))
    fn = jax.jit(sample)
    times = {}
    for name, a in (("open", arrays), ("masked", masked)):
        jax.block_until_ready(fn(logits, a, None))
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            jax.block_until_ready(fn(logits, a, None))
            best = min(best, time.perf_counter() - start)
        times[name] = 1e3 * best
    return times["open"], times["masked"]


def run_engine(llm: LLM, num_seqs: int, tokens: int, constraint) -> dict:
    engine = llm.engine
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.model_config.vocab_size, 32).tolist()
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=tokens,
                             ignore_eos=constraint is None, structured_outputs=constraint)
              for i in range(num_seqs)]
    fill_times = []
    real_fill = engine.masks.fill

    def timed_fill(*args):
        out, dt = timed(real_fill, *args)
        fill_times.append(dt)
        return out

    engine.masks.fill = timed_fill
    try:
        steps = engine.num_steps
        outs, wall = timed(llm.generate, prompts, params)
    finally:
        engine.masks.fill = real_fill
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(tok_s=generated / wall, mean_len=generated / num_seqs,
                steps=engine.num_steps - steps, wall_ms=1e3 * wall,
                mask_ms=1e3 * np.mean(fill_times) if fill_times else 0.0,
                finished={r: sum(o.outputs[0].finish_reason == r for o in outs)
                          for r in ("stop", "length")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=str(ROOT / "configs/models/smollm2-135m.yaml"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()

    model_dir = peers.checkpoint(args.preset)
    config = json.loads((model_dir / "config.json").read_text())
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_name()}, "
          f"{os.cpu_count()} cores, jax {jax.__version__}, {model_dir.name}, {args.dtype}\n")

    rows = grammar_engines(model_dir, config["vocab_size"], config["eos_token_id"])
    print("| grammar engine | tokenizer | JSON Schema compile | mask, one row (mean / p99) "
          "| 64 rows |\n|---|---|---|---|---|")
    for r in rows:
        if "mask_us" not in r:
            print(f"| {r['engine']} | | | | |")
            continue
        print(f"| {r['engine']} | {r['tokenizer_s']:.2f} s | {r['compile_ms']:.1f} ms | "
              f"{r['mask_us']:.0f} / {r['p99_us']:.0f} µs ({r['tokens']} tokens) | "
              f"{r['rows64_ms']:.2f} ms |")

    llm = LLM(str(model_dir), dtype=args.dtype, max_model_len=256, page_size=16,
              max_num_seqs=args.num_seqs, max_num_batched_tokens=512,
              token_buckets=(args.num_seqs, 512), kv_cache_memory_gib=1.0)
    open_ms, masked_ms = device_mask_cost(llm, args.num_seqs)
    runs = [("free", None),
            ("inside a JSON string (regex)", StructuredOutputsParams(regex=JSON_STRING)),
            ("bounded JSON Schema", StructuredOutputsParams(json=SCHEMA))]
    run_engine(llm, args.num_seqs, 4, None)  # warm the host paths
    results = [(name, run_engine(llm, args.num_seqs, args.tokens, c)) for name, c in runs]
    free = results[0][1]["tok_s"]
    print(f"\n{args.num_seqs} requests x {args.tokens} tokens, 32-token prompts, temperature "
          f"0.8, seeded:\n")
    # A bounded schema's batch thins as its objects end: its steps carry fewer tokens, so
    # the time per step is the fairer comparison of what the constraint costs.
    step_ms = results[0][1]["wall_ms"] / max(results[0][1]["steps"], 1)
    print("| run | output tok/s | vs free | steps | ms / step | vs free | host mask / step | "
          "mean length | ended stop / length |\n|---|---|---|---|---|---|---|---|---|")
    for name, r in results:
        ms = r["wall_ms"] / max(r["steps"], 1)
        print(f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / free:.3f} | {r['steps']} | "
              f"{ms:.1f} | {step_ms / ms:.3f} | {r['mask_ms']:.2f} ms | {r['mean_len']:.1f} | "
              f"{r['finished']['stop']} / {r['finished']['length']} |")
    print(f"\ndevice: the jitted sampler over [{args.num_seqs}, {config['vocab_size']}] "
          f"logits takes {open_ms:.2f} ms without a mask and {masked_ms:.2f} ms with one "
          f"({masked_ms - open_ms:+.2f} ms; a free step takes {step_ms:.1f} ms)")


if __name__ == "__main__":
    main()
