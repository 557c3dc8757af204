"""The native CPU kernels (pallas_kernels/cpu) against their references and exact float64
results, on random inputs, for every instruction-set path the machine can run.

Tolerances come from the arithmetic, checked against the exact product (float64 of the
stored values) so that the bound says what the kernel may do, not what one other
implementation happens to do:

- matmul, float32 accumulation of K products in any order: |error| <= g_K * sum_k |x w|
  with g_K = K u / (1 - K u), u = 2^-24 (Higham's bound for summation in any order; each
  product of two f32 values rounds once more, of two bf16 values not at all), then the
  result's rounding to the output dtype: u |y| for float32, 2^-8 |y| for bfloat16 (8
  significant bits, round to nearest even).
- attention, per query and output element: each score's dot product carries the g_(D+2)
  bound above (D products, the sm_scale and 8-bit scale products); softmax weights move
  by a relative factor of at most exp(2 e_s) ~ 1 + 2 e_s when every score moves by e_s,
  plus a few ulps for exp (and tanh times soft_cap with a soft cap); then P.V sums L
  terms (g_L), so |error| <= (2 e_s + exp/tanh ulps + g_L) * sum_j p_j |v_j| + u |o|, and
  the bf16 output rounding 2^-8 |o| on top when q is bfloat16. The reference must meet the
  same bound (a check of the oracle and of the bound), and kernel and reference differ by
  at most twice it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cpu as native
from pallas_kernels.lora import cpu as lora_cpu
from pallas_kernels.matmul import matmul
from pallas_kernels.ragged_paged_attention import quantize_kv, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.kv_cache import as_bits, as_values
from ragged_lengths import draw_lengths
from test_attention_kernels import CASES as KERNEL_CASES
from test_attention_kernels import TOL as KERNEL_TOL
from test_attention_kernels import case_id as kernel_case_id
from test_attention_kernels import ragged_batch as kernel_batch
from test_attention_kernels import random_sinks
from test_attention_kernels import trees as kernel_trees

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native CPU kernels unavailable: "
                                       f"{native.unavailable_reason()}")

U32 = 2.0**-24
U_OUT = {jnp.float32: 2.0**-24, jnp.bfloat16: 2.0**-8}


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def machine_isas() -> list[str]:
    """The instruction-set paths this machine can run, best first."""
    if not native.available():
        return []
    best = native.isa()
    order = list(native.ISA_LEVELS)
    return order[: order.index(best) + 1][::-1]


@pytest.fixture(params=machine_isas() or ["none"])
def isa(request):
    """Run the test at one instruction-set level, then restore the best."""
    best = machine_isas()[0]
    assert native.set_max_isa(request.param) == request.param
    yield request.param
    native.set_max_isa(best)


# ------------------------------------------------------------------------------- matmul

def exact_matmul(x, w, transpose_w):
    xe, we = np.asarray(x, np.float64), np.asarray(w, np.float64)
    we = we.T if transpose_w else we
    return xe @ we, np.abs(xe) @ np.abs(we)


def matmul_bound(exact, magnitude, k, dtype):
    acc = gamma(k) * magnitude
    return acc + U_OUT[dtype] * (np.abs(exact) + acc)


def assert_within_bound(x, w, y, real, transpose_w, dtype):
    """y = x @ w (w.T with transpose_w) within the bound of its exact product on the
    first `real` rows (a signal far above it); the rows past them are not read."""
    exact, magnitude = exact_matmul(x, w, transpose_w)
    bound = matmul_bound(exact, magnitude, x.shape[1], dtype)[:real]
    got = np.asarray(y, np.float64)
    assert np.abs(exact[:real]).max() > 100 * bound.max()
    assert np.all(np.abs(got[:real] - exact[:real]) <= bound)


def random_operands(rng, m, k, n, dtype, transpose_w):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)), dtype)
    return x, w


def check_matmul(m, k, n, dtype, transpose_w, num_rows, seed):
    rng = np.random.default_rng(seed)
    x, w = random_operands(rng, m, k, n, dtype, transpose_w)
    f = jax.jit(lambda x, w, r, impl: matmul(x, w, r, transpose_w=transpose_w, impl=impl),
                static_argnums=3)
    got = np.asarray(f(x, w, jnp.int32(num_rows), "cpu"), np.float64)
    ref = np.asarray(f(x, w, jnp.int32(num_rows), "reference"), np.float64)
    assert got.shape == (m, n) and got.dtype == ref.dtype
    exact, magnitude = exact_matmul(x, w, transpose_w)
    real = min(num_rows, m)
    bound = matmul_bound(exact, magnitude, k, dtype)[:real]
    assert np.abs(exact[:real]).max() > 100 * bound.max()  # a signal far above the bound
    assert np.all(np.abs(ref[:real] - exact[:real]) <= bound)  # the oracle and the bound
    err = np.abs(got[:real] - exact[:real])
    assert np.all(err <= bound), f"max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"
    assert np.all(np.abs(got[:real] - ref[:real]) <= 2 * bound)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("transpose_w", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("m", [1, 3, 7, 8, 9, 26, 27, 34, 35, 64, 200])
def test_matmul_matches_reference(m, transpose_w, dtype):
    # K odd and N past a multiple of the vector widths (16 f32 / 32 bf16 / 64-column tiles);
    # num_rows < M (the rows past it are left unwritten). NK: 24 real rows are the
    # most bf16's few-row tiles take (32 for f32), 25 (33) go to the panels.
    k, n = (301, 197) if m <= 35 else (77, 133)
    num_rows = m if m == 1 else m - 2
    check_matmul(m, k, n, dtype, transpose_w, num_rows, seed=[m, k, n, transpose_w])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("transpose_w", [False, True], ids=["KN", "NK"])
def test_matmul_strips_left_over_split_by_rows(transpose_w, dtype):
    # 9 panel strips of 64 columns (the last partial) and 38 real rows (past the few-row
    # tiles in both dtypes): on an odd number of strips per thread count the strips left
    # over are computed in blocks of rows.
    check_matmul(40, 77, 557, dtype, transpose_w, 38, seed=[32, 77, 557])


@pytest.mark.parametrize("case", [(1, 1, 1), (5, 2, 3), (7, 64, 64), (9, 576, 40),
                                  (13, 33, 1), (98, 520, 40)], ids=str)
def test_matmul_small_and_aligned_shapes(case, isa):
    """Every path of every instruction-set level: tiny, vector-aligned, one-column, and
    packed panels with K past one slice (256) over three blocks of rows (48)."""
    m, k, n = case
    for dtype in (jnp.float32, jnp.bfloat16):
        for transpose_w in (False, True):
            check_matmul(m, k, n, dtype, transpose_w, max(1, m - 1), seed=[m, k, n, 7])


@pytest.mark.parametrize("m", [2, 3, 64])  # 1, 2 and 63 real rows
def test_matmul_every_isa(m, isa):
    for dtype in (jnp.float32, jnp.bfloat16):
        for transpose_w in (False, True):
            check_matmul(m, 129, 70, dtype, transpose_w, m - 1, seed=[m, 3])


@pytest.mark.parametrize("transpose_w", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("m", [1, 3, 4, 6, 7, 26, 64])
def test_weights_sharing_x_in_one_call(m, transpose_w, isa):
    """`matmuls` (q/k/v, gate/up in one call: few rows stream the weights together, [N, K]
    ones in one parallel loop over blocks of all of them; more rows pack the panels of all
    of them in one parallel loop, 9 strips here, the last split by rows): every result
    within the bound of its own exact product."""
    from pallas_kernels.matmul import matmuls

    rng = np.random.default_rng([m, 11])
    k, ns = 96, (70, 16, 33, 300)  # 300 rows of [N, K]: more than one block of that weight
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        ws = [jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)), dtype)
              for n in ns]
        real = max(1, m - 1)
        ys = jax.jit(lambda x, ws, r: matmuls(x, ws, r, transpose_w=transpose_w, impl="cpu")
                     )(x, ws, jnp.int32(real))
        assert [y.shape for y in ys] == [(m, n) for n in ns]
        for w, y in zip(ws, ys):
            assert_within_bound(x, w, y, real, transpose_w, dtype)


@pytest.mark.parametrize("m", [1, 2, 5, 7, 13, 33, 40, 100])
def test_packed_weights_match_reference(m, isa):
    """Weights packed at load (pallas_kernels/matmul/packed.py) sharing x, 1 + 3 + 5
    strips of 64 columns: the strips left over after an even share per thread are split by
    K (up to 32 rows) or by rows; runs of whole strips for few rows; below AVX-512, the
    generic loops. Every result within the bound of its own exact product."""
    from pallas_kernels.matmul import matmuls, packed

    rng = np.random.default_rng([m, 17])
    ns = (64, 192, 320)
    for dtype, k in ((jnp.float32, 97), (jnp.bfloat16, 98)):  # bf16 packs pairs of K
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        ws = [jnp.asarray(rng.standard_normal((n, k)), dtype) for n in ns]
        packs = [packed.pack(w) for w in ws]
        assert all(np.array_equal(packed.unpack(p), w) for p, w in zip(packs, ws))
        assert not np.array_equal(packs[0], ws[0])  # a real reordering
        real = max(1, m - 1)
        call = jax.jit(lambda x, ws, r: matmuls(x, ws, r, packed_w=True, impl="cpu"))
        ys = call(x, packs, jnp.int32(real)) + [  # and one weight alone
            jax.jit(lambda x, w, r: matmul(x, w, r, packed_w=True, impl="cpu"))(
                x, packs[2], jnp.int32(real))]
        for w, y in zip(ws + ws[2:], ys):
            assert_within_bound(x, w, y, real, True, dtype)
        ref = matmuls(x, packs, real, packed_w=True, impl="reference")  # unpacks
        for r, y in zip(ref, ys):
            np.testing.assert_allclose(np.asarray(r, np.float64)[:real],
                                       np.asarray(y, np.float64)[:real],
                                       rtol=0.02 if dtype == jnp.bfloat16 else 1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_packed_rows_lookup(dtype):
    """A packed tied embedding's lookups (`take_rows`) are the unpacked table's rows."""
    from pallas_kernels.matmul import packed

    w = jnp.asarray(np.random.default_rng(5).standard_normal((192, 10)), dtype)
    ids = jnp.asarray([[0, 63, 64], [191, 5, 64]], jnp.int32)
    np.testing.assert_array_equal(packed.take_rows(packed.pack(w), ids), w[ids])


def test_packed_weights_rejects_unpackable_shapes():
    from pallas_kernels.matmul import packed

    assert packed.packable(128, 98, jnp.bfloat16) and packed.packable(64, 97, jnp.float32)
    assert not packed.packable(96, 98, jnp.float32)  # N not a multiple of 64
    assert not packed.packable(64, 97, jnp.bfloat16)  # odd K in bf16
    with pytest.raises(ValueError, match="multiple of 64"):
        packed.pack(jnp.zeros((96, 8), jnp.float32))
    x, w = jnp.ones((2, 8), jnp.float32), jnp.ones((96, 8), jnp.float32)
    with pytest.raises(Exception, match="packed w"):  # the kernel checks too
        jax.block_until_ready(matmul(x, w, 2, packed_w=True, impl="cpu"))


def test_matmul_num_rows_edges():
    rng = np.random.default_rng(0)
    x, w = random_operands(rng, 6, 40, 24, jnp.bfloat16, False)
    f = jax.jit(lambda x, w, r: matmul(x, w, r, impl="cpu"))
    assert f(x, w, jnp.int32(0)).shape == (6, 24)  # no rows to compute
    full = np.asarray(matmul(x, w, impl="reference"), np.float32)
    many = np.asarray(f(x, w, jnp.int32(99)), np.float32)  # clamped to M
    np.testing.assert_allclose(many, full, rtol=2**-7, atol=1e-6)
    none = np.asarray(jax.jit(lambda x, w: matmul(x, w, impl="cpu"))(x, w), np.float32)
    np.testing.assert_array_equal(none, many)


def test_matmul_dispatch():
    x = jnp.ones((2, 8), jnp.float32)
    assert matmul.__module__ == "pallas_kernels.matmul"
    from pallas_kernels.matmul import cpu, default_impl
    assert default_impl("cpu") == "cpu" and default_impl("tpu") == "reference"
    # impl=None falls back to the reference for operands the kernel does not take ...
    y = matmul(x.astype(jnp.float16), jnp.ones((8, 3), jnp.float16))
    assert y.dtype == jnp.float16 and np.all(np.asarray(y) == 8)
    assert not cpu.supports(x, jnp.ones((8, 3), jnp.bfloat16))
    # ... and an explicit impl="cpu" says why it cannot run them.
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        matmul(x, jnp.ones((8, 3), jnp.bfloat16), impl="cpu")


def test_matmul_dispatch_follows_the_cpu(isa):
    """impl=None takes the kernel where it beats XLA's dot on this CPU: with its AVX-512
    paths (AVX512_BF16 for bf16) always; with its AVX2 paths ([N, K] weights) always;
    with its generic loops only for bf16 with 1 or 2 rows (XLA's bf16 matrix-vector
    product is ~12x slower there), XLA's dot otherwise."""
    def native_call(rows: int, dtype, transpose_w=True) -> bool:
        x, w = jnp.ones((rows, 64), dtype), jnp.ones((32, 64) if transpose_w else (64, 32), dtype)
        hlo = jax.jit(lambda x, w: matmul(x, w, transpose_w=transpose_w)).lower(x, w).as_text()
        return "jaxserve_matmul" in hlo

    tuned = {"float32": isa in ("avx512", "avx512_bf16"), "bfloat16": isa == "avx512_bf16"}
    avx2 = isa != "scalar"
    for rows in (1, 2, 3, 64):
        assert native_call(rows, jnp.float32) == (tuned["float32"] or avx2)
        assert native_call(rows, jnp.bfloat16) == (tuned["bfloat16"] or avx2 or rows <= 2)
        # [K, N] weights have no AVX2 path: its generic loops keep only 1-2 bf16 rows.
        assert native_call(rows, jnp.float32, False) == tuned["float32"]
        assert native_call(rows, jnp.bfloat16, False) == (tuned["bfloat16"] or rows <= 2)


# ---------------------------------------------------------------------------- attention

def ragged_batch(rng, *, kind="mixed", num_seqs=5, page_size=8, num_kv_heads=2, group=4,
                 head_dim=64, max_pages=6, dtype=jnp.float32, kv_dtype=None, bits=False):
    """A random ragged batch: decodes (1 new token), whole prompts and chunks continuing an
    earlier context; shuffled pages over a pool with spare pages; page-table entries past
    each sequence's pages set to garbage (negative, past the pool, stale pages); padding
    sequence slots and padding tokens; `bits`: a bf16 pool as its uint16 bits, as the engine
    keeps it on CPU (kv_cache.pool_dtype). Returns (kwargs, real tokens, clean page table)."""
    kv_lens, q_lens = draw_lengths(rng, kind, num_seqs, max_pages * page_size)
    max_seqs, pad_tokens = num_seqs + 2, 3
    num_pages = num_seqs * max_pages + 5
    table = np.zeros((max_seqs, max_pages), np.int32)
    table[:num_seqs] = rng.permutation(num_pages)[: num_seqs * max_pages].reshape(
        num_seqs, max_pages)
    garbage = table.copy()
    for s, kv in enumerate(kv_lens):
        used = -(-kv // page_size)
        garbage[s, used:] = rng.choice([-7, num_pages + 3, 2**30, int(table[s, 0])],
                                       max_pages - used)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    t = sum(q_lens) + pad_tokens
    q = rng.standard_normal((t, num_kv_heads * group, head_dim)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(max_seqs - num_seqs, sum(q_lens))])
    batch = dict(q=jnp.asarray(q, dtype),
                 kv_lens=jnp.asarray(np.pad(kv_lens, (0, max_seqs - num_seqs)), jnp.int32),
                 page_indices=jnp.asarray(garbage), cu_q_lens=jnp.asarray(cu, jnp.int32),
                 num_seqs=jnp.int32(num_seqs))
    if kv_dtype is None:
        pages = [jnp.asarray(x, dtype) for x in (k, v)]
        if bits:
            pages = [as_bits(x) for x in pages]
        batch.update(k_pages=pages[0], v_pages=pages[1])
    else:
        (kq, ks), (vq, vs) = quantize_kv(jnp.asarray(k), kv_dtype), quantize_kv(jnp.asarray(v), kv_dtype)
        batch.update(k_pages=kq, v_pages=vq, k_scales=ks, v_scales=vs)
    return batch, sum(q_lens), table


def stored(batch, name):
    """K or V as float64 values: stored value times its scale for an 8-bit cache."""
    pages = np.asarray(as_values(batch[f"{name}_pages"]).astype(jnp.float32), np.float64)
    if f"{name}_scales" in batch:
        pages = pages * np.asarray(batch[f"{name}_scales"], np.float64)[..., None]
    return pages


def exact_attention(batch, table, sm_scale, sliding_window, soft_cap):
    """Dense float64 attention of every real query, and its error bound (module doc)."""
    q = np.asarray(batch["q"].astype(jnp.float32), np.float64)
    k, v = stored(batch, "k"), stored(batch, "v")
    num_kv_heads, _, page_size, head_dim = k.shape
    group = q.shape[1] // num_kv_heads
    cu, kv_lens = np.asarray(batch["cu_q_lens"]), np.asarray(batch["kv_lens"])
    out = np.zeros_like(q)
    bound = np.zeros_like(q)
    e_fn = 8 * U32 * (1 + (soft_cap or 0))  # exp, and tanh scaled by soft_cap
    for s in range(int(batch["num_seqs"])):
        kv_len, q_len = int(kv_lens[s]), int(cu[s + 1] - cu[s])
        pos = np.arange(kv_len)
        pages = table[s, pos // page_size]
        for h in range(q.shape[1]):
            kh, vh = k[h // group, pages, pos % page_size], v[h // group, pages, pos % page_size]
            for i in range(q_len):
                tok, p = cu[s] + i, kv_len - q_len + i
                visible = pos <= p
                if sliding_window:
                    visible &= pos > p - sliding_window
                qs = q[tok, h] * sm_scale
                scores = kh[visible] @ qs
                e_s = gamma(head_dim + 2) * (np.abs(kh[visible]) @ np.abs(qs))
                if soft_cap:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                w = np.exp(scores - scores.max())
                w /= w.sum()
                out[tok, h] = w @ vh[visible]
                spread = w @ np.abs(vh[visible])
                bound[tok, h] = ((2 * e_s.max() + e_fn + gamma(int(visible.sum()) + 1)) * spread
                                 + U32 * np.abs(out[tok, h]))
    return out, bound


ATTENTION_CASES = [
    dict(kind="decode", group=1, head_dim=64),
    dict(kind="decode", group=4, head_dim=128, page_size=16),
    dict(kind="decode", group=8, head_dim=64, dtype=jnp.bfloat16),
    dict(kind="prefill", group=4, head_dim=128),
    dict(kind="mixed", group=8, head_dim=64),
    dict(kind="mixed", group=1, head_dim=128, num_kv_heads=3),
    dict(kind="mixed", group=4, sliding_window=7),
    dict(kind="prefill", group=2, sliding_window=11, page_size=4),
    dict(kind="mixed", group=4, soft_cap=5.0),
    dict(kind="mixed", group=4, dtype=jnp.bfloat16, head_dim=128),
    dict(kind="mixed", group=4, dtype=jnp.bfloat16, sliding_window=9, soft_cap=3.0),
    dict(kind="mixed", group=2, dtype=jnp.bfloat16, bits=True),  # the engine's CPU bf16 pool
    dict(kind="mixed", group=4, kv_dtype=jnp.int8),
    dict(kind="mixed", group=8, kv_dtype=jnp.int8, dtype=jnp.bfloat16, head_dim=128),
    dict(kind="decode", group=4, kv_dtype=jnp.float8_e4m3fn, dtype=jnp.bfloat16),
    dict(kind="mixed", group=4, kv_dtype=jnp.float8_e4m3fn),
    dict(kind="mixed", group=3, head_dim=80, page_size=5),  # 5 vectors of 16 per row
    dict(kind="decode", group=2, head_dim=72, dtype=jnp.bfloat16),  # not a multiple of 16
    dict(kind="decode", group=4, head_dim=80, dtype=jnp.bfloat16),  # bf16 dots of 32 + 32 + 16
    dict(kind="mixed", group=4, queries_per_block=3),
]


def case_id(case):
    return "-".join(f"{k}={getattr(v, '__name__', v)}" for k, v in case.items())


def split_case(index):
    case = dict(ATTENTION_CASES[index])
    options = {k: case.pop(k) for k in ("sliding_window", "soft_cap") if k in case}
    qpb = case.pop("queries_per_block", None)
    return case, options, qpb


def attention_fn(sm_scale, options):
    return jax.jit(lambda b, impl, **kw: ragged_paged_attention(**b, sm_scale=sm_scale, impl=impl,
                                                                **options, **kw),
                   static_argnums=1, static_argnames=("queries_per_block",))


@functools.lru_cache(maxsize=None)
def expected_attention(index):
    """(batch, real tokens, reference output, exact output, bound) of one case, computed
    once for every instruction-set level that runs it."""
    case, options, _ = split_case(index)
    batch, real, table = ragged_batch(np.random.default_rng([index, 41]), **case)
    sm_scale = batch["q"].shape[-1] ** -0.5
    clean = dict(batch, page_indices=jnp.asarray(table))  # the reference needs real pages
    ref = np.asarray(attention_fn(sm_scale, options)(clean, "reference"), np.float64)
    want, bound = exact_attention(batch, table, sm_scale, options.get("sliding_window"),
                                  options.get("soft_cap"))
    if case.get("dtype", jnp.float32) == jnp.bfloat16:
        bound = bound + U_OUT[jnp.bfloat16] * (np.abs(want) + bound)
    assert np.abs(want[:real]).max() > 100 * bound[:real].max()  # a signal far above the bound
    assert np.all(np.abs(ref[:real] - want[:real]) <= bound[:real])  # the oracle and the bound
    return batch, real, ref, want, bound


def check_attention(index):
    case, options, qpb = split_case(index)
    batch, real, ref, want, bound = expected_attention(index)
    sm_scale = batch["q"].shape[-1] ** -0.5
    got = np.asarray(attention_fn(sm_scale, options)(
        batch, "cpu", **({"queries_per_block": qpb} if qpb else {})), np.float64)
    err = np.abs(got[:real] - want[:real])
    assert np.all(err <= bound[:real]), (
        f"max error {err.max():.3g}, worst ratio {(err / bound[:real]).max():.3g}")
    assert np.all(np.abs(got[:real] - ref[:real]) <= 2 * bound[:real])
    assert np.all(got[real:] == 0)  # padding tokens


@pytest.mark.parametrize("index", range(len(ATTENTION_CASES)),
                         ids=[case_id(c) for c in ATTENTION_CASES])
def test_attention_matches_reference(index):
    check_attention(index)


@pytest.mark.parametrize("index", [0, 4, 8, 11, 12, 15, 16])
def test_attention_every_isa(index, isa):
    check_attention(index)


TREE_CASES = [c for c in KERNEL_CASES if c.get("tree")]


@pytest.mark.parametrize("index", range(len(TREE_CASES)),
                         ids=[kernel_case_id(c) for c in TREE_CASES])
def test_attention_with_trees_matches_reference(index, isa):
    """Speculative trees (test_attention_kernels' tree cases: up to 32 nodes, f32, bf16 and
    int8 K/V, prefill and decode rows): the reference's output, at every instruction-set
    level; a kernel that ignored the masks would differ."""
    case = dict(TREE_CASES[index])
    options = {k: case.pop(k) for k in ("pages_per_block", "queries_per_block") if k in case}
    rng = np.random.default_rng([index, 29])
    batch, real = kernel_batch(rng, case.pop("kind"), **{k: v for k, v in case.items()
                                                         if k != "tree"})
    tree = kernel_trees(rng, batch)
    sm_scale = batch["q"].shape[-1] ** -0.5
    run = lambda impl, **kw: np.asarray(ragged_paged_attention(  # noqa: E731
        **batch, sm_scale=sm_scale, impl=impl, **kw), np.float32)
    want, got = run("reference", **tree), run("cpu", **tree, **options)
    tol = KERNEL_TOL[case.get("dtype", jnp.float32)]
    np.testing.assert_allclose(got[:real], want[:real], atol=tol, rtol=tol)
    assert np.all(got[real:] == 0)
    assert np.abs(run("cpu") - got)[:real].max() > 10 * tol  # the trees changed it


SINK_CASES = [c for c in KERNEL_CASES if c.get("sinks")]


@pytest.mark.parametrize("index", range(len(SINK_CASES)),
                         ids=[kernel_case_id(c) for c in SINK_CASES])
def test_attention_with_sinks_matches_reference(index, isa):
    """gpt-oss's attention sinks (test_attention_kernels' sink cases: f32 and int8 K/V,
    bf16 under a sliding window, prefill and decode rows): the reference's output (itself
    checked against dense attention with the sink in the softmax), at every instruction-set
    level; a kernel that ignored the sinks would differ."""
    case = dict(SINK_CASES[index])
    options = {k: case.pop(k) for k in ("sliding_window", "queries_per_block") if k in case}
    case.pop("sinks")
    rng = np.random.default_rng([index, 31])
    batch, real = kernel_batch(rng, case.pop("kind"), **case)
    sinks = random_sinks(rng, batch)
    run = lambda impl, **kw: np.asarray(ragged_paged_attention(  # noqa: E731
        **batch, sm_scale=batch["q"].shape[-1] ** -0.5, impl=impl, **options, **kw),
        np.float32)
    want, got = run("reference", sinks=sinks), run("cpu", sinks=sinks)
    tol = KERNEL_TOL[case.get("dtype", jnp.float32)]
    np.testing.assert_allclose(got[:real], want[:real], atol=tol, rtol=tol)
    assert np.all(got[real:] == 0)
    assert np.abs(run("cpu") - got)[:real].max() > 10 * tol  # the sinks changed it


def test_attention_dispatch_and_fallback():
    from pallas_kernels.ragged_paged_attention import IMPLS, default_impl
    assert "cpu" in IMPLS and default_impl("cpu") == "cpu" and default_impl("tpu") == "tpu"
    batch, _, _ = ragged_batch(np.random.default_rng(1), kind="decode")
    f = jax.jit(lambda b: ragged_paged_attention(**b, sm_scale=0.125))
    assert "jaxserve_ragged_paged_attention" in f.lower(batch).as_text()
    # float16 queries are not the kernel's: impl=None runs the reference, impl="cpu" refuses.
    half = dict(batch, q=batch["q"].astype(jnp.float16), k_pages=batch["k_pages"].astype(jnp.float16),
                v_pages=batch["v_pages"].astype(jnp.float16))
    assert "jaxserve" not in jax.jit(lambda b: ragged_paged_attention(**b, sm_scale=0.125)
                                     ).lower(half).as_text()
    with pytest.raises(ValueError, match="cpu attention"):
        ragged_paged_attention(**half, sm_scale=0.125, impl="cpu")


def test_attention_no_real_sequences():
    batch, _, _ = ragged_batch(np.random.default_rng(2), kind="mixed")
    batch["num_seqs"] = jnp.int32(0)
    out = ragged_paged_attention(**batch, sm_scale=0.125, impl="cpu")
    assert np.all(np.asarray(out) == 0)



@pytest.mark.parametrize("pool", ["float32", "bfloat16", "bits"])
def test_write_kv_native(pool):
    """The native K/V writer puts each token's rows at its slot of every head, casts them to
    the pool's dtype, skips padding slots and leaves every other slot as it was; donated
    pages are written in place (no copy of the pool in the compiled program)."""
    from pallas_kernels.ragged_paged_attention import write_kv

    rng = np.random.default_rng(5)
    heads, pages, page_size, d = 3, 6, 4, 16
    old = rng.standard_normal((2, heads, pages, page_size, d)).astype(np.float32)
    dtype = jnp.float32 if pool == "float32" else jnp.bfloat16
    old = np.asarray(jnp.asarray(old, dtype).astype(jnp.float32))  # representable values
    new = rng.standard_normal((2, 5, heads, d)).astype(np.float32)
    slots = np.array([7, pages * page_size, 0, 23, pages * page_size], np.int32)  # 2 padding
    want = old.copy()
    for t, slot in enumerate(slots):
        if slot < pages * page_size:
            for i in range(2):
                want[i, :, slot // page_size, slot % page_size] = np.asarray(
                    jnp.asarray(new[i, t], dtype).astype(jnp.float32))
    as_pool = (lambda x: as_bits(jnp.asarray(x, dtype))) if pool == "bits" else (
        lambda x: jnp.asarray(x, dtype))
    write = jax.jit(lambda k, v, nk, nv, s: write_kv(k, v, nk, nv, s), donate_argnums=(0, 1))
    args = (jnp.asarray(new[0]), jnp.asarray(new[1]), jnp.asarray(slots))
    text = write.lower(as_pool(old[0]), as_pool(old[1]), *args).compile().as_text()
    assert "jaxserve_write_kv" in text and " copy(" not in text
    donated = [as_pool(old[0]).copy(), as_pool(old[1]).copy()]  # owned, not numpy's memory
    where = [x.unsafe_buffer_pointer() for x in donated]
    in_place = write(*donated, *args)
    assert [x.unsafe_buffer_pointer() for x in in_place] == where
    for got in (in_place, write_kv(as_pool(old[0]), as_pool(old[1]), *args)):  # not donated
        for i in range(2):
            assert got[i].dtype == as_pool(old[0]).dtype
            np.testing.assert_array_equal(np.asarray(as_values(got[i]).astype(jnp.float32)),
                                          want[i])
    with pytest.raises(ValueError, match="unquantized"):
        write_kv(*(jnp.zeros((1, 2, 2, 4), jnp.int8),) * 2, *(jnp.ones((1, 1, 4)),) * 2,
                 jnp.zeros(1, jnp.int32), *(jnp.ones((1, 2, 2)),) * 2, impl="cpu")


# ----------------------------------------------------------------------------- row-wise ops

def as_dtype(x, dtype):
    """float64 values rounded to `dtype` (numpy's float32 or ml_dtypes' bfloat16)."""
    np_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32
    return np.asarray(np.asarray(x, np.float64).astype(np_dtype), np.float64)


def assert_close_to_oracle(got, want, dtype, terms: int = 0, exp_arg=None, scale=1.0):
    """`want` is the float64 oracle rounded as the op rounds. bf16: the kernel's float32
    math may land on the other side of a rounding boundary, one unit in the last place at
    most and nearly never. float32: the worst case of its roundings, a sum of `terms`
    squares (gamma(terms)), a handful of operations, and e^a's relative error |a| times
    the few roundings of a (`exp_arg`). Below float32's normal range times `scale` (the
    input's size: g / (1 + e^-g) is 0 once e^-g overflows), absolutely."""
    got = np.asarray(got, np.float64)
    if dtype == jnp.bfloat16:
        bound = 2.0**-7 * np.abs(want)
        assert np.mean(got == want) > 0.97
    else:
        amplified = 0 if exp_arg is None else 4 * np.abs(exp_arg)
        bound = (gamma(terms) + (8 + amplified) * U32) * np.abs(want)
    bound = bound + np.finfo(np.float32).tiny * scale
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation_matches_float64(act, dtype, isa):
    """act(gate) * up on the real rows: act in float64 rounded to the dtype
    (as transformers computes silu / tanh gelu of a bf16 tensor), times up, rounded; inputs
    from -100 to 100 (exp's clamps, both signs)."""
    from pallas_kernels.rows import gated_activation

    rng = np.random.default_rng(4)
    gate = rng.standard_normal((9, 300)) * 4
    gate[0, :5] = [-100.0, -90.0, 0.0, 90.0, 100.0]
    gate, up = jnp.asarray(gate, dtype), jnp.asarray(rng.standard_normal((9, 300)), dtype)
    got = jax.jit(lambda g, u: gated_activation(g, u, act, rows=7, impl="cpu"))(gate, up)
    g = np.asarray(gate, np.float64)
    # silu = g / (1 + e^-g); tanh gelu = 0.5 g (1 + tanh(z)) = g / (1 + e^-2z), no cancellation
    arg = -g if act == "silu" else -2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)
    a = g / (1 + np.exp(np.minimum(arg, 700)))
    want = as_dtype(as_dtype(a, dtype) * np.asarray(up, np.float64), dtype)
    assert got.dtype == dtype and got.shape == gate.shape
    assert_close_to_oracle(got[:7], want[:7], dtype, exp_arg=arg[:7], scale=1 + np.abs(g[:7]))
    assert np.abs(want[:7]).max() > 1  # a signal, not zeros


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add+norm"])
@pytest.mark.parametrize("offset", [False, True], ids=["llama", "gemma"])
def test_rms_norm_matches_float64(offset, residual, dtype, isa):
    """RMSNorm (of x + residual, which is returned rounded) on the real rows, against
    float64 with the roundings of layers.rms_norm / transformers: x * rsqrt
    rounded, then its product with w (Gemma: x * rsqrt * (1 + w), rounded once)."""
    from pallas_kernels.rows import rms_norm

    rng = np.random.default_rng([offset, residual])
    x = jnp.asarray(rng.standard_normal((6, 257)) * 3, dtype)  # K past a vector width
    r = jnp.asarray(rng.standard_normal((6, 257)), dtype) if residual else None
    w = jnp.asarray(rng.standard_normal(257), dtype)
    got = jax.jit(lambda x, r: rms_norm(x, w, 1e-6, offset, residual=r, rows=5, impl="cpu"))(x, r)
    s = np.asarray(x, np.float64)
    if residual:
        got, got_sum = got
        s = as_dtype(s + np.asarray(r, np.float64), dtype)
        np.testing.assert_array_equal(np.asarray(got_sum[:5], np.float64), s[:5])
    normed = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-6)
    w64 = np.asarray(w, np.float64)
    want = (as_dtype(normed * (1 + w64), dtype) if offset
            else as_dtype(w64 * as_dtype(normed, dtype), dtype))
    assert got.dtype == dtype
    assert_close_to_oracle(got[:5], want[:5], dtype, terms=257)
    assert np.abs(want[:5]).max() > 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_rope_matches_float64(dtype, isa):
    """q and k rotated by position ('rotate half') on the real rows, against
    float64: angles f32(position) * inv_freq in float32 as the reference forms them, cos and
    sin rounded to the dtype, bf16 products and sums rounded as the reference's bf16 ops."""
    from pallas_kernels.rows import rope

    rng = np.random.default_rng(5)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((11, 5, 64)) * 3, dtype)
    k = jnp.asarray(rng.standard_normal((11, 2, 64)) * 3, dtype)
    pos = jnp.asarray(rng.integers(0, 40000, 11), jnp.int32)
    got = jax.jit(lambda q, k, p: rope(q, k, p, inv_freq, rows=9, impl="cpu"))(q, k, pos)
    angle = (np.asarray(pos, np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    cos, sin = as_dtype(np.cos(angle), dtype)[:, None], as_dtype(np.sin(angle), dtype)[:, None]
    for x, y in zip((q, k), got):
        x = np.asarray(x, np.float64)
        a, b = x[..., :32], x[..., 32:]
        if dtype == jnp.bfloat16:
            r = lambda v: as_dtype(v, dtype)  # noqa: E731
            want = np.concatenate([r(r(a * cos) - r(b * sin)), r(r(b * cos) + r(a * sin))], -1)
        else:
            want = np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
        assert y.dtype == dtype and y.shape == x.shape
        size = np.abs(np.concatenate([a, b], -1)) + np.abs(np.concatenate([b, a], -1))
        err = np.abs(np.asarray(y[:9], np.float64) - want[:9])
        if dtype == jnp.bfloat16:  # cos, sin from float32 may round the other way, rarely
            assert np.mean(err == 0) > 0.97 and np.all(err <= 2.0**-7 * size[:9])
        else:  # float32 cos, sin (a few ulps) and four roundings
            assert np.all(err <= 16 * U32 * size[:9]), (err / size[:9]).max()
        assert np.abs(want[:9]).max() > 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,real", [(8, 3), (64, 32)])
def test_real_rows_ignore_the_padding_rows(m, real, dtype):
    """The kernels leave the rows past `num_rows` unwritten, so a bucket's padding rows hold
    whatever their buffers held (a NaN, stale activations); a real row must not depend on
    them. Every native row-wise kernel and the matmul's paths (few-row dot products and
    sums, panels, packed weights), their padding rows finite and then NaN: the real rows
    come out bit for bit the same."""
    from pallas_kernels.matmul import matmuls, packed
    from pallas_kernels.rows import gated_activation, rms_norm, rope

    rng = np.random.default_rng([m, real])
    k, inv_freq = 128, (1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    nk = [jnp.asarray(rng.standard_normal((n, k)), dtype) for n in (64, 192)]
    kn = jnp.asarray(rng.standard_normal((k, 96)), dtype)
    norm_w = jnp.asarray(rng.standard_normal(k), dtype)
    pos = jnp.asarray(rng.integers(0, 4000, m), jnp.int32)

    @jax.jit
    def every_kernel(x, r, q, kk):
        rows = jnp.int32(real)
        return (matmuls(x, nk, rows, transpose_w=True, impl="cpu"),
                matmuls(x, [packed.pack(w) for w in nk], rows, packed_w=True, impl="cpu"),
                matmuls(x, [kn], rows, impl="cpu"),
                rms_norm(x, norm_w, 1e-6, residual=r, rows=rows, impl="cpu"),
                gated_activation(x, r, "silu", rows=rows, impl="cpu"),
                rope(q, kk, pos, inv_freq, rows=rows, impl="cpu"))

    shapes = ((m, k), (m, k), (m, 5, 64), (m, 2, 64))  # x (gate), residual (up), q, k
    draws = [rng.standard_normal(shape) for shape in shapes]

    def operands(padding):
        padded = [np.concatenate([a[:real], np.full_like(a[real:], padding)]) for a in draws]
        return [jnp.asarray(a, dtype) for a in padded]

    clean, poisoned = operands(1.0), operands(np.nan)
    for a, b in zip(jax.tree.leaves(every_kernel(*clean)), jax.tree.leaves(every_kernel(*poisoned))):
        got, want = np.asarray(b[:real], np.float32), np.asarray(a[:real], np.float32)
        assert np.isfinite(want).all() and np.abs(want).max() > 0.5
        np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------------- LoRA

LORA_CASES = [  # tokens, in, rank, slots, outs
    (7, 64, 8, 3, (48, 16)),  # 8 ranks: one register vector
    (37, 96, 20, 4, (300, 17, 5)),  # 20 ranks: the generic loops; past a 256-column strip
    (1, 32, 16, 2, (40,)),  # one token
    (6, 40, 24, 2, (33,)),  # 16 + 8 ranks; a column past the 16s
]


@pytest.mark.parametrize("case", LORA_CASES, ids=lambda c: "x".join(map(str, c[:4])))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_lora_kernel_adds_each_tokens_adapter_delta(isa, dtype, case):
    """y + x A[s] B[s] per token against float64 (rounded once to y's dtype), every module
    of one input in one call; tokens without an adapter (slot 0) keep y to the bit."""
    t, k, r, g, outs = case
    rng = np.random.default_rng(t)
    x = as_dtype(rng.standard_normal((t, k)), dtype)
    slots = rng.integers(0, g + 1, t).astype(np.int32)
    slots[:2] = [g, 0][:t]
    stacks = [(as_dtype(rng.standard_normal((g, k, r)) / 8, dtype),
               as_dtype(rng.standard_normal((g, r, n)) / 8, dtype)) for n in outs]
    ys = [as_dtype(rng.standard_normal((t, n)), dtype) for n in outs]
    got = jax.jit(lora_cpu.lora_add)(
        jnp.asarray(x, dtype), jnp.asarray(slots), [jnp.asarray(y, dtype) for y in ys],
        [(jnp.asarray(a, dtype), jnp.asarray(b, dtype)) for a, b in stacks])
    for y, out, (a, b) in zip(ys, got, stacks):
        h = np.einsum("tk,tkr->tr", x, a[np.maximum(slots - 1, 0)])
        delta = np.einsum("tr,trn->tn", h, b[np.maximum(slots - 1, 0)]) * (slots > 0)[:, None]
        terms = np.einsum("tk,tkr->tr", np.abs(x), np.abs(a[np.maximum(slots - 1, 0)]))
        terms = np.einsum("tr,trn->tn", terms, np.abs(b[np.maximum(slots - 1, 0)]))
        out = np.asarray(out, np.float64)
        bound = gamma(k + r + 1) * (terms + np.abs(y))
        if dtype == jnp.bfloat16:
            bound = bound + 2.0**-8 * np.abs(y + delta)
        assert (np.abs(out - (y + delta)) <= bound).all()
        assert (out[slots == 0] == y[slots == 0]).all()
        assert np.abs(delta[slots > 0]).min() > 0  # every adapter token's delta counts


def test_lora_kernel_without_adapter_tokens_or_in_place_leaves_y_as_it_was():
    """A batch without adapter tokens returns y; where y is still read after the call (no
    aliasing possible), the kernel starts from a copy and the original is untouched."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((2, 16, 4)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)

    @jax.jit
    def both(slots, y):
        (out,) = lora_cpu.lora_add(x, slots, [y], [(a, b)])
        return out, y * 1.0

    out, kept = both(jnp.zeros(5, jnp.int32), y)
    assert (np.asarray(out) == np.asarray(y)).all()
    out, kept = both(jnp.asarray([0, 1, 2, 0, 1], jnp.int32), y)
    assert (np.asarray(kept) == np.asarray(y)).all()
    assert (np.asarray(out)[[0, 3]] == np.asarray(y)[[0, 3]]).all()
    assert not np.isclose(np.asarray(out)[[1, 2, 4]], np.asarray(y)[[1, 2, 4]]).any()


# ------------------------------------------------------------------------------ argmax

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_argmax_is_numpys(dtype, isa):
    """jaxserve_argmax (the sampler's first_argmax on a CPU) against np.argmax of the same
    values: ties (the first wins), rows of -inf, NaN (the first NaN, before or after the
    maximum), vocabularies around the 8- and 16-lane and 64-token steps, and tokens enough
    (4.2M) to split the rows over the threads."""
    from jaxserve.engine.sampler import first_argmax

    rng = np.random.default_rng(9)
    for s, v in [(1, 1), (3, 7), (4, 16), (5, 17), (6, 63), (7, 64), (9, 65), (8, 300),
                 (40, 2053), (6, 700_001)]:
        x = rng.integers(-4, 4, size=(s, v)).astype(np.float32)  # many ties
        x[0, -1] = 9.0  # the maximum in the row's last token
        if s >= 4:
            x[1, :] = -np.inf
            x[2, v // 2] = np.nan
            x[3, 0], x[3, -1] = np.nan, np.inf
        if s >= 6 and v > 20:
            x[4, 3], x[4, v - 2] = 50.0, np.nan  # a NaN after the maximum
            x[5] = rng.standard_normal(v)  # no ties
        values = jnp.asarray(x, dtype)
        got = np.asarray(jax.jit(first_argmax)(values))
        want = np.argmax(np.asarray(values, np.float32), axis=-1)
        np.testing.assert_array_equal(got, want, err_msg=f"{s} x {v}")
    text = jax.jit(first_argmax).lower(values).as_text()
    assert "jaxserve_argmax" in text  # the native kernel, not XLA's argmax


# -------------------------------------------------------------------------------- build

def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


@pytest.mark.slow  # ~30-60 s on a 2-core machine
def test_fresh_process_builds_into_empty_cache(tmp_path):
    result = run_python("""
        import jax.numpy as jnp
        from pallas_kernels import cpu
        from pallas_kernels.matmul import matmul
        assert cpu.available(), cpu.unavailable_reason()
        print(cpu.library_path())
        print(float(matmul(jnp.ones((1, 3)), jnp.ones((3, 2)), impl="cpu")[0, 1]))
        """, JAXSERVE_CACHE=str(tmp_path))
    assert result.returncode == 0, result.stderr
    path, value = result.stdout.split()[-2:]
    assert path.startswith(str(tmp_path)) and os.path.exists(path) and float(value) == 3.0
    assert not [p for p in os.listdir(os.path.dirname(path)) if p.startswith(".build-")]


@pytest.mark.parametrize("env", [dict(JAXSERVE_CPU_KERNELS="0"), dict(CXX="/nonexistent/c++")],
                         ids=["disabled", "no-compiler"])
def test_unavailable_warns_and_falls_back(env, tmp_path):
    result = run_python("""
        import jax.numpy as jnp
        from pallas_kernels import cpu
        from pallas_kernels.matmul import default_impl, matmul
        assert not cpu.available() and not cpu.available()
        assert default_impl("cpu") == "reference"
        print(float(matmul(jnp.ones((1, 3)), jnp.ones((3, 2)))[0, 0]))
        """, JAXSERVE_CACHE=str(tmp_path), **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "3.0"
    assert result.stderr.count("native CPU kernels unavailable") == 1


def test_isa_cap_from_the_environment():
    """JAXSERVE_CPU_ISA caps the instruction set for the whole process; a name that is not
    a level leaves the kernels off with the reason, and the references run."""
    code = """
        from pallas_kernels import cpu
        print(cpu.available(), cpu.isa(), cpu.unavailable_reason())
        """
    capped = run_python(code, JAXSERVE_CPU_ISA="avx2")
    assert capped.returncode == 0, capped.stderr
    assert capped.stdout.split()[-3:] == ["True", "avx2", "None"]
    bad = run_python(code, JAXSERVE_CPU_ISA="sse9")
    assert bad.returncode == 0, bad.stderr
    assert bad.stdout.split()[:2] == ["False", "None"] and "JAXSERVE_CPU_ISA" in bad.stdout


def test_round_trip_diagnostic():
    """A cache line's round trip between two spinning threads, per trip: within what any
    CPU takes (tens of ns within a cache, hundreds across sockets or a VM's distant vCPUs,
    microseconds when a loaded host preempts one), not a total over all trips nor zero."""
    ns = native.round_trip_ns(trips=2000, rounds=3)
    assert 5.0 < ns < 1e5, ns


def test_pair_flops_diagnostic():
    """Two threads' floating-point rate over one's: near 1 (one core's SMT threads) to near 2
    (two cores); a ratio of rates, not a time nor its inverse. A timing on a machine the
    other test workers share: read up to three times, half a second apart (a CI run read
    5.6, 3.0 and 4.3 when one thread alone was the shorter of two timings a round; now it
    is the shortest of rounds + 1)."""
    ratios = []
    for attempt in range(3):
        time.sleep(0.5 * attempt)  # (apart, so a neighbour's burst may pass)
        ratios.append(native.pair_flops_ratio(iters=100_000, rounds=7))
        if 0.6 < ratios[-1] < 2.6:
            break
    assert 0.6 < ratios[-1] < 2.6, ratios


def test_the_serving_library_leaves_the_diagnostics_out():
    """The benchmarks' diagnostics are a library of their own (diagnostics.cc): the one
    the engine loads has the FFI targets and the instruction-set control, not them."""
    assert native.available(), native.unavailable_reason()
    lib = ctypes.CDLL(str(native.library_path()))
    assert hasattr(lib, "JaxserveMatmul") and hasattr(lib, "jaxserve_cpu_isa")
    assert not hasattr(lib, "jaxserve_cpu_round_trip_ns")
    assert not hasattr(lib, "jaxserve_cpu_pair_flops_ratio")


# ----------------------------------------------------------------- quantized matmul

QMM_CASES = [  # m, num_rows, k, n, kind, group, zero points
    (1, 1, 640, 200, "int8", None, False),
    (2, 2, 640, 200, "int8", 32, True),     # GGUF's Q8_0 groups, GPTQ 8-bit zero points
    (5, 4, 384, 96, "int8", 128, False),   # panels of group-scaled int8
    (2, 2, 384, 256, "int4", 128, False),
    (3, 3, 640, 200, "int4", 32, True),   # past the direct rows: panels
    (8, 6, 384, 96, "int4", 64, True),
    (33, 33, 256, 200, "int8", None, True),  # per channel with zero points
    (64, 60, 512, 64, "int4", 256, True),  # a group of 256: two panels per group
    (32, 32, 256, 96, "int8", 16, True),   # GGUF's Q4_K_M held: 8 groups a panel
    (7, 7, 256, 64, "int4", 16, True),     # Q2_K's groups; AVX-512's row tails 4 + 2 + 1
    (150, 133, 256, 96, "int4", 32, True),  # a prefill chunk: blocks of 64, 64 and 5 rows
    (100, 100, 128, 64, "int8", 16, False),
    (1, 1, 640, 200, "fp4", 32, False),    # MXFP4: e2m1 codes through the table
    (2, 2, 384, 256, "fp4", 32, False),
    (5, 4, 384, 96, "fp4", 32, False),     # panels
    (7, 7, 256, 64, "fp4", 64, False),
    (150, 133, 256, 96, "fp4", 32, False),
]


@pytest.mark.parametrize("case", QMM_CASES, ids=lambda c: f"{c[4]}-g{c[5] or 'K'}{'-zp' if c[6] else ''}"
                         f"-m{c[0]}")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_quantized_matmul_kernel_against_float64(isa, dtype, case):
    """x @ W for int8 and int4 (per channel or grouped, symmetric and with zero points) and
    fp4 against the exact product with the weight dequantized in float64 from the stored
    integers (an unpacker written here; fp4's codes read by ml_dtypes' float4_e2m1fn), on
    the real rows. For one or two rows the kernel
    sums x * u over the stored unsigned integers and subtracts (8 + z) * sum(x) per group;
    for more it dequantizes u * s - (8 + z) * s first: the bound holds both terms'
    magnitudes."""
    _check_quantized_matmul(dtype, case, packed=False)


@pytest.mark.parametrize("case", [c for c in QMM_CASES if c[3] % 32 == 0],
                         ids=lambda c: f"{c[4]}-g{c[5] or 'K'}{'-zp' if c[6] else ''}-m{c[0]}")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_quantized_matmul_kernel_on_packed_values(isa, dtype, case):
    """The same products with the values and scales packed in strips of 32 columns
    (formats.pack_strips, the layout the engine gives them on a CPU): the float64 check
    reads the row-major arrays the strips were made from."""
    _check_quantized_matmul(dtype, case, packed=True)


def _check_quantized_matmul(dtype, case, packed: bool) -> None:
    from pallas_kernels.quantized_matmul import cpu as qmm_cpu
    from pallas_kernels.quantized_matmul.formats import pack_strips, quantize

    m, rows, k, n, kind, group, zp = case
    rng = np.random.default_rng(m * k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = rng.standard_normal((k, n)).astype(np.float32) + rng.uniform(-1, 1, (1, n)).astype(np.float32)
    values, scales = quantize(jnp.asarray(w), kind, group, zero_points=zp)
    stored = (pack_strips(values), pack_strips(scales)) if packed else (values, scales)
    got = jax.jit(lambda x, v, s, r: qmm_cpu.quantized_matmul(x, v, s, kind=kind, rows=r,
                                                              packed=packed))(
        x, *stored, jnp.int32(rows))
    assert got.dtype == dtype and got.shape == (m, n)
    v, s = np.asarray(values), np.asarray(scales.astype(jnp.float32), np.float64)
    s, z = (s[0], s[1]) if zp else (s, np.zeros_like(s))
    g = k // s.shape[0]
    if kind == "int8":
        u, off = v.astype(np.float64), z
    else:
        lo, hi = (v & 0xF).astype(np.int64), (v >> 4).astype(np.int64)
        u = np.empty((k, n))
        for j in range(k // g):  # byte row r of group j: rows j g + r (low), j g + g/2 + r
            u[j * g:j * g + g // 2] = lo[j * g // 2:(j + 1) * g // 2]
            u[j * g + g // 2:(j + 1) * g] = hi[j * g // 2:(j + 1) * g // 2]
        if kind == "fp4":
            u = u.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
            off = z
        else:
            u, off = u.astype(np.int64) ^ 8, 8 + z
    rep = lambda a: np.repeat(a, g, axis=0)  # noqa: E731
    xe = np.asarray(x.astype(jnp.float32), np.float64)
    exact = xe @ ((u - rep(off)) * rep(s))
    magnitude = np.abs(xe) @ (np.abs(u) * rep(s)) + np.abs(xe) @ (rep(np.abs(off) * s))
    bound = gamma(k + 4) * magnitude + U_OUT[dtype] * np.abs(exact)
    got = np.asarray(got[:rows].astype(jnp.float32), np.float64)  # rows past: unwritten
    assert np.abs(exact[:rows]).max() > 100 * bound[:rows].max()
    err = np.abs(got - exact[:rows])
    assert np.all(err <= bound[:rows]), (err / bound[:rows]).max()


def test_packed_values_read_by_the_reference_are_unpacked():
    """Every non-native implementation reads packed values and scales unpacked: the same
    product as the row-major arrays; the strips are the columns' elements in strip order,
    plane by plane for zero points' `[2, G', N]`, and unpacking restores them."""
    from pallas_kernels import quantized_matmul as qmm
    from pallas_kernels.quantized_matmul.formats import pack_strips, quantize, unpack_strips

    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((128, 96)), jnp.float32)
    for kind, zp in (("int8", False), ("int4", True)):
        values, scales = quantize(w, kind, 32, zero_points=zp)
        packed, packed_scales = pack_strips(values), pack_strips(scales)
        v, sc = np.asarray(values), np.asarray(scales)
        assert np.array_equal(np.asarray(packed).reshape(-1)[:v.shape[0] * 32],
                              v[:, :32].reshape(-1))  # strip 0: every byte row's first 32
        last, packed_last = (sc[1], np.asarray(packed_scales)[1]) if zp else (
            sc, np.asarray(packed_scales))  # the zero points' plane, or the scales
        assert np.array_equal(packed_last.reshape(-1)[:last.shape[0] * 32],
                              last[:, :32].reshape(-1))
        assert np.array_equal(np.asarray(unpack_strips(packed)), v)
        assert np.array_equal(np.asarray(unpack_strips(packed_scales)), sc)
        x = jnp.asarray(rng.standard_normal((80, 128)), jnp.float32)
        want = qmm.quantized_matmul(x, values, scales, kind=kind, impl="reference")
        got = jax.jit(lambda x, p, s: qmm.quantized_matmul(x, p, s, kind=kind,
                                                           impl="reference", packed=True))(
            x, packed, packed_scales)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_quantized_matmul_dispatch_on_a_cpu():
    """On a CPU, int8 / int4 take the native kernel at any row count (a prefill chunk in
    blocks of 64); fp8 and a mesh's shards take the reference."""
    from pallas_kernels import quantized_matmul as qmm
    from pallas_kernels.quantized_matmul.formats import quantize

    def targets(m, kind):
        values, scales = quantize(jnp.ones((128, 64)), kind)
        text = jax.jit(lambda x: qmm.quantized_matmul(x, values, scales, kind=kind)).lower(
            jnp.ones((m, 128), jnp.float32)).as_text()
        return "jaxserve_quantized_matmul" in text

    assert targets(1, "int8") and targets(64, "int4") and targets(300, "int8")
    assert not targets(8, "fp8")
