"""gpt-oss (attention sinks, biased experts) on a mesh of 8 CPU devices: tensor parallelism
2 (the sinks split with the query heads) and 4 (each KV head stored on the 2 devices that
read it), the TPU Pallas kernels per device (interpret mode) under tensor parallelism 2,
expert parallelism 4 (whole experts, their biases with them), and data + tensor
parallelism; the test picks the runs (an MXFP4 checkpoint's: its fp4 experts whole on 2
devices through the TPU or the GPU kernels, interpret mode).

Started by tests/test_gpt_oss.py in its own process (the device count is fixed when JAX
starts): `python tests/gpt_oss_multidevice_check.py MODEL_DIR OUT.json SPEC.json`
(tests/mesh_runs.py). Writes each run's greedy tokens, the shard shapes of a layer's sinks
and gate bias, leaked pages and compiles after warm-up.
"""

from mesh_runs import main

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(64,))
RUNS = {"tp 2": ({"model": 2}, "tp", {}), "tp 4": ({"model": 4}, "tp", {}),
        "tp 2 tpu-kernels": ({"model": 2}, "tp", {"kernel_impl": "tpu",
                                                 "interpret_kernels": True}),
        "ep 2 tpu-kernels": ({"model": 2}, "ep", {"kernel_impl": "tpu",
                                                 "interpret_kernels": True}),
        "ep 2 gpu-kernels": ({"model": 2}, "ep", {"kernel_impl": "gpu",
                                                 "interpret_kernels": True}),
        "ep 4": ({"model": 4}, "ep", {}),
        "dp+tp 2x2": ({"data": 2, "model": 2}, "dp+tp", {})}


def describe(llm) -> dict:
    layer = llm.engine.runner.params["layers"][0]
    shard = lambda a: list(a.sharding.shard_shape(a.shape))  # noqa: E731
    return {"sinks_shard": shard(layer["attn"]["sinks"].get_value()),
            "gate_bias_shard": shard(layer["mlp"]["gate_bias"].get_value())}


if __name__ == "__main__":
    main(RUNS, ENGINE, describe)
