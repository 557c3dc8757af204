"""LoRA adapters on a mesh of 8 CPU devices: a batch mixing adapters and the base model
under tensor parallelism 2 and 4 (the tiny Llama's 2 KV heads each stored on the 2
devices that read them: the adapters' k/v B repeated alike), tensor + sequence
parallelism and data + tensor parallelism.

Started by tests/test_lora.py in its own process (the device count is fixed when JAX
starts): `python tests/lora_multidevice_check.py MODEL_DIR OUT.json NAME=ADAPTER_DIR...`.
Writes each mesh's greedy tokens per (prompt, adapter).
"""

import json
import sys

from jaxserve import LLM, LoRARequest, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=8,
              max_num_batched_tokens=64, token_buckets=(64,), enable_lora=True,
              max_loras=2, max_lora_rank=8)
MESHES = {"tp2": ({"model": 2}, "tp"), "tp4": ({"model": 4}, "tp"),
          "tp4+sp": ({"model": 4}, "tp+sp"), "dp2+tp2": ({"data": 2, "model": 2}, "dp+tp")}


def main(model_dir: str, out_path: str, adapters: list[str], prompts: list[list[int]],
         new_tokens: int) -> None:
    reqs = [None] + [LoRARequest(name, i + 1, path) for i, (name, path) in
                     enumerate(a.split("=", 1) for a in adapters)]
    batch = [(p, r) for p in prompts for r in reqs]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = {}
    for name, (mesh, strategy) in MESHES.items():
        llm = LLM(model_dir, mesh=mesh, sharding=strategy, **ENGINE)
        results = llm.generate([p for p, _ in batch], params, lora_request=[r for _, r in batch])
        out[name] = [[r.lora_name if r else None, o.outputs[0].token_ids]
                     for (_, r), o in zip(batch, results)]
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    spec = json.loads(sys.argv[3])
    main(sys.argv[1], sys.argv[2], spec["adapters"], spec["prompts"], spec["new_tokens"])
