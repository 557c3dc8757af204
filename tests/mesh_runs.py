"""The loop the multi-device check scripts share (tests/mla_multidevice_check.py,
tests/gpt_oss_multidevice_check.py): each run's engine on its mesh, the prompts' greedy
tokens, what the script reads of the engine, leaked pages and compiles after warm-up,
written as JSON. `python SCRIPT MODEL_DIR OUT.json SPEC.json` (SPEC: prompts, new_tokens,
and optionally runs: the names of the script's runs to make, else all)."""

import json
import sys

from jaxserve import LLM, SamplingParams


def main(runs: dict, engine: dict, describe) -> None:
    """`runs`: name -> (mesh, strategy, extra engine settings); `describe(llm)`: the
    script's own fields of a run."""
    model_dir, out_path, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    out = {}
    for name in spec.get("runs", list(runs)):
        mesh, strategy, extra = runs[name]
        llm = LLM(model_dir, mesh=mesh, sharding=strategy, **{**engine, **extra})
        results = llm.generate(spec["prompts"], params)
        out[name] = {"tokens": [o.outputs[0].token_ids for o in results], **describe(llm),
                     "leaked_pages": llm.engine.scheduler.num_used_pages,
                     "compiles_after_warmup": llm.engine.runner.compiles_after_warmup}
        del llm
    with open(out_path, "w") as f:
        json.dump(out, f)
