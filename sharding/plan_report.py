"""What `jaxserve plan` prints and draws: one plan's table, a comparison table, a chart.

The plans themselves (dicts) come from sharding/planner.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from sharding.planner import CPU_ESTIMATE


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def _collectives_text(counts: dict, abbreviate: bool = False) -> str:
    names = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
             "all-to-all": "A2A", "collective-permute": "CP"}
    return ", ".join(f"{names[k] if abbreviate else k} x{c} ({v / 2**20:.1f} MiB)"
                     for k, (c, v) in sorted(counts.items())) or "none"


def format_plan(p: dict) -> str:
    gpu = p["platform"] == "gpu"
    unit = "GPU" if gpu else "chip"
    est = f" {CPU_ESTIMATE}" if gpu else ""
    heads = p["kv_heads_per_chip"]
    kv_note = f" ({heads} KV head{'s' if heads > 1 else ''} per {unit})"
    what = (f"{p['chips']} GPUs emulated by {p['chips']} XLA:CPU devices" if gpu
            else f"{p['chips']} chips")
    rows = [
        ("model", f"{p['model_params'] / 1e9:.2f}B params, {p['dtype']}, weights "
                  f"{p['quantization'] or p['dtype']}, KV cache {p['kv_cache_dtype']}"),
        ("target" if gpu else "topology",
         f"{p['target']} ({what}, {_gib(p['hbm_bytes'])} HBM each), strategy {p['strategy']}, "
         f"mesh data={p['mesh']['data']} x model={p['mesh']['model']}"),
        ("attention", p["attention"]),
    ]
    if gpu:
        compiled = p["compiled_weight_bytes"]
        upcast = max((b.get("cpu_weight_upcast_bytes", 0) for b in p["buckets"].values()),
                     default=0)
        rows += [
            ("estimates", "weights and KV per GPU are exact (shapes and shardings); "
                          f"temporaries, collectives and cost are {CPU_ESTIMATE[1:-1]}s, less "
                          f"XLA:CPU's f32 copies of 16-bit weights ({_gib(upcast)})"),
            ("weights per GPU (exact)", _gib(p["weight_bytes"]) + (
                "" if compiled is None else f" (XLA:CPU arguments: {_gib(compiled)}, "
                                            f"ratio {compiled / p['weight_bytes']:.3f})")),
        ]
    else:
        rows += [
            ("weights per chip (compiled)", _gib(p["weight_bytes"])),
            ("weights per chip (analytic)",
             f"{_gib(p['analytic_weight_bytes'])} "
             f"(ratio {p['weight_bytes'] / p['analytic_weight_bytes']:.3f})"),
        ]
    if p.get("vision_bytes"):
        rows.append((f"vision tower per {unit}",
                     f"{_gib(p['vision_bytes'])} ({p['vision_params'] / 1e6:.0f}M parameters "
                     "and the encoder cache's default rows, replicated)"))
    if p.get("lora_bytes"):
        rows.append((f"LoRA adapters per {unit}",
                     f"{_gib(p['lora_bytes'])} ({p['max_loras']} slots of rank "
                     f"{p['max_lora_rank']}, replicated)"))
    rows += [
        (f"KV cache per token per {unit}", f"{p['kv_bytes_per_token'] / 1024:.1f} KiB{kv_note}"),
        ("temporary memory (max bucket)", f"{_gib(p['temp_bytes'])}{est}"),
        ("KV tokens that fit in the rest", f"{p['kv_tokens_that_fit']:,}{est}"),
        ("fits its seqs x max_model_len", f"{'yes' if p['fits'] else 'NO'} "
                                              f"({p['wanted_kv_tokens']:,} tokens wanted){est}"),
    ]
    for name, b in p["buckets"].items():
        if "error" in b:
            rows.append((f"{name} step, {b['tokens']} tokens", f"does not compile: {b['error']}"))
            continue
        rows.append((f"{name} step, {b['tokens']} tokens: collectives",
                     _collectives_text(b["collectives"]) + est))
        rows.append((f"{name} step: XLA cost estimate",
                     f"{b['flops'] / 1e12:.3f} TFLOP, {b['bytes_accessed'] / 2**30:.2f} GiB "
                     f"accessed{est}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"| {('per ' + unit).ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def plan_label(p: dict) -> str:
    """'v5e:2x2/tp', with weights and KV dtype when they are not the model dtype."""
    label = f"{p['target']}/{p['strategy']}"
    if p["quantization"] or p["kv_cache_dtype"] != "auto":
        label += f"/{p['quantization'] or 'none'}"
    if p["kv_cache_dtype"] != "auto":
        label += f"/{p['kv_cache_dtype']}"
    return label


def format_compare(plans: list[dict]) -> str:
    """One Markdown table, a row per plan; '*' marks GPU numbers that are CPU-compiled
    estimates."""
    head = ["config", "chips", "HBM/chip", "weights/chip", "KV/token/chip", "KV tokens fit",
            "temp", "fits", "decode collectives", "decode TFLOP", "decode GiB accessed"]
    rows = []
    for p in plans:
        star = "*" if p["platform"] == "gpu" else ""
        d = p["buckets"].get("decode", {})
        if "error" in d or not d:
            coll = flops = accessed = "does not compile"
        else:
            coll = _collectives_text(d["collectives"], abbreviate=True) + star
            flops = f"{d['flops'] / 1e12:.3f}{star}"
            accessed = f"{d['bytes_accessed'] / 2**30:.2f}{star}"
        weights = _gib(p["weight_bytes"]) + (
            f" + LoRA {_gib(p['lora_bytes'])}" if p.get("lora_bytes") else "")
        rows.append([plan_label(p), str(p["chips"]), _gib(p["hbm_bytes"]), weights,
                     f"{p['kv_bytes_per_token'] / 1024:.1f} KiB",
                     f"{p['kv_tokens_that_fit']:,}{star}", _gib(p["temp_bytes"]) + star,
                     ("yes" if p["fits"] else "NO") + star, coll, flops, accessed])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    lines = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [line(r) for r in rows]
    p0 = plans[0]
    lines.append(f"\n{p0['model_params'] / 1e9:.2f}B params, {p0['dtype']}; KV wanted per "
                 f"chip: max_num_seqs (of its data-parallel group) x max_model_len. Per chip "
                 f"(per GPU). Collectives: AR all-reduce, AG all-gather, RS reduce-scatter, "
                 f"A2A all-to-all, CP collective-permute (count, result bytes).")
    if any(p["platform"] == "gpu" for p in plans):
        lines.append(f"* {CPU_ESTIMATE}: GPU targets compile on XLA:CPU devices with reference "
                     "attention (no Pallas TPU kernel on CPU, no GPU kernel here); their "
                     "weights and KV per GPU are exact (shapes and shardings).")
    return "\n".join(lines)


def check_plot(path: str | os.PathLike) -> None:
    """Raise ValueError now, before minutes of compiling, if `plot_memory` could not write
    `path`: no matplotlib, or no such folder."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or the 'plot' "
                         "extra: pip install 'jaxserve[plot]')") from None
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"--plot {path}: folder {folder} does not exist")


def plot_memory(plans: list[dict], path: str | os.PathLike) -> None:
    """A bar per plan of per-chip memory (weights, KV for max_num_seqs x max_model_len,
    temporaries), stacked, against its HBM (a red line). Needs matplotlib."""
    check_plot(path)
    from matplotlib.figure import Figure  # no pyplot: no global backend or state

    gib = 2**30
    x = list(range(len(plans)))
    weights = [(p["weight_bytes"] + p.get("lora_bytes", 0)) / gib for p in plans]
    kv = [p["wanted_kv_tokens"] * p["kv_bytes_per_token"] / gib for p in plans]
    temp = [p["temp_bytes"] / gib for p in plans]
    labels = [plan_label(p) + ("*" if p["platform"] == "gpu" else "") for p in plans]
    fig = Figure(figsize=(max(6.0, 1.4 * len(plans) + 4), 4.8), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(x, weights, color="tab:blue", label="weights" + (
        " (and LoRA slots)" if any(p.get("lora_bytes") for p in plans) else ""))
    ax.bar(x, kv, bottom=weights, color="tab:orange",
           label=f"KV cache ({plans[0]['max_num_seqs']} seqs x {plans[0]['max_model_len']} tokens)")
    ax.bar(x, temp, bottom=[w + k for w, k in zip(weights, kv)], color="tab:green",
           label="temporaries")
    ax.hlines([p["hbm_bytes"] / gib for p in plans], [i - 0.45 for i in x],
              [i + 0.45 for i in x], colors="red", linewidths=2, label="HBM per chip")
    for i, total in enumerate(w + k + t for w, k, t in zip(weights, kv, temp)):
        ax.annotate(f"{total:.1f}", (i, total), ha="center", va="bottom", fontsize="small")
    slanted = max(len(label) for label in labels) * len(plans) > 48
    ax.set_xticks(x, labels, rotation=20 if slanted else 0, ha="right" if slanted else "center")
    ax.set_ylabel("GiB per chip")
    ax.set_title(f"{plans[0]['model_params'] / 1e9:.2f}B params, {plans[0]['dtype']}: "
                 f"memory per chip")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if any(p["platform"] == "gpu" for p in plans):
        ax.set_xlabel("* GPU: temporaries are XLA:CPU-compiled estimates", fontsize="small")
    fig.savefig(path, dpi=100)
