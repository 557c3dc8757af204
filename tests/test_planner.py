"""`jaxserve plan`: --compare (one table), --plot (a PNG) and GPU targets (the step compiled
by XLA:CPU on as many emulated devices, in a child process when this one has fewer).

Llama-3-8B's dimensions with 2 layers and small buckets keep each compile to seconds.
"""

from __future__ import annotations

import re

import pytest

from jaxserve.cli import main
from jaxserve.config import ModelConfig

SMALL = ["--max-model-len", "1024", "--max-num-seqs", "16", "--max-num-batched-tokens", "128"]
LLAMA3_8B_2L = ModelConfig.from_file("configs/models/llama3-8b.yaml").first_layers(2)
BF16_WEIGHTS = LLAMA3_8B_2L.num_params() * 2  # bytes on one device


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    path = tmp_path_factory.mktemp("preset") / "llama3-8b-2l.yaml"
    text = open("configs/models/llama3-8b.yaml").read()
    assert "num_hidden_layers: 32" in text
    path.write_text(text.replace("num_hidden_layers: 32", "num_hidden_layers: 2"))
    return str(path)


def gib(text: str) -> float:
    return float(re.match(r"([\d.]+) GiB", text.strip()).group(1)) * 2**30


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000, len(data)  # axes, bars, labels: not an empty canvas


@pytest.mark.slow  # ~30-60 s on a 2-core machine
def test_compare_two_tpu_slices_in_one_table(preset, tmp_path, capsys):
    """2 and 4 v5e chips in one table, one row each: tensor parallelism halves weights and
    KV per chip (8 KV heads split 2 and 4 ways); 4 chips as 2 data-parallel groups of 2
    hold what 2-way TP holds per chip; the same plans draw one PNG."""
    pytest.importorskip("libtpu", reason="libtpu is not installed: pip install 'jax[tpu]'")
    plot = tmp_path / "compare.png"
    code = main(["plan", "--model", preset, "--compare", "v5e:1x2/tp,v5e:2x2/tp,v5e:2x2/dp+tp",
                 "--plot", str(plot), *SMALL])
    out = capsys.readouterr().out
    assert code == 0
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) == 5 and table[0].startswith("| config "), out  # head, rule, 3 rows
    head = [c.strip() for c in table[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in table[2:]]
    assert [(r["config"], r["chips"], r["HBM/chip"]) for r in rows] == [
        ("v5e:1x2/tp", "2", "16.00 GiB"), ("v5e:2x2/tp", "4", "16.00 GiB"),
        ("v5e:2x2/dp+tp", "4", "16.00 GiB")]
    w2, w4, dp = (gib(r["weights/chip"]) for r in rows)
    assert abs(w2 / w4 - 2) < 2 * 0.03, (w2, w4)
    assert abs(w2 - BF16_WEIGHTS / 2) / (BF16_WEIGHTS / 2) < 0.03, (w2, BF16_WEIGHTS)
    assert abs(dp - w2) / w2 < 0.01, (dp, w2)
    assert [r["KV/token/chip"] for r in rows] == ["4.0 KiB", "2.0 KiB", "4.0 KiB"]
    assert all(r["fits"] == "yes" and re.search(r"AR x\d+", r["decode collectives"])
               for r in rows)
    assert "*" not in out  # nothing on a TPU is a CPU-compiled estimate
    assert_png(plot)


def test_plot_of_one_gpu_plan(preset, tmp_path, capsys):
    """--plot with a single plan; h100x1 compiles in this process (one CPU device)."""
    pytest.importorskip("matplotlib")
    plot = tmp_path / "one.png"
    assert main(["plan", "--model", preset, "--target", "h100x1", "--plot", str(plot),
                 *SMALL]) == 0
    assert f"wrote {plot}" in capsys.readouterr().out
    assert_png(plot)


def test_gpu_target_in_child_process_splits_weights_and_marks_estimates(preset, capsys):
    """h100x2 needs 2 CPU devices, so it plans in a child process: the weights per GPU are
    half of one device's, the child really compiled 2-way TP (its argument bytes match and
    it all-reduces), and what came from XLA:CPU says so."""
    assert main(["plan", "--model", preset, "--target", "h100x2", *SMALL]) == 0
    out = capsys.readouterr().out
    rows = dict((k.strip(), v.strip()) for k, v in
                (line.strip("|").split("|", 1) for line in out.splitlines()[2:]))
    weights = gib(rows["weights per GPU (exact)"])
    assert abs(weights - BF16_WEIGHTS / 2) / (BF16_WEIGHTS / 2) < 0.03, (weights, BF16_WEIGHTS)
    ratio = float(re.search(r"ratio ([\d.]+)", rows["weights per GPU (exact)"]).group(1))
    assert abs(ratio - 1) < 0.03
    assert rows["target"].startswith("h100x2 (2 GPUs emulated by 2 XLA:CPU devices, 80.00 GiB")
    # 2 layers x K,V x 4 heads x 128 x 2 B
    assert rows["KV cache per token per GPU"] == "4.0 KiB (4 KV heads per GPU)"
    assert rows["attention"].startswith("reference") and "no Pallas TPU kernel" in rows["attention"]
    assert re.search(r"all-reduce x\d+", rows["decode step, 16 tokens: collectives"])
    for key in ("temporary memory (max bucket)", "KV tokens that fit in the rest",
                "fits its seqs x max_model_len", "decode step, 16 tokens: collectives",
                "decode step: XLA cost estimate"):
        assert rows[key].endswith("(CPU-compiled estimate)"), (key, rows[key])
    assert "(CPU-compiled estimate)" not in rows["weights per GPU (exact)"]


def test_gpu_plan_takes_out_xla_cpu_artefacts():
    """XLA:CPU converts bf16 weights to f32 before its matmuls (all at once); the GPU plan
    removes those copies, so a decode step's temporaries are small. Its FLOPs are ~2 x
    tokens x matmul params (the planned program is the forward pass, without the
    sampler)."""
    from sharding.planner import plan_target

    p = plan_target(LLAMA3_8B_2L, "h100x2", max_model_len=1024, max_num_seqs=16,
                    max_num_batched_tokens=128)
    decode = p["buckets"]["decode"]
    assert p["platform"] == "gpu" and p["chips"] == 2
    assert decode["cpu_temp_bytes"] > p["weight_bytes"]  # the f32 copies, as XLA:CPU has them
    assert p["temp_bytes"] < 0.05 * p["weight_bytes"]
    matmul_params = LLAMA3_8B_2L.num_params() - LLAMA3_8B_2L.vocab_size * LLAMA3_8B_2L.hidden_size
    expected = 2 * 16 * matmul_params / 2
    assert abs(decode["flops"] - expected) / expected < 0.15, (decode["flops"], expected)
    assert decode["bytes_accessed"] < 2 * p["weight_bytes"]


def test_lora_slots_are_counted_on_every_chip_and_come_out_of_the_kv_cache(preset, capsys):
    """--max-loras 8 --max-lora-rank 16: A [8, in, 16] and B [8, 16, out] of the seven
    projections of each layer, in bf16, on the GPU beside the weights; the KV tokens that
    fit shrink by at least their size."""
    from sharding.planner import plan_target

    small = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=128)
    base = plan_target(LLAMA3_8B_2L, "h100x1", **small)
    assert main(["plan", "--model", preset, "--target", "h100x1", "--max-loras", "8",
                 *SMALL]) == 0
    rows = dict((k.strip(), v.strip()) for k, v in
                (line.strip("|").split("|", 1) for line in capsys.readouterr().out.splitlines()[2:]))
    c = LLAMA3_8B_2L
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    e, m = c.hidden_size, c.intermediate_size
    per_rank = (e + q) + 2 * (e + kv) + (q + e) + 2 * (e + m) + (m + e)
    want = c.num_layers * 8 * 16 * per_rank * 2
    assert rows["LoRA adapters per GPU"] == f"{want / 2**30:.2f} GiB (8 slots of rank 16, replicated)"
    with_lora = plan_target(LLAMA3_8B_2L, "h100x1", max_loras=8, **small)
    assert with_lora["lora_bytes"] == want
    assert with_lora["weight_bytes"] == base["weight_bytes"]
    fewer = base["kv_tokens_that_fit"] - with_lora["kv_tokens_that_fit"]
    assert fewer >= want // base["kv_bytes_per_token"], (fewer, want)
    assert base["lora_bytes"] == 0


@pytest.mark.slow  # ~30-60 s on a 2-core machine
def test_tpu_steps_with_lora_adapters_compile_on_one_chip_and_on_a_mesh(preset, capsys):
    """On one v5e chip the deltas are our Pallas grouped-matmul kernels (two per projection
    and layer beside the attention's); on 2 chips with TP, XLA's ragged_dot partitioned
    along the projections (a Pallas kernel cannot be split automatically). The stacks are
    out of the weights' count on both."""
    pytest.importorskip("libtpu", reason="libtpu is not installed: pip install 'jax[tpu]'")

    def rows(topology, loras):
        assert main(["plan", "--model", preset, "--topology", topology, "--max-loras", loras,
                     *SMALL]) == 0
        out = capsys.readouterr().out
        return dict((k.strip(), v.strip()) for k, v in
                    (line.strip("|").split("|", 1) for line in out.splitlines()[2:]))

    def mosaic_calls(r):
        return int(re.search(r"\((\d+) Mosaic calls", r["attention"]).group(1))

    base, one, two = rows("v5e:1x1", "0"), rows("v5e:1x1", "4"), rows("v5e:1x2", "4")
    assert mosaic_calls(one) - mosaic_calls(base) == 2 * 7 * LLAMA3_8B_2L.num_layers
    assert "LoRA deltas" in one["attention"] and "LoRA deltas" not in base["attention"]
    for r in (one, two):
        assert r["LoRA adapters per chip"].endswith("(4 slots of rank 16, replicated)")
        assert r["weights per chip (analytic)"].endswith("(ratio 1.000)")
    assert re.search(r"all-reduce x\d+", two["decode step, 16 tokens: collectives"])


@pytest.mark.parametrize("args,message", [
    (["--target", "h100x3"], "unknown target 'h100x3'"),
    (["--target", "tpu9x8"], "unknown target 'tpu9x8'"),
    (["--topology", "v5e:2x2", "--target", "h100x8"], "mutually exclusive"),
    ([], "--topology v5e:2x2 (TPU), --target h100x8"),
    (["--topology", "h100x8"], "not a TPU slice"),
    (["--target", "v5e:2x2"], "not a GPU target"),
    (["--compare", "v5e:2x2/tp", "--target", "h100x8"], "leave out --topology and --target"),
    (["--compare", "v5e:2x2/xp"], "strategy 'xp' is unknown"),
    (["--compare", "v5e:2x2/tp/int3"], "weights 'int3' are unknown"),
    (["--compare", "h200x3/tp"], "unknown target 'h200x3'"),
    (["--target", "h100x1", "--plot", "/no/such/folder/plan.png"], "does not exist"),
])
def test_bad_targets_are_a_clear_error(preset, capsys, args, message):
    assert main(["plan", "--model", preset, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_compare_entries_take_the_command_flags_as_defaults():
    from sharding.planner import parse_compare

    got = parse_compare("v5e:2x2, v6e:2x4/tp+sp, h100x8/tp/none, v5e:4x4/tp/int4/fp8",
                        strategy="tp", quantization="int8", kv_cache_dtype_name="int8")
    assert got == [
        {"target": "v5e:2x2", "strategy": "tp", "quantization": "int8",
         "kv_cache_dtype_name": "int8"},
        {"target": "v6e:2x4", "strategy": "tp+sp", "quantization": "int8",
         "kv_cache_dtype_name": "int8"},
        {"target": "h100x8", "strategy": "tp", "quantization": None, "kv_cache_dtype_name": "int8"},
        {"target": "v5e:4x4", "strategy": "tp", "quantization": "int4",
         "kv_cache_dtype_name": "fp8"},
    ]


def test_collectives_are_counted_where_xla_combined_them():
    """A TPU program's all-reduces combined into one of a tuple (as in gpt-oss-120b's step
    under ep, whose plan read "none"): counted once with every result's bytes; operands
    that name a collective (get-tuple-element(%all-reduce.28)) are not collectives; an
    asynchronous all-gather's (operand, result) counts its result."""
    from sharding.planner import collective_bytes

    hlo = """
  %all-reduce.28 = (bf16[64,2880]{1,0:T(8,128)(2,1)S(1)}, bf16[64,4,2880]{2,1,0:T(4,128)(2,1)S(1)}) all-reduce(%scatter_custom_fusion.7, %broadcast_select), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
  %get-tuple-element.966 = bf16[64,4,2880]{2,1,0:T(4,128)(2,1)S(1)} get-tuple-element(%all-reduce.28), index=1
  %all-gather-start.1 = (f32[8,128]{1,0}, f32[32,128]{1,0}) all-gather-start(%p.1), dimensions={0}
  %all-reduce.3 = f32[16,4096]{1,0:T(8,128)} all-reduce(%dot.2), to_apply=%add
"""
    assert collective_bytes(hlo) == {
        "all-reduce": (2, 2 * (64 * 2880 + 64 * 4 * 2880) + 4 * 16 * 4096),
        "all-gather": (1, 4 * 32 * 128)}
