"""DeepSeek-V3 (latent attention, grouped experts) on a mesh of 8 CPU devices: tensor
parallelism 4 (the 4 heads split, the latent cached whole on each device), data + tensor
parallelism, expert parallelism, data parallel attention with the experts over every
device (dp+ep on data 8, dp+tp+ep on data 4 x model 2, drafting with the checkpoint's MTP
layer), and tensor parallelism with an 8-bit latent cache.

Started by tests/test_deepseek.py in its own process (the device count is fixed when JAX
starts): `python tests/mla_multidevice_check.py MODEL_DIR OUT.json SPEC.json`
(tests/mesh_runs.py). Writes each run's greedy tokens, W_uk's and an expert stack's shard
shapes, leaked pages and compiles after warm-up.
"""

from mesh_runs import main

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64))
RUNS = {"tp 4": ({"model": 4}, "tp", {}), "dp+tp 2x2": ({"data": 2, "model": 2}, "dp+tp", {}),
        "ep 4": ({"model": 4}, "ep", {}),
        "dp+ep 8": ({"data": 8}, "dp+ep", {"max_num_seqs": 8, "num_pages": 512}),
        "dp+tp+ep 4x2 mtp": ({"data": 4, "model": 2}, "dp+tp+ep", {
            "max_num_seqs": 8, "num_pages": 512, "speculative_config": {
                "method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": None}}),
        "tp 4 int8 kv": ({"model": 4}, "tp", {"kv_cache_dtype": "int8"})}


def describe(llm) -> dict:
    layers, stats = llm.engine.runner.params["layers"], llm.engine.speculator.stats
    k_up, gate = layers[0]["attn"]["k_up"].value, layers[1]["mlp"]["gate_proj"].value
    return {"k_up_shard": list(k_up.sharding.shard_shape(k_up.shape)),
            "experts_shard": list(gate.sharding.shard_shape(gate.shape)),
            "proposed": sum(stats.proposed) if stats else 0}


if __name__ == "__main__":
    main(RUNS, ENGINE, describe)
