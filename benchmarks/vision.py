"""Images: time to first token of a one-image request, and throughput of a mixed text /
image workload, with the encoder cache hit and missed, against text-only prompts of the
same length (the ceiling: no tower to run).

No trained vision-language model is reachable here, so the checkpoint is a random
LLaVA-1.5-style one built by transformers and cached: a CLIP tower (hidden 384, 7 layers,
224-pixel images in 14-pixel patches: 256 tokens per image, features of layer -2) and a
SmolLM2-135M-shaped Llama (hidden 576, 30 layers). Engine settings from
configs/engine/cpu.yaml, prefix caching off (so that only the encoder cache can spare
the tower). Workloads, each once per round, in turn:
  ttft      one request (32 text tokens + 1 image), 1 new token: a new image (the tower
            runs), the last round's image after other text (an encoder-cache hit), and a
            text-only prompt of the same 288 tokens;
  mixed     32 requests of 64 new tokens, 16 with an image: 16 distinct new images, the
            same 4 images repeated (12 hits), and all text of the same lengths.
Reported: medians over --rounds with their spread (min-max), ratios to text-only taken
within each round (the VM's speed drifts).

    python benchmarks/vision.py [--rounds 3] [--dtype float32] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from jaxserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "jaxserve" / "bench" / "llava-bench"
IMAGE_TOKEN = 49151  # the vocabulary's last id stands for <image>
TOKENS_PER_IMAGE = 256
TEXT_TOKENS = 32


def checkpoint() -> Path:
    """The random LLaVA checkpoint (built once with transformers, then cached)."""
    if (CACHE / "config.json").exists():
        return CACHE
    import torch
    import transformers as tf

    from jaxserve.demo import write_byte_tokenizer

    vision = tf.CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=7,
                                 num_attention_heads=6, image_size=224, patch_size=14)
    text = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
                          tie_word_embeddings=True)
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    torch.manual_seed(0)
    CACHE.mkdir(parents=True, exist_ok=True)
    tf.LlavaForConditionalGeneration(cfg).save_pretrained(CACHE)
    write_byte_tokenizer(CACHE)
    tf.CLIPImageProcessorPil(size={"shortest_edge": 224},
                             crop_size={"height": 224, "width": 224}).save_pretrained(CACHE)
    return CACHE


def image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((300, 400, 3)) * 255).astype(np.uint8))


def prompt(seed: int, with_image: bool) -> list[int]:
    rng = np.random.default_rng(seed)
    text = rng.integers(3, 259, TEXT_TOKENS).tolist()
    if with_image:
        return [0, *text[:4], IMAGE_TOKEN, *text[4:]]
    return [0, *rng.integers(3, 259, TEXT_TOKENS + TOKENS_PER_IMAGE).tolist()]


def timed(llm: LLM, requests: list[dict], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(requests, params)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = yaml.safe_load((ROOT / "configs/engine/cpu.yaml").read_text())
    engine.update(dtype=args.dtype, enable_prefix_caching=False, max_model_len=1024)
    llm = LLM(model=str(checkpoint()), **engine)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    rows: dict[str, list[float]] = {}
    seed = 1000
    for r in range(args.rounds):
        seed += 100
        # Warm the tower and the buckets once before timing (round 0 too).
        llm.generate({"prompt_token_ids": prompt(seed, True),
                      "multi_modal_data": {"image": image(seed)}}, one)
        t_new, _ = timed(llm, [{"prompt_token_ids": prompt(seed + 1, True),
                                "multi_modal_data": {"image": image(seed + 1)}}], one)
        t_hit, _ = timed(llm, [{"prompt_token_ids": prompt(seed + 2, True),
                                "multi_modal_data": {"image": image(seed + 1)}}], one)
        t_text, _ = timed(llm, [{"prompt_token_ids": prompt(seed + 3, False)}], one)
        distinct = [{"prompt_token_ids": prompt(seed + 10 + i, i % 2 == 0),
                     **({"multi_modal_data": {"image": image(seed + 10 + i)}} if i % 2 == 0
                        else {})} for i in range(32)]
        repeated = [{"prompt_token_ids": prompt(seed + 50 + i, i % 2 == 0),
                     **({"multi_modal_data": {"image": image(seed + 50 + i // 2 % 4)}}
                        if i % 2 == 0 else {})} for i in range(32)]
        text = [{"prompt_token_ids": prompt(seed + 90 + i, False)} for i in range(32)]
        m_new, n_new = timed(llm, distinct, many)
        m_hit, n_hit = timed(llm, repeated, many)
        m_text, n_text = timed(llm, text, many)
        for name, value in (("ttft new image (ms)", t_new * 1e3),
                            ("ttft encoder-cache hit (ms)", t_hit * 1e3),
                            ("ttft text only (ms)", t_text * 1e3),
                            ("ttft new image / text", t_new / t_text),
                            ("ttft hit / text", t_hit / t_text),
                            ("mixed, 16 new images (tok/s)", n_new / m_new),
                            ("mixed, 4 images repeated (tok/s)", n_hit / m_hit),
                            ("mixed, text only (tok/s)", n_text / m_text),
                            ("mixed new / text", (n_new / m_new) / (n_text / m_text)),
                            ("mixed repeated / text", (n_hit / m_hit) / (n_text / m_text))):
            rows.setdefault(name, []).append(value)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    stats = llm.engine.status().images
    print(f"\n{platform.processor() or platform.machine()}, {datetime.date.today()}, "
          f"{args.dtype}, {args.rounds} rounds; images encoded {stats.images_encoded}, "
          f"encoder-cache hits {stats.encoder_cache_hits}\n")
    print("| measure | median | spread (min-max) |\n|---|---|---|")
    for name, values in rows.items():
        fmt = "{:.2f}" if "/" in name and "(" not in name else "{:.1f}"
        print(f"| {name} | {fmt.format(statistics.median(values))} | "
              f"{fmt.format(min(values))}-{fmt.format(max(values))} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": str(datetime.date.today()),
                                               "dtype": args.dtype, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
