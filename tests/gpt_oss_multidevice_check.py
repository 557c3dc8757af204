"""gpt-oss (attention sinks, biased experts) on a mesh of 8 CPU devices: tensor parallelism
2 (the sinks split with the query heads) and 4 (each KV head stored on the 2 devices that
read it), the TPU Pallas attention kernel per device (interpret mode) under tensor
parallelism 2, expert parallelism 4 (whole experts, their biases with them), and data +
tensor parallelism.

Started by tests/test_gpt_oss.py in its own process (the device count is fixed when JAX
starts): `python tests/gpt_oss_multidevice_check.py MODEL_DIR OUT.json SPEC.json`. Writes
each run's greedy tokens, the shard shapes of a layer's sinks and gate bias, leaked pages
and compiles after warm-up.
"""

import json
import sys

from jaxserve import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(64,))
RUNS = {"tp 2": ({"model": 2}, "tp", {}), "tp 4": ({"model": 4}, "tp", {}),
        "tp 2 tpu-kernels": ({"model": 2}, "tp", {"kernel_impl": "tpu",
                                                 "interpret_kernels": True}),
        "ep 4": ({"model": 4}, "ep", {}),
        "dp+tp 2x2": ({"data": 2, "model": 2}, "dp+tp", {})}


def main(model_dir: str, out_path: str, prompts: list[list[int]], new_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = {}
    for name, (mesh, strategy, extra) in RUNS.items():
        llm = LLM(model_dir, mesh=mesh, sharding=strategy, **{**ENGINE, **extra})
        results = llm.generate(prompts, params)
        layer = llm.engine.runner.params["layers"][0]
        shard = lambda a: list(a.sharding.shard_shape(a.shape))  # noqa: E731
        out[name] = {"tokens": [o.outputs[0].token_ids for o in results],
                     "sinks_shard": shard(layer["attn"]["sinks"].get_value()),
                     "gate_bias_shard": shard(layer["mlp"]["gate_bias"].get_value()),
                     "leaked_pages": llm.engine.scheduler.num_used_pages,
                     "compiles_after_warmup": llm.engine.runner.compiles_after_warmup}
        del llm
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    spec = json.loads(sys.argv[3])
    main(sys.argv[1], sys.argv[2], spec["prompts"], spec["new_tokens"])
