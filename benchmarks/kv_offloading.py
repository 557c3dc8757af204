"""The prefix cache's host tier (`kv_offloading_size`): documents asked about in turn,
more of them than the device's KV pool holds.

One random-weight checkpoint of a preset's shape (default smollm2-135m, written once by
benchmarks/peers.py). Workload: --docs documents of --doc-len tokens, each asked
--questions questions (a 16-token suffix, 16 new tokens, greedy, ignore_eos), one request
at a time, question by question over every document (document 0 q0, document 1 q0, ...,
document 0 q1, ...): a chat over several long contexts. The device pool holds --pool-docs
documents' pages, so a document's prefix is evicted before it comes round again. Three
engines, configs/engine/cpu.yaml otherwise, one pass each per round, in turn:
  device only   the pool of --pool-docs documents, no host tier: each request computes
                its document again;
  host tier     the same pool, kv_offloading_size big enough for every document: evicted
                pages come back from host memory;
  device holds all  a pool for every document (the ceiling: every prefix stays cached).
Prints per engine: ms a request and ms a later question (a document's second and third:
where the prefix can be found; medians of rounds [min-max]), prompt tokens computed a
request, and the host tier's times over the other two (within a round).

    python benchmarks/kv_offloading.py [--preset configs/models/smollm2-135m.yaml]
        [--docs 8] [--doc-len 1024] [--questions 3] [--pool-docs 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

import numpy as np
import yaml

import peers
from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
QUESTION_LEN, NEW_TOKENS = 16, 16


def run(llm: LLM, prompts: list[list[int]], first: int) -> tuple[float, float, float]:
    """One request at a time: seconds a request, seconds a request after the `first`
    (the later questions), and prompt tokens computed a request."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    computed, times = 0, []
    for p in prompts:
        start = time.perf_counter()
        out = llm.generate([p], params)[0]
        times.append(time.perf_counter() - start)
        computed += len(p) - out.num_cached_tokens
    return (sum(times) / len(times), sum(times[first:]) / len(times[first:]),
            computed / len(prompts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=str(ROOT / "configs/models/smollm2-135m.yaml"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--pool-docs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model_dir = peers.checkpoint(args.preset, dtype=args.dtype)
    cfg = ModelConfig.from_file(model_dir)
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, cfg.vocab_size, args.doc_len).tolist() for _ in range(args.docs)]
    prompts = [doc + rng.integers(3, cfg.vocab_size, QUESTION_LEN).tolist()
               for _ in range(args.questions) for doc in docs]

    engine = yaml.safe_load((ROOT / "configs/engine/cpu.yaml").read_text())
    engine.pop("kv_cache_memory_gib")
    request_len = args.doc_len + QUESTION_LEN + NEW_TOKENS
    page = engine["page_size"]
    engine.update(dtype=args.dtype, max_model_len=request_len, max_num_seqs=1)
    pool = args.pool_docs * -(-request_len // page)
    everything = args.docs * args.questions * -(-request_len // page)
    kv_token_bytes = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                      * np.dtype(args.dtype).itemsize)
    host_gib = 1.5 * everything * page * kv_token_bytes / 2**30
    engines = {
        "device only": LLM(str(model_dir), **engine, num_pages=pool),
        "host tier": LLM(str(model_dir), **engine, num_pages=pool,
                         kv_offloading_size=host_gib),
        "device holds all": LLM(str(model_dir), **engine, num_pages=everything),
    }
    results = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            llm.engine.scheduler.allocator.reset_prefix_cache()
            if llm.engine.host_kv is not None:
                llm.engine.host_kv.clear()
            results[name].append(run(llm, prompts, args.docs))
            every, later, computed = results[name][-1]
            print(f"round {r} {name:>16}: {every * 1e3:8.1f} ms a request, {later * 1e3:8.1f} "
                  f"a later question, {computed:7.1f} prompt tokens computed", flush=True)

    def cell(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
        return peers.median_range([x * scale for x in values], digits)

    host = results["host tier"]
    print(f"\nkv_offloading.py: {platform.node()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{Path(args.preset).stem} {args.dtype}, {args.docs} documents of {args.doc_len} "
          f"tokens x {args.questions} questions ({QUESTION_LEN} + {NEW_TOKENS} tokens), "
          f"pool of {args.pool_docs} documents ({pool} pages), host tier {host_gib:.2f} GiB, "
          f"{args.rounds} rounds (median [min-max])")
    print("| engine | ms a request | ms a later question | prompt tokens computed a "
          "request | host tier's time over this one's, a request / a later question (same "
          "round) |\n|---|---|---|---|---|")
    for name, values in results.items():
        every, later, computed = zip(*values)
        ratios = [[h[i] / v[i] for h, v in zip(host, values)] for i in (0, 1)]
        print(f"| {name} | {cell(every, 1e3)} | {cell(later, 1e3)} | {cell(computed)} | "
              f"{cell(ratios[0], digits=2)} / {cell(ratios[1], digits=2)} |")


if __name__ == "__main__":
    main()
