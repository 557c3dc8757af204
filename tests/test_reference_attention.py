"""The reference ragged paged attention against plain dense masked attention (numpy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_kv


def random_batch(rng, *, num_seqs, page_size, num_kv_heads, group, head_dim, dtype, max_pages=6):
    """Mixed decode/prefill sequences with contexts of 1..max_pages pages, pages shuffled."""
    q_lens, kv_lens = [], []
    for _ in range(num_seqs):
        kv = int(rng.integers(1, max_pages * page_size + 1))
        q = 1 if rng.random() < 0.5 else int(rng.integers(1, kv + 1))  # decode or prefill chunk
        q_lens.append(q)
        kv_lens.append(kv)
    num_pages = num_seqs * max_pages + 5
    perm = rng.permutation(num_pages)
    page_indices = perm[: num_seqs * max_pages].reshape(num_seqs, max_pages)
    hq = num_kv_heads * group
    k_pages = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))
    v_pages = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))
    q = rng.standard_normal((sum(q_lens), hq, head_dim))
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    cast = lambda x: x.astype(np.float32).astype(dtype)  # noqa: E731
    return dict(q=cast(q), k_pages=cast(k_pages), v_pages=cast(v_pages),
                kv_lens=np.array(kv_lens, np.int32), page_indices=page_indices.astype(np.int32),
                cu_q_lens=cu.astype(np.int32))


def ancestors_or_self(parents: list[int], node: int) -> set[int]:
    out = set()
    while node >= 0:
        out.add(node)
        node = parents[node]
    return out


def dense_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sm_scale,
                    sliding_window=None, soft_cap=None, trees=None, sinks=None):
    """`trees`: per sequence, (the position where its tree starts, its parent list).
    `sinks`: a logit per query head joined to every row's scores and dropped after the
    softmax (transformers' gpt-oss eager attention)."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    hkv, page_size = k_pages.shape[0], k_pages.shape[2]
    group = q.shape[1] // hkv
    out = np.zeros_like(q)
    for s in range(len(kv_lens)):
        kv_len, start, end = kv_lens[s], cu_q_lens[s], cu_q_lens[s + 1]
        slots = [(page_indices[s, j // page_size], j % page_size) for j in range(kv_len)]
        k = np.stack([k_pages[:, p, r] for p, r in slots])  # [kv, hkv, d]
        v = np.stack([v_pages[:, p, r] for p, r in slots])
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        for i, t in enumerate(range(start, end)):
            pos = kv_len - (end - start) + i
            scores = np.einsum("hd,khd->hk", q[t], k) * sm_scale
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            keys = np.arange(kv_len)
            mask = keys <= pos
            if sliding_window is not None:
                mask &= keys > pos - sliding_window
            if trees is not None and trees[s][1]:  # a node sees the nodes on its path
                root, parents = trees[s]
                path = ancestors_or_self(parents, pos - root) if pos >= root else set()
                mask &= (keys < root) | np.isin(keys - root, list(path))
            scores = np.where(mask[None], scores, -np.inf)
            if sinks is not None:
                scores = np.concatenate([scores, np.asarray(sinks, np.float64)[:, None]], -1)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p = p / p.sum(-1, keepdims=True)
            if sinks is not None:
                p = p[:, :-1]
            out[t] = np.einsum("hk,khd->hd", p, v)
    return out


CASES = [
    dict(group=1, head_dim=64, page_size=4),
    dict(group=4, head_dim=64, page_size=8),
    dict(group=8, head_dim=128, page_size=4),
    dict(group=4, head_dim=64, page_size=4, sliding_window=7),
    dict(group=2, head_dim=64, page_size=4, soft_cap=5.0),
    dict(group=4, head_dim=64, page_size=4, pages_per_block=1),
    dict(group=4, head_dim=64, page_size=4, queries_per_block=1),
    dict(group=2, head_dim=64, page_size=4, queries_per_block=3, sliding_window=5),
    dict(group=4, head_dim=64, page_size=8, queries_per_block=32),
    # gpt-oss: attention sinks, on full and sliding layers.
    dict(group=4, head_dim=64, page_size=4, sinks=True),
    dict(group=2, head_dim=64, page_size=4, sliding_window=5, sinks=True, pages_per_block=1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_dense(case, seed):
    rng = np.random.default_rng(seed)
    case = dict(case)
    window, cap = case.pop("sliding_window", None), case.pop("soft_cap", None)
    ppb, qpb = case.pop("pages_per_block", None), case.pop("queries_per_block", None)
    with_sinks = case.pop("sinks", False)
    b = random_batch(rng, num_seqs=5, num_kv_heads=2, dtype=np.float32, **case)
    sinks = (rng.normal(1.0, 1.5, 2 * case["group"]).astype(np.float32) if with_sinks
             else None)
    scale = case["head_dim"] ** -0.5
    max_seqs = 8  # padded sequence slots past num_seqs must be ignored
    pad = max_seqs - 5
    got = ragged_paged_attention(
        jnp.asarray(b["q"]), jnp.asarray(b["k_pages"]), jnp.asarray(b["v_pages"]),
        jnp.asarray(np.pad(b["kv_lens"], (0, pad))),
        jnp.asarray(np.pad(b["page_indices"], ((0, pad), (0, 0)))),
        jnp.asarray(np.pad(b["cu_q_lens"], (0, pad), mode="edge")), jnp.int32(5),
        sm_scale=scale, sliding_window=window, soft_cap=cap, pages_per_block=ppb,
        queries_per_block=qpb, sinks=sinks)
    want = dense_attention(b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["page_indices"],
                           b["cu_q_lens"], scale, window, cap, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    if with_sinks:  # the sinks take a real share of the weights
        plain = dense_attention(b["q"], b["k_pages"], b["v_pages"], b["kv_lens"],
                                b["page_indices"], b["cu_q_lens"], scale, window, cap)
        assert np.abs(want - plain).max() > 0.1


@pytest.mark.parametrize("case", [dict(), dict(pages_per_block=1, queries_per_block=3),
                                  dict(queries_per_block=32), dict(sliding_window=9)],
                         ids=["default", "small-blocks", "one-item", "window"])
def test_tree_masks_match_dense_attention_over_each_path(case):
    """Speculative trees (up to 32 nodes, random shapes): each node attends to the context
    before its tree and to the nodes on its own path from the root, as dense attention
    over exactly those keys does."""
    from ragged_lengths import draw_trees

    rng = np.random.default_rng(9)
    b = random_batch(rng, num_seqs=8, num_kv_heads=2, group=4, head_dim=64, page_size=4,
                     dtype=np.float32, max_pages=12)
    q_lens = np.diff(b["cu_q_lens"]).tolist()
    starts, masks, parents = draw_trees(rng, b["kv_lens"].tolist(), q_lens)
    assert sorted(map(len, parents))[-3:] == [4, 31, 32]  # 32 nodes: the mask's sign bit
    window = case.pop("sliding_window", None)
    got = ragged_paged_attention(
        b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["page_indices"], b["cu_q_lens"],
        jnp.int32(8), sm_scale=0.125, sliding_window=window,
        tree_start=np.asarray(starts, np.int32), tree_mask=np.asarray(masks, np.int32), **case)
    want = dense_attention(b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["page_indices"],
                           b["cu_q_lens"], 0.125, window, trees=list(zip(starts, parents)))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    causal = dense_attention(b["q"], b["k_pages"], b["v_pages"], b["kv_lens"],
                             b["page_indices"], b["cu_q_lens"], 0.125, window)
    assert np.abs(np.asarray(got) - causal).max() > 0.1  # the trees changed something


def test_padding_tokens_give_zeros_and_bf16_close():
    rng = np.random.default_rng(7)
    b = random_batch(rng, num_seqs=3, num_kv_heads=2, group=4, head_dim=64, page_size=4,
                     dtype=jnp.bfloat16)
    t = b["q"].shape[0]
    q = np.concatenate([b["q"], np.ones((5,) + b["q"].shape[1:], b["q"].dtype)])  # 5 pad tokens
    got = ragged_paged_attention(q, b["k_pages"], b["v_pages"], b["kv_lens"], b["page_indices"],
                                 b["cu_q_lens"], jnp.int32(3), sm_scale=0.125)
    got = np.asarray(got, np.float32)
    assert np.all(got[t:] == 0)
    want = dense_attention(b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["page_indices"],
                           b["cu_q_lens"], 0.125)
    # bf16 inputs, f32 accumulation, bf16 output: bf16 has 8 bits of mantissa (~4e-3).
    np.testing.assert_allclose(got[:t], want, atol=2e-2, rtol=2e-2)


def test_write_kv_places_tokens_and_drops_padding():
    k_pages = jnp.zeros((2, 4, 2, 3))  # [Hkv, pages, page_size, D]
    v_pages = jnp.zeros((2, 4, 2, 3))
    k = jnp.arange(18, dtype=jnp.float32).reshape(3, 2, 3) + 1
    slots = jnp.array([5, 0, 8])  # page 2 row 1, page 0 row 0, out of range (dropped)
    k2, v2 = jax.jit(write_kv)(k_pages, v_pages, k, -k, slots)
    np.testing.assert_array_equal(k2[:, 2, 1], k[0])
    np.testing.assert_array_equal(v2[:, 0, 0], -k[1])
    assert float(jnp.abs(k2).sum()) == float(k[:2].sum())


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_quantized_cache_round_trip_and_attention(dtype):
    """Tokens written to a quantized cache come back within half a quantization step (int8)
    or e4m3's 3-bit mantissa (fp8), and attention over it matches dense attention over the
    dequantized values exactly as the f32 path does."""
    rng = np.random.default_rng(3)
    b = random_batch(rng, num_seqs=4, num_kv_heads=2, group=4, head_dim=64, page_size=4,
                     dtype=np.float32)
    hkv, num_pages, page_size, d = b["k_pages"].shape
    zeros = jnp.zeros((hkv, num_pages, page_size, d), dtype)
    ones = jnp.ones((hkv, num_pages, page_size), jnp.float32)
    flat_k = b["k_pages"].transpose(1, 2, 0, 3).reshape(-1, hkv, d)  # every slot's token
    flat_v = b["v_pages"].transpose(1, 2, 0, 3).reshape(-1, hkv, d)
    slots = jnp.arange(num_pages * page_size)
    kq, vq, ks, vs = jax.jit(write_kv)(zeros, zeros, flat_k, flat_v, slots, ones, ones)
    k_deq = np.asarray(kq, np.float32) * np.asarray(ks)[..., None]
    v_deq = np.asarray(vq, np.float32) * np.asarray(vs)[..., None]
    amax = np.abs(b["k_pages"]).max(-1, keepdims=True)
    # int8: |err| <= step / 2 = amax / 254. e4m3: 3 mantissa bits, relative 2^-4.
    bound = amax / 254 + 1e-6 if dtype == jnp.int8 else np.abs(b["k_pages"]) * 2**-4 + amax * 2**-9
    assert np.all(np.abs(k_deq - b["k_pages"]) <= bound)
    got = ragged_paged_attention(b["q"], kq, vq, b["kv_lens"], b["page_indices"], b["cu_q_lens"],
                                 jnp.int32(4), sm_scale=0.125, k_scales=ks, v_scales=vs)
    want = dense_attention(b["q"], k_deq, v_deq, b["kv_lens"], b["page_indices"], b["cu_q_lens"],
                           0.125)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
