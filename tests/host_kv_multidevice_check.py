"""The prefix cache's host tier under data parallelism (dp 2, dp+tp 2x2) over 4 CPU
devices: prompts that outgrow each data shard's pool, twice over.

Started by tests/test_host_kv_cache.py in its own process (the device count is fixed when
JAX starts): `python tests/host_kv_multidevice_check.py MODEL_DIR OUT.json SPEC.json`
(SPEC: the prompts and the new tokens). Writes, per mesh, the greedy tokens of both passes
and the host tier's counters.
"""

import json
import sys

from jaxserve import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=64, page_size=4, num_pages=64, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64), kv_offloading_size=0.001)


def main() -> None:
    path, out, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0, ignore_eos=True)
    runs = {}
    for name, mesh, sharding in (("dp 2", {"data": 2}, "dp"),
                                 ("dp+tp 2x2", {"data": 2, "model": 2}, "dp+tp")):
        llm = LLM(path, mesh=mesh, sharding=sharding, **ENGINE)
        tokens = [[o.outputs[0].token_ids for o in llm.generate(spec["prompts"], params)]
                  for _ in range(2)]
        status = llm.engine.status()
        runs[name] = dict(tokens=tokens, host_hits=status.host_hits,
                          offloaded=status.pages_offloaded, used_pages=status.num_used_pages)
    with open(out, "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main()
