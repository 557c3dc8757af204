"""Prefill on one mesh, decode on another, over 8 CPU devices: the tokens of one engine.

Started by tests/test_disaggregation.py in its own process (the device count is fixed
when JAX starts): `python tests/disaggregation_check.py MODEL_DIR OUT.json`. For each
pair of strategies it runs a batch of mixed prompts (greedy and seeded sampling) through
a DisaggregatedEngine, prefill on devices 0-3 and decode on 4-7, and writes the tokens,
the pages in use on each side afterwards, the compiles after warm-up, and the moved
pages' placement on the decode mesh; and the same batch through one engine on one device.
"""

import json
import sys

import numpy as np

from jaxserve import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=(32,))
PREFILL_DEVICES, DECODE_DEVICES = [0, 1, 2, 3], [4, 5, 6, 7]
# (name, prefill settings, decode settings, common settings). The model has 2 KV heads:
# TP=2 stores each once per device, TP=4 twice (kv_head_replicas 2), so the moved pages
# change layout between the sides.
PAIRS = [
    ("tp4 -> dp2+tp2", dict(mesh={"model": 4}, sharding="tp"),
     dict(mesh={"data": 2, "model": 2}, sharding="dp+tp"), {}),
    ("dp4 -> tp4", dict(mesh={"data": 4}, sharding="dp"),
     dict(mesh={"model": 4}, sharding="tp"), {}),
    ("tp2 -> tp4+sp", dict(mesh={"model": 2}, sharding="tp"),
     dict(mesh={"model": 4}, sharding="tp+sp"), {}),
    ("int8 kv: tp4 -> dp2+tp2", dict(mesh={"model": 4}, sharding="tp"),
     dict(mesh={"data": 2, "model": 2}, sharding="dp+tp"), dict(kv_cache_dtype="int8")),
]


def batch():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (5, 17, 30, 43, 61, 9)]
    params = [SamplingParams(max_tokens=12, temperature=0, logprobs=2),
              SamplingParams(max_tokens=10, temperature=0.9, seed=11),
              SamplingParams(max_tokens=1, temperature=0),
              SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(max_tokens=16, temperature=0, logprobs=2),
              SamplingParams(max_tokens=7, temperature=1.0, top_k=20, seed=2)]
    return prompts, params


def main(model_dir: str, out_path: str) -> None:
    prompts, params = batch()
    results = {}
    for name, kv in (("one device", {}), ("one device int8 kv", {"kv_cache_dtype": "int8"})):
        llm = LLM(model_dir, **ENGINE, **kv)
        outs = llm.generate(prompts, params)
        results[name] = {"tokens": [o.outputs[0].token_ids for o in outs],
                         "logprobs": _logprobs(outs)}
        del llm
    for name, prefill, decode, common in PAIRS:
        prefill = {"devices": PREFILL_DEVICES[:_size(prefill)], **prefill}
        llm = LLM(model_dir, prefill=prefill,
                  decode={"devices": DECODE_DEVICES[:_size(decode)], **decode},
                  **ENGINE, **common)
        outs = llm.generate(prompts, params)
        e = llm.engine
        results[name] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": _logprobs(outs),
            "used_pages": [e.prefill.status().num_used_pages, e.decode.status().num_used_pages],
            "handoffs": e.num_handoffs,
            "compiles_after_warmup": e.prefill.runner.compiles_after_warmup
            + e.decode.runner.compiles_after_warmup,
            "decode_devices": sorted(d.id for d in e.decode.mesh.devices.flat),
            "prefill_devices": sorted(d.id for d in e.prefill.mesh.devices.flat),
        }
        del llm, e
    with open(out_path, "w") as f:
        json.dump(results, f)


def _logprobs(outs) -> list[float]:
    """The sampled tokens' logprobs of the requests that asked for them, in order."""
    return [top[token].logprob for o in outs if o.outputs[0].logprobs
            for token, top in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]


def _size(settings: dict) -> int:
    return int(np.prod(list(settings["mesh"].values())))


if __name__ == "__main__":
    main(*sys.argv[1:])
