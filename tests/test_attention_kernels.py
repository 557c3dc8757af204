"""The Pallas attention kernels against the reference, in interpret mode on CPU (the GPU
kernel compiled, on a GPU).

Every case draws a fresh random ragged batch (its own seed): contexts from 1 token to
several pages, page tables shuffled, padding sequences and padding tokens past the real
ones. The reference itself is checked against dense numpy attention in
test_reference_attention.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import kernel_interpret
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_kv
from ragged_lengths import draw_images, draw_lengths, draw_trees

KERNELS = ["tpu", "gpu"]


def ragged_batch(rng, kind, *, num_seqs=5, page_size=8, num_kv_heads=2, group=4, head_dim=64,
                 max_pages=5, dtype=jnp.float32, kv_dtype=None, latent=False):
    """decode: one new token per sequence; prefill: whole prompts; mixed: both, plus
    prefill chunks that continue an earlier context. `latent`: the V pages are the K pages
    (DeepSeek's latent attention), passed as v_pages None (and v_scales None)."""
    kv_lens, q_lens = draw_lengths(rng, kind, num_seqs, max_pages * page_size)
    max_seqs, pad_tokens = num_seqs + 3, 5  # padding sequence slots and padding tokens
    num_pages = num_seqs * max_pages + 7
    page_indices = np.zeros((max_seqs, max_pages), np.int32)
    page_indices[:num_seqs] = rng.permutation(num_pages)[: num_seqs * max_pages].reshape(
        num_seqs, max_pages)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = k if latent else rng.standard_normal(shape).astype(np.float32)
    t = sum(q_lens) + pad_tokens
    q = rng.standard_normal((t, num_kv_heads * group, head_dim)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(max_seqs - num_seqs, sum(q_lens))])
    batch = dict(q=jnp.asarray(q, dtype), kv_lens=jnp.asarray(np.pad(kv_lens, (0, 3)), jnp.int32),
                 page_indices=jnp.asarray(page_indices), cu_q_lens=jnp.asarray(cu, jnp.int32),
                 num_seqs=jnp.int32(num_seqs))
    if kv_dtype is None:
        batch.update(k_pages=jnp.asarray(k, dtype), v_pages=jnp.asarray(v, dtype))
    else:  # store every slot through the quantizing write path
        tokens = lambda x: x.transpose(1, 2, 0, 3).reshape(-1, num_kv_heads, head_dim)  # noqa: E731
        empty = jnp.zeros(shape, kv_dtype)
        ones = jnp.ones(shape[:3], jnp.float32)
        kq, vq, ks, vs = write_kv(empty, empty, tokens(k), tokens(v),
                                  jnp.arange(num_pages * page_size), ones, ones)
        batch.update(k_pages=kq, v_pages=vq, k_scales=ks, v_scales=vs)
    if latent:
        batch.update(v_pages=None, v_scales=None)
    return batch, sum(q_lens)


# f32: the kernels and the reference differ only in summation order (~1e-6).
# bf16: the kernels round probabilities to bf16 before the P·V matmul (MXU / tensor-core
# input) and both round the output to bf16: 8-bit mantissas, relative 2^-9 each, on
# outputs of magnitude <= ~3 (averages of N(0,1) values), so 2e-2 absolute.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

CASES = [
    dict(kind="decode", group=1, head_dim=64),
    dict(kind="prefill", group=4, head_dim=128),
    dict(kind="mixed", group=8, head_dim=64),
    dict(kind="mixed", group=4, head_dim=128, num_kv_heads=1),
    dict(kind="mixed", group=4, sliding_window=7),
    dict(kind="prefill", group=2, sliding_window=11, page_size=4),
    dict(kind="mixed", group=2, soft_cap=5.0),
    dict(kind="mixed", group=4, dtype=jnp.bfloat16, head_dim=128),
    dict(kind="decode", group=8, dtype=jnp.bfloat16),
    dict(kind="mixed", group=4, kv_dtype=jnp.int8),
    dict(kind="mixed", group=4, kv_dtype=jnp.int8, dtype=jnp.bfloat16),
    dict(kind="decode", group=4, kv_dtype=jnp.float8_e4m3fn, dtype=jnp.bfloat16),
    # 160-token contexts: the GPU kernel's plan has 128-token blocks and its bf16 decode
    # items walk them in 64-token halves (gpu.TUNED).
    dict(kind="mixed", group=4, max_pages=20),
    dict(kind="decode", group=4, max_pages=20, dtype=jnp.bfloat16, head_dim=128),
    dict(kind="mixed", group=4, pages_per_block=1, queries_per_block=3),
    dict(kind="mixed", group=1, page_size=4, pages_per_block=3, queries_per_block=2,
         sliding_window=6),
    # Speculative trees (tests/ragged_lengths.draw_trees): masks of up to 32 nodes.
    dict(kind="prefill", group=4, tree=True, max_pages=8),
    dict(kind="mixed", group=2, tree=True, pages_per_block=1, queries_per_block=3),
    dict(kind="mixed", group=4, tree=True, dtype=jnp.bfloat16, head_dim=128,
         kv_dtype=jnp.int8, max_pages=8),
    # Images whose tokens see each other (Gemma 3; tests/ragged_lengths.draw_images),
    # split across items by small query blocks, and under a sliding window.
    dict(kind="prefill", group=4, images=True, max_pages=8),
    dict(kind="mixed", group=2, images=True, page_size=4, pages_per_block=1,
         queries_per_block=3),
    dict(kind="mixed", group=4, images=True, sliding_window=7, dtype=jnp.bfloat16),
    # DeepSeek-V3's latent attention: one 576-wide head that is both K and V, 16 query
    # heads on it (a quarter of a chip's under tensor parallelism 32), 8 queries a block.
    dict(kind="mixed", group=16, head_dim=576, num_kv_heads=1, latent=True,
         dtype=jnp.bfloat16, queries_per_block=8),
    dict(kind="decode", group=16, head_dim=576, num_kv_heads=1, latent=True,
         kv_dtype=jnp.int8, queries_per_block=8),
    # gpt-oss: attention sinks, with its 128-token sliding window's kind of layer too.
    dict(kind="mixed", group=4, sinks=True),
    dict(kind="mixed", group=2, sinks=True, sliding_window=7, dtype=jnp.bfloat16,
         queries_per_block=3),
    dict(kind="decode", group=4, sinks=True, kv_dtype=jnp.int8),
]


def case_id(case):
    return "-".join(f"{k}={getattr(v, '__name__', v)}" for k, v in case.items())


@functools.cache
def case_inputs(index: int) -> tuple[dict, int, dict]:
    """(batch, real tokens, options) of CASES[index], drawn from its own seed."""
    case = dict(CASES[index])
    options = {k: case.pop(k) for k in ("sliding_window", "soft_cap", "pages_per_block",
                                        "queries_per_block") if k in case}
    kind, tree, images = case.pop("kind"), case.pop("tree", False), case.pop("images", False)
    with_sinks = case.pop("sinks", False)
    rng = np.random.default_rng([index, 17])
    batch, real = ragged_batch(rng, kind, **case)
    if with_sinks:
        options["sinks"] = random_sinks(rng, batch)
    if tree:
        options.update(trees(rng, batch))
    if images:
        options.update(image_ends(rng, batch))
    return batch, real, options


def random_sinks(rng, batch: dict) -> jax.Array:
    """A logit per query head, about as large as the scores (gpt-oss's are)."""
    return jnp.asarray(rng.normal(1.0, 1.5, batch["q"].shape[1]), jnp.float32)


def attend(batch: dict, impl: str, **options) -> np.ndarray:
    """The attention of `batch` in one jitted call (eager, each op would compile on its
    own: seconds a case); array options are traced, the others static."""
    arrays = {k: v for k, v in options.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in options.items() if k not in arrays}
    run = jax.jit(functools.partial(ragged_paged_attention, sm_scale=batch["q"].shape[-1] ** -0.5,
                                    impl=impl, **static))
    return np.asarray(run(**batch, **arrays), np.float32)


@functools.cache
def reference_output(index: int) -> np.ndarray:
    batch, _, options = case_inputs(index)
    return attend(batch, "reference", **options)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_kernel_matches_reference(impl, index):
    if impl == "tpu" and CASES[index].get("images"):
        pytest.skip("the TPU kernel leaves a step with images to the reference (a lax.cond)")
    if impl == "gpu" and CASES[index].get("latent"):
        pytest.skip("the GPU kernel's tiles take power-of-two head dims: latent attention "
                    "runs the reference there (parallel.paged_attention)")
    batch, real, options = case_inputs(index)
    dtype = CASES[index].get("dtype", jnp.float32)
    interpret = kernel_interpret(impl)
    tile = options.get("pages_per_block", 0) * CASES[index].get("page_size", 8)
    if not interpret and tile and (tile < 16 or tile & (tile - 1)):
        pytest.skip(f"compiled, the GPU kernel's key tiles are powers of two >= 16, not {tile}")
    want = reference_output(index)
    got = attend(batch, impl, interpret=interpret, **options)
    assert np.abs(want[:real]).max() > 0.1  # a real signal, not zeros
    np.testing.assert_allclose(got[:real], want[:real], atol=TOL[dtype], rtol=TOL[dtype])
    assert np.all(got[real:] == 0)  # padding tokens


def test_shared_kv_is_k_read_as_v():
    """v_pages None (latent attention) is V = K, K's scales for both: the reference on the
    latent cases equals it with K passed again as V."""
    for index in (i for i, c in enumerate(CASES) if c.get("latent")):
        batch, real, options = case_inputs(index)
        again = {**batch, "v_pages": batch["k_pages"]}
        if batch.get("k_scales") is not None:
            again["v_scales"] = batch["k_scales"]
        np.testing.assert_array_equal(attend(again, "reference", **options)[:real],
                                      reference_output(index)[:real])
    with pytest.raises(ValueError, match="pass no v_scales"):
        ragged_paged_attention(**{**batch, "v_scales": batch["k_scales"]}, sm_scale=1.0)


def image_ends(rng, batch) -> dict:
    """image_end for a batch of ragged_batch's (padding tokens: none), at least one image
    in it."""
    n = int(batch["num_seqs"])
    cu, kv_lens = np.asarray(batch["cu_q_lens"]), np.asarray(batch["kv_lens"])
    ends = draw_images(rng, kv_lens[:n].tolist(), np.diff(cu)[:n].tolist())
    assert max(ends) >= 0
    ends += [-1] * (batch["q"].shape[0] - len(ends))
    return dict(image_end=jnp.asarray(ends, jnp.int32))


def trees(rng, batch) -> dict:
    """tree_start and tree_mask for a batch of ragged_batch's (padding: no tree)."""
    n = int(batch["num_seqs"])
    cu, kv_lens = np.asarray(batch["cu_q_lens"]), np.asarray(batch["kv_lens"])
    starts, masks, parents = draw_trees(rng, kv_lens[:n].tolist(), np.diff(cu)[:n].tolist())
    assert sum(len(p) > 2 for p in parents) >= 1
    pad_seqs, pad_tokens = len(kv_lens) - n, batch["q"].shape[0] - len(masks)
    return dict(tree_start=jnp.asarray(starts + [0] * pad_seqs, jnp.int32),
                tree_mask=jnp.asarray(masks + [0] * pad_tokens, jnp.int32))


def test_kernel_under_jit_with_padded_page_table_entries():
    """Page-table entries past a sequence's pages may hold anything in range: stale pages
    must be masked, never read into the result."""
    rng = np.random.default_rng(5)
    batch, real = ragged_batch(rng, "mixed", group=2)
    table = np.asarray(batch["page_indices"]).copy()
    num_pages = batch["k_pages"].shape[1]
    page_size = batch["k_pages"].shape[2]
    kv_lens = np.asarray(batch["kv_lens"])
    for s in range(len(kv_lens)):
        used = -(-int(kv_lens[s]) // page_size)
        table[s, used:] = rng.integers(0, num_pages, table.shape[1] - used)
    batch["page_indices"] = jnp.asarray(table)
    f = jax.jit(lambda b: ragged_paged_attention(**b, sm_scale=0.125, impl="tpu", interpret=True))
    want = ragged_paged_attention(**batch, sm_scale=0.125, impl="reference")
    np.testing.assert_allclose(np.asarray(f(batch))[:real], np.asarray(want)[:real],
                               atol=1e-5, rtol=1e-5)


# --- the GPU kernel's split-KV (flash-decoding) path --------------------------------------

# Long contexts (up to 16 pages of 8 tokens) in key tiles of 2 pages, so an item walks up to
# 8 blocks and a split covers several or none of them.
SPLIT_CASES = [
    dict(num_kv_splits=1),  # the same long walk in one program: the baseline
    dict(num_kv_splits=2),
    dict(num_kv_splits=4, group=1),
    dict(num_kv_splits=4, sliding_window=13),  # the window spans <= 2 blocks: 2+ splits empty
    dict(num_kv_splits=2, sliding_window=40, soft_cap=5.0),
    dict(num_kv_splits=2, kv_dtype=jnp.int8),
    dict(num_kv_splits=4, kv_dtype=jnp.int8, dtype=jnp.bfloat16, sliding_window=20),
    dict(num_kv_splits=3, kind="mixed", max_pages=8),  # prefill chunks split too
    dict(num_kv_splits=4, sinks=True),  # the sink joins the first split only
]


@pytest.mark.parametrize("index", range(len(SPLIT_CASES)),
                         ids=[case_id(c) for c in SPLIT_CASES])
def test_gpu_split_kv_matches_reference(index):
    case = dict(SPLIT_CASES[index])
    options = {k: case.pop(k) for k in ("sliding_window", "soft_cap") if k in case}
    kind = case.pop("kind", "decode")
    with_sinks = case.pop("sinks", False)
    case.setdefault("max_pages", 16)
    case.setdefault("group", 4)
    rng = np.random.default_rng([index, 29])
    batch, real = ragged_batch(rng, kind, page_size=8, **{
        k: case[k] for k in ("group", "max_pages", "dtype", "kv_dtype") if k in case})
    if kind == "decode":  # one single-token context (every split but one empty), one full
        kv_lens = np.asarray(batch["kv_lens"]).copy()
        kv_lens[:2] = 1, case["max_pages"] * 8
        batch["kv_lens"] = jnp.asarray(kv_lens)
    if with_sinks:
        options["sinks"] = random_sinks(rng, batch)
    dtype = case.get("dtype", jnp.float32)
    want = attend(batch, "reference", pages_per_block=2, **options)
    got = attend(batch, "gpu", interpret=kernel_interpret("gpu"), pages_per_block=2,
                 num_kv_splits=case["num_kv_splits"], **options)
    assert np.abs(want[:real]).max() > 0.1
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:real], want[:real], atol=TOL[dtype], rtol=TOL[dtype])
    assert np.all(got[real:] == 0)


def test_gpu_split_kv_under_jit_with_padded_page_table_entries():
    """Stale page-table entries past a sequence's pages are masked in every split."""
    rng = np.random.default_rng(6)
    batch, real = ragged_batch(rng, "decode", group=2, max_pages=12)
    table = np.asarray(batch["page_indices"]).copy()
    num_pages, page_size = batch["k_pages"].shape[1:3]
    for s, kv_len in enumerate(np.asarray(batch["kv_lens"])):
        used = -(-int(kv_len) // page_size)
        table[s, used:] = rng.integers(0, num_pages, table.shape[1] - used)
    batch["page_indices"] = jnp.asarray(table)
    f = jax.jit(lambda b: ragged_paged_attention(**b, sm_scale=0.125, impl="gpu",
                                                 interpret=kernel_interpret("gpu"),
                                                 pages_per_block=2, num_kv_splits=3))
    want = ragged_paged_attention(**batch, sm_scale=0.125, impl="reference")
    np.testing.assert_allclose(np.asarray(f(batch))[:real], np.asarray(want)[:real],
                               atol=1e-5, rtol=1e-5)


def test_gpu_block_and_split_rules():
    from pallas_kernels.ragged_paged_attention import gpu

    assert gpu.default_gpu_queries_per_block(8, 4) == 8  # never more than the batch has
    assert gpu.default_gpu_queries_per_block(2048, 4) == 32  # the reference's cap
    assert gpu.default_gpu_queries_per_block(2048, 8) == 16  # at most 128 query rows
    assert gpu.default_pages_per_block(16, 128) == 8  # 128-token key tiles
    assert gpu.default_pages_per_block(8, 5) == 8  # 5 pages round up to a 64-token tile
    assert gpu.default_pages_per_block(4, 2) == 4  # never below Triton's 16
    assert gpu.default_pages_per_block(256, 4) == 1
    assert gpu.default_num_kv_splits(8 * 4, 64) == 5  # 4 decodes x 8 KV heads fill 132 SMs
    assert gpu.default_num_kv_splits(8 * 64, 64) == 1  # a full batch is not split
    assert gpu.default_num_kv_splits(2, 3) == 3  # never more splits than blocks
    batch, _ = ragged_batch(np.random.default_rng(0), "decode", page_size=4)
    with pytest.raises(ValueError, match="power of two"):
        ragged_paged_attention(**batch, sm_scale=0.125, impl="gpu", pages_per_block=3)


# --- the GPU kernel lowers to Triton (no GPU needed) --------------------------------------

# Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128, pages of 16 tokens.
LLAMA3_8B_BATCHES = {  # (tokens, sequence slots, pages per sequence, KV dtype)
    "decode": (64, 64, 128, jnp.bfloat16),
    "decode-long-split": (4, 4, 512, jnp.bfloat16),
    "prefill": (2048, 8, 256, jnp.bfloat16),
    "decode-fp8": (4, 4, 512, jnp.float8_e4m3fn),
}


@pytest.mark.parametrize("name", LLAMA3_8B_BATCHES)
def test_gpu_kernel_lowers_for_cuda(name):
    """Pallas's Triton lowering (jaxpr -> Triton IR, as for compute capability 9.0 when no
    GPU is present) accepts the kernel at Llama-3-8B shapes: one call over the decode items
    (one per sequence slot) and one over the prefill items, each split over the KV blocks
    when its programs alone cannot fill the GPU. This checks the power-of-two tile shapes,
    not Triton's own compile (that needs a GPU)."""
    from pallas_kernels.ragged_paged_attention import gpu
    from pallas_kernels.ragged_paged_attention.work_items import num_prefill_items

    num_tokens, max_seqs, pages_per_seq, kv_dtype = LLAMA3_8B_BATCHES[name]
    num_pages = 4096
    sds = jax.ShapeDtypeStruct
    args = [sds((num_tokens, 32, 128), jnp.bfloat16),
            sds((8, num_pages, 16, 128), kv_dtype), sds((8, num_pages, 16, 128), kv_dtype),
            sds((max_seqs,), jnp.int32), sds((max_seqs, pages_per_seq), jnp.int32),
            sds((max_seqs + 1,), jnp.int32), sds((), jnp.int32)]
    quantized = kv_dtype != jnp.bfloat16
    if quantized:
        args += [sds((8, num_pages, 16), jnp.float32)] * 2

    def attention(*a):
        scales = dict(k_scales=a[7], v_scales=a[8]) if quantized else {}
        return ragged_paged_attention(*a[:7], sm_scale=128 ** -0.5, impl="gpu", **scales)

    exported = jax.export.export(
        jax.jit(attention), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 2
    grids = [tuple(int(n) for n in g) for g in re.findall(
        r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32", text)]
    prefill = num_prefill_items(num_tokens, max_seqs, gpu.default_gpu_queries_per_block(
        num_tokens, 4))
    splits = lambda items: min(-(-132 // (8 * items)), pages_per_seq // 8)  # noqa: E731
    assert sorted(grids) == sorted([(8, max_seqs, splits(max_seqs)), (8, prefill, splits(prefill))])


# ---------------------------------------------------------------- TPU, ahead of time

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
SHAPES = {"decode": (64, 64), "prefill": (512, 1), "mixed": (256, 64)}  # (T, S)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("phase", list(SHAPES))
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.int8])
def test_tpu_kernel_compiles_for_real_tpus(topology, phase, kv_dtype):
    """Mosaic lowers and compiles the kernel for Llama-3-8B's per-layer shapes (2k context
    per sequence), on one chip of each generation; nothing spills to HBM temporaries
    beyond each kind's gathered queries and outputs and the (int8) per-sequence scale rows:
    no page is ever copied."""
    pytest.importorskip("libtpu", reason="libtpu is not installed: pip install 'jax[tpu]'")
    from sharding.planner import tpu_devices

    chip = tpu_devices(topology)[0]
    sharding = jax.sharding.SingleDeviceSharding(chip)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    t, s = SHAPES[phase]
    page_size = 16 if kv_dtype == jnp.bfloat16 else 32
    pages, per_seq = 4096, 2048 // page_size
    hkv, d = LLAMA3_8B["num_kv_heads"], LLAMA3_8B["head_dim"]
    args = [spec((t, LLAMA3_8B["num_q_heads"], d), jnp.bfloat16),
            spec((hkv, pages, page_size, d), kv_dtype), spec((hkv, pages, page_size, d), kv_dtype),
            spec((s,), jnp.int32), spec((s, per_seq), jnp.int32), spec((s + 1,), jnp.int32),
            spec((), jnp.int32)]
    if kv_dtype != jnp.bfloat16:
        args += [spec((hkv, pages, page_size), jnp.float32)] * 2

    def attend(q, k, v, kv_lens, table, cu, n, *scales):
        kw = dict(k_scales=scales[0], v_scales=scales[1]) if scales else {}
        return ragged_paged_attention(q, k, v, kv_lens, table, cu, n, sm_scale=d**-0.5,
                                      impl="tpu", **kw)

    with jax.default_device(chip):
        compiled = jax.jit(attend).lower(*args).compile()
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()
    from pallas_kernels.ragged_paged_attention.work_items import num_prefill_items

    group = LLAMA3_8B["num_q_heads"] // hkv
    query_tiles = hkv * (s * 16 + num_prefill_items(t, s, min(32, t)) * 32 * group) * d * 2
    scale_rows = 0 if kv_dtype == jnp.bfloat16 else 2 * hkv * s * per_seq * page_size * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 2 * query_tiles + scale_rows + t * LLAMA3_8B["num_q_heads"] * d * 2
    assert temp < hkv * pages * page_size * d * jnp.dtype(kv_dtype).itemsize / 4


def tree_args(spec, t: int, s: int, kv_dtype, page_size: int = 16, pages: int = 4096,
              per_seq: int = 128) -> list:
    """Llama-3-8B attention operands of `spec(shape, dtype)`, with a tree start per
    sequence and a tree mask per token."""
    return [spec((t, 32, 128), jnp.bfloat16), spec((8, pages, page_size, 128), kv_dtype),
            spec((8, pages, page_size, 128), kv_dtype), spec((s,), jnp.int32),
            spec((s, per_seq), jnp.int32), spec((s + 1,), jnp.int32), spec((), jnp.int32),
            spec((s,), jnp.int32), spec((t,), jnp.int32)]


def test_gpu_kernel_with_trees_lowers_for_cuda():
    """Speculative trees (64 sequences of 4 tree tokens at Llama-3-8B shapes): the tree
    masks lower to Triton with the rest."""
    sds = jax.ShapeDtypeStruct

    def attention(*a):
        return ragged_paged_attention(*a[:7], sm_scale=128 ** -0.5, impl="gpu",
                                      tree_start=a[7], tree_mask=a[8])

    exported = jax.export.export(
        jax.jit(attention), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*tree_args(sds, 256, 64, jnp.bfloat16))
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 2


def test_gpu_kernel_with_images_lowers_for_cuda():
    """Images (a 512-token prefill step at Llama-3-8B shapes, an image end per token):
    they lower to Triton with the rest, no lax.cond left in the program."""
    sds = jax.ShapeDtypeStruct
    args = tree_args(sds, 512, 8, jnp.bfloat16)[:7] + [sds((512,), jnp.int32)]

    def attention(*a):
        return ragged_paged_attention(*a[:7], sm_scale=128 ** -0.5, impl="gpu",
                                      image_end=a[7])

    exported = jax.export.export(
        jax.jit(attention), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 2 and "stablehlo.case" not in text


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.int8])
def test_tpu_kernel_with_trees_compiles_for_real_tpus(kv_dtype):
    """Mosaic lowers and compiles the kernel with tree masks (the item's tree start in
    SMEM, a [rows, 1] block of row masks) for a v5e chip, at Llama-3-8B shapes."""
    pytest.importorskip("libtpu", reason="libtpu is not installed: pip install 'jax[tpu]'")
    from sharding.planner import tpu_devices

    chip = tpu_devices("v5e:2x2")[0]
    sharding = jax.sharding.SingleDeviceSharding(chip)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    page_size = 16 if kv_dtype == jnp.bfloat16 else 32
    args = tree_args(spec, 256, 64, kv_dtype, page_size, per_seq=2048 // page_size)
    if kv_dtype != jnp.bfloat16:
        args += [spec((8, 4096, page_size), jnp.float32)] * 2

    def attend(*a):
        kw = dict(k_scales=a[9], v_scales=a[10]) if len(a) > 9 else {}
        return ragged_paged_attention(*a[:7], sm_scale=128 ** -0.5, impl="tpu",
                                      tree_start=a[7], tree_mask=a[8], **kw)

    with jax.default_device(chip):
        compiled = jax.jit(attend).lower(*args).compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2


def gpt_oss_args(spec, t: int = 256, s: int = 64) -> list:
    """gpt-oss-120b's attention operands (64 query heads on 8 KV heads of 64, bf16 pages
    of 16 tokens, 2k context a sequence) and its sinks, of `spec(shape, dtype)`."""
    return [spec((t, 64, 64), jnp.bfloat16), spec((8, 4096, 16, 64), jnp.bfloat16),
            spec((8, 4096, 16, 64), jnp.bfloat16), spec((s,), jnp.int32),
            spec((s, 128), jnp.int32), spec((s + 1,), jnp.int32), spec((), jnp.int32),
            spec((64,), jnp.float32)]


@pytest.mark.parametrize("window", [None, 128])
def test_kernels_with_sinks_compile_for_tpu_and_lower_for_cuda(window):
    """Attention sinks at gpt-oss-120b's shapes, on its full and its sliding layers: Mosaic
    compiles the TPU kernel for a v6e chip ([rows, 1] sink blocks), and the GPU kernel
    lowers to Triton."""
    def attention(impl):
        return lambda *a: ragged_paged_attention(*a[:7], sm_scale=0.125, impl=impl,
                                                 sliding_window=window, sinks=a[7])

    exported = jax.export.export(
        jax.jit(attention("gpu")), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*gpt_oss_args(jax.ShapeDtypeStruct))
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 2
    pytest.importorskip("libtpu", reason="libtpu is not installed: pip install 'jax[tpu]'")
    from sharding.planner import tpu_devices

    chip = tpu_devices("v6e:2x2")[0]
    sharding = jax.sharding.SingleDeviceSharding(chip)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    with jax.default_device(chip):
        compiled = jax.jit(attention("tpu")).lower(*gpt_oss_args(spec)).compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2
