"""DeepSeek-V3 (latent attention, grouped experts) on a mesh of 8 CPU devices: tensor
parallelism 4 (the 4 heads split, the latent cached whole on each device), data + tensor
parallelism, expert parallelism, data parallel attention with the experts over every
device (dp+ep on data 8, dp+tp+ep on data 4 x model 2, drafting with the checkpoint's MTP
layer), and tensor parallelism with an 8-bit latent cache.

Started by tests/test_deepseek.py in its own process (the device count is fixed when JAX
starts): `python tests/mla_multidevice_check.py MODEL_DIR OUT.json PROMPTS.json`. Writes each
run's greedy tokens, W_uk's and an expert stack's shard shapes, leaked pages and compiles
after warm-up.
"""

import json
import sys

from jaxserve import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64))
RUNS = {"tp 4": ({"model": 4}, "tp", {}), "dp+tp 2x2": ({"data": 2, "model": 2}, "dp+tp", {}),
        "ep 4": ({"model": 4}, "ep", {}),
        "dp+ep 8": ({"data": 8}, "dp+ep", {"max_num_seqs": 8, "num_pages": 512}),
        "dp+tp+ep 4x2 mtp": ({"data": 4, "model": 2}, "dp+tp+ep", {
            "max_num_seqs": 8, "num_pages": 512, "speculative_config": {
                "method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": None}}),
        "tp 4 int8 kv": ({"model": 4}, "tp", {"kv_cache_dtype": "int8"})}


def main(model_dir: str, out_path: str, prompts: list[list[int]], new_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = {}
    for name, (mesh, strategy, extra) in RUNS.items():
        llm = LLM(model_dir, mesh=mesh, sharding=strategy, **{**ENGINE, **extra})
        results = llm.generate(prompts, params)
        layers, stats = llm.engine.runner.params["layers"], llm.engine.speculator.stats
        k_up, gate = layers[0]["attn"]["k_up"].value, layers[1]["mlp"]["gate_proj"].value
        out[name] = {"tokens": [o.outputs[0].token_ids for o in results],
                     "k_up_shard": list(k_up.sharding.shard_shape(k_up.shape)),
                     "experts_shard": list(gate.sharding.shard_shape(gate.shape)),
                     "proposed": sum(stats.proposed) if stats else 0,
                     "leaked_pages": llm.engine.scheduler.num_used_pages,
                     "compiles_after_warmup": llm.engine.runner.compiles_after_warmup}
        del llm
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    spec = json.loads(sys.argv[3])
    main(sys.argv[1], sys.argv[2], spec["prompts"], spec["new_tokens"])
