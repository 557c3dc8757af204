"""The kernels against their references and against this device's bandwidth floor.

Ragged paged attention at Llama-3-8B per-layer shapes (32 query heads, 8 KV heads,
head_dim 128, bf16 queries; bf16 or int8 KV pages):
  decode 64 x 2048 (the target shape; 8 x 1024 on CPU unless --full), decode 4 x 8192
  (small batch, long context: the GPU kernel's split-KV path), prefill 1 x 512 new tokens
  at context 512, a mixed batch (8 decodes at context 2048 + a 256-token chunk at context
  512), and the decode rows again with an int8 cache; plus `write_kv` (the XLA scatter
  that stores the new tokens' K/V, cache donated as in the engine) for each of them.
Weight-only quantized matmul at Llama-3-8B MLP shapes: x[M, 4096] @ W[4096, 14336] and
x[M, 14336] @ W[14336, 4096], M in {1, 16, 64} (M in {1, 16} and the first shape only
on CPU unless --full), bf16 dot (the peer a user would otherwise run) beside int8, int4
(group 128) and fp8 weights.
Dense (float) matmul at smollm2-135m per-layer shapes, f32 and bf16: x[M, K] @ W^T with W
[N, K] as the engine keeps weights on one CPU device, for [K x N] [576 x 576] (q, o),
[576 x 192] (k, v), [576 x 1536] (gate, up), [1536 x 576] (down), and the tied LM head
x[M, 576] @ embed[49152, 576]^T, for M in {1, 64, 512} (decode at batch 1,
a decode batch, a prefill chunk) and 32 real rows of a 64-row bucket (a short prompt: the
reference, XLA's dot, computes all 64 rows, the kernel the real ones; GFLOP/s count the
real rows). Each is timed as a chain of calls over copies of the
weight (at least 128 MB of them at M = 1, so no call finds its weight in a cache), each
call waiting on the one before as a model's layers do; the time is per call.

Mixture-of-experts layer (the experts of one layer: route given, gate/up/down SwiGLU, the
weighted sum) at Qwen3-30B-A3B's shapes (128 experts of [2048, 768], top-8; on an
accelerator or with --full also Mixtral-8x7B's, 8 experts of [4096, 14336], top-2), for
M in {1, 16, 64} tokens (M in {1, 16} on CPU unless --full), bf16 (and f32 on CPU),
routed by a fixed random router: the dense-loop formulation (every expert computes every
token, weighted by zeros where not chosen; reads every expert once), XLA's ragged_dot
(the grouped matmul's reference) and the grouped matmul of pallas_kernels/grouped_matmul
(the platform's kernel; on a CPU its loop over the experts with tokens). Floor: the
weights of the distinct experts the batch chose, divided by the bandwidth.

Sampling: top-p 0.9's threshold per row (sampler.filter_cut) of random logits, 1 x
49152, 64 x 2048 and 64 x 49152: XLA's sort of every row against the CPU's native cut;
then a whole step's draw (sampler.sample) at 1 and 64 x 49152 and 256 x 2048, greedy,
temperature 0.7 and with top-p 0.9, and their ratios to greedy.

Token embedding lookups of Llama-3-8B's table (1, 64, 512 ids): the bf16 table against
the same table held int4 (groups of 32, zero points: an untied GGUF file's Q4_K
`token_embd`) by rows, and as a tied quantized LM head's columns (`--only embedding`).

Every row is timed for the reference (pure JAX) and for the platform's kernel ("tpu" on
TPU, "gpu" on GPU, "cpu" -- pallas_kernels/cpu, the native kernels -- on a CPU where they
build; --impl forces one, "none" times the reference only). On a CPU the quantized rows'
kernel is the native one (int8, int4; fp8 has none: "n/a (CPU)", as every kernel column
says when the native kernels are unavailable) on its values packed as the engine packs
them (quantized_matmul.pack_strips), timed as a chain of calls over copies of the weight
(at least 128 MB of them) like the dense rows. Attention and the other quantized-matmul
times are the median of --iters calls after a compile and three warm-up calls, each ended
by block_until_ready; chained times are the median of --iters chains divided by the
chain's length.

Floor: the bytes a row must move once (K and V of every context token, int8 scales
included; new K/V written; weight values, + scales when quantized) divided by the memory
bandwidth measured in the same run (offline_throughput.measure_bandwidth: a jitted sum
over 1 GiB). The script restarts itself once with malloc on transparent huge pages, as
the `jaxserve` command runs (jaxserve/huge_pages.py), so pages, weights and the probe sit
on memory like the engine's. "% of floor" is floor / time, so 100% means running at the
bandwidth ceiling as XLA measures it (a hand-written read loop can beat XLA's sum, so a
kernel can exceed 100%). Attention rows also show a compute floor (causal attention FLOPs / a
measured matmul rate) because prefill is bound by it, not by bandwidth; dense matmul rows
show % of floor at M = 1 (bandwidth-bound) and GFLOP/s above (compute-bound). Rows small
enough to stay in a cache (L2 on a GPU, L3 on a CPU) can exceed 100%. Inputs are random
(fixed seeds), page tables shuffled over a pool with spare pages. On a GPU the attention
rows also time two peers (JAX's Pallas GPU paged attention on the same pages, decode only;
torch's SDPA on the same K/V gathered contiguous, bf16), and the script says whether the
issue's targets are met: decode attention at 64 x 2048 >= 70% of the bandwidth floor,
every attention row ahead of its fastest peer (XLA's reference included), the int8 (W8A16)
kernel faster than the bf16 dot for M <= 16 and int4 (W4A16) faster than int8; on
a CPU, the CPU kernels' targets: decode attention >= 40% of the floor, dense M = 1 >= 80%
of it (f32 and bf16), bf16 M = 512 >= 600 GFLOP/s and faster than XLA at M = 64 and 512.

    python benchmarks/kernel_speed.py [--full] [--impl tpu|gpu|cpu|none] [--iters N]
                                 [--only attention,quantized,dense,moe,sampling,embedding]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from offline_throughput import measure_bandwidth, measure_matmul
from jaxserve.engine.sampler import SamplingArrays, sample, top_k_top_p_by_sort
from jaxserve.huge_pages import restart_with_huge_pages
from jaxserve.models.layers import quantized_embedding, quantized_rows
from jaxserve.models.moe import grouped_glu
from pallas_kernels.grouped_matmul import dequantize as grouped_dequantize
from pallas_kernels.grouped_matmul import quantize as grouped_quantize
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from pallas_kernels import cpu as native
from pallas_kernels.matmul import matmul
from pallas_kernels.platform import GPU_PLATFORMS
from pallas_kernels.quantized_matmul import (
    choose_impl, pack_strips, quantize, quantized_matmul)
from pallas_kernels.quantized_matmul import cpu as quantized_cpu
from pallas_kernels.ragged_paged_attention import quantize_kv, ragged_paged_attention, write_kv

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B, per layer
HIDDEN, INTERMEDIATE = 4096, 14336
INT4_GROUP = 128
SEED = 0
DECODE_TARGET = 0.70  # GPU: decode attention at 64 x 2048, fraction of the bandwidth floor
INT8_TARGET_MAX_M = 16  # GPU: int8 W8A16 must beat the bf16 dot up to this M
NA_CPU = "n/a (CPU)"
WARMUP_CALLS = 3
CALLS_PER_SAMPLE = 10  # accelerators: calls per timed sample (median_ms)
SMOLLM2_HIDDEN, SMOLLM2_KV, SMOLLM2_MLP, SMOLLM2_VOCAB = 576, 192, 1536, 49152
# (real rows, bucket rows): the reference (XLA's dot) computes every row of the bucket, the
# kernel only the real ones, as in an engine step with a half-full bucket.
DENSE_ROWS = ((1, 1), (32, 64), (64, 64), (512, 512))
DENSE_CHAIN_BYTES = 128e6  # M = 1: weights per chain, beyond the last-level cache
CPU_DECODE_TARGET = 0.40  # CPU: decode attention, fraction of the bandwidth floor
CPU_GEMV_TARGET = 0.80  # CPU: dense matmul at M = 1, fraction of the bandwidth floor
CPU_BF16_GFLOPS_TARGET = 600.0  # CPU: bf16 dense matmul at M = 512
# (name, experts, hidden, expert intermediate, top-k) of one MoE layer.
MOE_LAYERS = [("Qwen3-30B-A3B", 128, 2048, 768, 8), ("Mixtral-8x7B", 8, 4096, 14336, 2)]
SECTIONS = ("attention", "quantized", "dense", "moe", "sampling", "embedding")


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """A ragged batch: sequence s has q_lens[s] new tokens at the end of kv_lens[s]."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    kv_dtype: str = "bfloat16"
    target: bool = False  # the decode shape, checked against DECODE_TARGET on GPU

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def kv_bytes(self, tokens: int) -> int:
        """K and V of `tokens` tokens, all KV heads; a quantized cache adds a float32 scale
        per token, head and K/V."""
        per_head = HEAD_DIM * jnp.dtype(self.kv_dtype).itemsize
        if self.kv_dtype != "bfloat16":
            per_head += 4
        return tokens * NUM_KV_HEADS * 2 * per_head

    def kv_bytes_read(self) -> int:
        return self.kv_bytes(sum(self.kv_lens))

    def kv_bytes_written(self) -> int:
        return self.kv_bytes(self.num_tokens)

    def flops(self) -> int:
        """Causal attention: a query at position p scores and sums p + 1 keys (2 FLOPs per
        multiply-add, for QK and for PV), per query head and head_dim element."""
        visible = sum(sum(range(kv - q + 1, kv + 1)) for q, kv in zip(self.q_lens, self.kv_lens))
        return 4 * visible * NUM_Q_HEADS * HEAD_DIM


@dataclasses.dataclass
class Row:
    """One table row; None times mean 'not run', with `kernel_note` saying why."""

    name: str
    bytes_moved: int
    floor_ms: float
    ref_ms: float
    kernel_ms: float | None = None
    kernel_note: str = ""
    compute_floor_ms: float | None = None
    max_diff: float | None = None
    peer_ms: float | None = None  # matmul rows: the bf16 dot of the same shape
    # attention rows on a GPU: JAX's Pallas paged attention (decode) and torch's SDPA on
    # the same K/V gathered contiguous (no paging), or why not
    peers: dict[str, float | str] = dataclasses.field(default_factory=dict)
    flops: int | None = None  # dense matmul rows


def attention_cases(on_cpu: bool, full: bool) -> list[AttentionCase]:
    batch, context = (8, 1024) if on_cpu and not full else (64, 2048)
    cases = [
        AttentionCase(f"decode {batch} x {context}", (1,) * batch, (context,) * batch,
                      target=(batch, context) == (64, 2048)),
        AttentionCase("decode 4 x 8192", (1,) * 4, (8192,) * 4),
        AttentionCase("prefill 1 x 512 at ctx 512", (512,), (512,)),
        AttentionCase("mixed 8 decodes @2048 + 256 chunk @512", (1,) * 8 + (256,), (2048,) * 8 + (512,)),
    ]
    int8 = [dataclasses.replace(c, name=c.name + " int8", kv_dtype="int8", target=False)
            for c in cases if c.name.startswith("decode")]
    return cases + int8


def page_size_for(kv_dtype: str, platform_name: str) -> int:
    """16 tokens; 32 for an 8-bit cache on TPU, whose page DMAs must be whole int8 tiles."""
    return 32 if platform_name == "tpu" and kv_dtype != "bfloat16" else 16


def page_table(kv_lens: Sequence[int], page_size: int, rng: np.random.Generator
               ) -> tuple[np.ndarray, int]:
    """Shuffled pages over a pool an eighth larger than needed, so tables have holes and
    neighbouring pages of a sequence are not neighbours in memory."""
    pages = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(pages) + sum(pages) // 8 + 1
    order = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((len(kv_lens), max(pages)), np.int32)
    start = 0
    for s, n in enumerate(pages):
        table[s, :n] = order[start:start + n]
        start += n
    return table, num_pages


def slot_mapping(case: AttentionCase, table: np.ndarray, page_size: int) -> np.ndarray:
    """Flat cache slot of each new token: the last q_lens[s] positions of sequence s."""
    slots = []
    for s, (q, kv) in enumerate(zip(case.q_lens, case.kv_lens)):
        pos = np.arange(kv - q, kv)
        slots.append(table[s, pos // page_size] * page_size + pos % page_size)
    return np.concatenate(slots).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("shape", "kv_dtype"))
def random_pages(key: jax.Array, shape: tuple[int, ...], kv_dtype: str) -> tuple[jax.Array, ...]:
    """(pages) for a bf16 cache, (values, scales) for a quantized one, drawn on device so
    a 0.5 GB pool does not go through the host."""
    if kv_dtype == "bfloat16":
        return (jax.random.normal(key, shape, jnp.bfloat16),)
    return quantize_kv(jax.random.normal(key, shape, jnp.float32), jnp.dtype(kv_dtype))


def build_attention_batch(case: AttentionCase, page_size: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    table, num_pages = page_table(case.kv_lens, page_size, rng)
    kq, kk, kv, knew = jax.random.split(jax.random.PRNGKey(seed), 4)
    shape = (NUM_KV_HEADS, num_pages, page_size, HEAD_DIM)
    k_pages, v_pages = random_pages(kk, shape, case.kv_dtype), random_pages(kv, shape, case.kv_dtype)
    new_kv = jax.random.normal(knew, (2, case.num_tokens, NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)
    return dict(
        q=jax.random.normal(kq, (case.num_tokens, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16),
        k_pages=k_pages[0], v_pages=v_pages[0],
        scales=(k_pages[1], v_pages[1]) if len(k_pages) > 1 else (),
        kv_lens=jnp.asarray(case.kv_lens, jnp.int32), page_indices=jnp.asarray(table),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(case.q_lens)]), jnp.int32),
        num_seqs=jnp.int32(len(case.q_lens)),
        new_k=new_kv[0], new_v=new_kv[1],
        slots=jnp.asarray(slot_mapping(case, table, page_size)))


def median_ms(fn: Callable[[], object], iters: int) -> float:
    """Median wall time of fn() after a compile call and WARMUP_CALLS more (the first
    calls after a compile run slower on a CPU: caches, page tables, idle threads). On an
    accelerator each sample is CALLS_PER_SAMPLE calls dispatched back to back, divided,
    so the host's dispatch of a call (tens of microseconds) overlaps the device's work
    as in a model's step instead of adding to a 0.2 ms kernel."""
    per_sample = 1 if jax.default_backend() == "cpu" else CALLS_PER_SAMPLE
    for _ in range(1 + WARMUP_CALLS):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(per_sample):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / per_sample)
    return 1e3 * statistics.median(times)


def attention_fn(impl: str) -> Callable:
    return jax.jit(functools.partial(ragged_paged_attention, impl=impl,
                                     sm_scale=1.0 / math.sqrt(HEAD_DIM)))


def attention_args(batch: dict) -> tuple[tuple, dict]:
    """ragged_paged_attention's positional operands and scale keywords for a batch."""
    return ((batch["q"], batch["k_pages"], batch["v_pages"], batch["kv_lens"],
             batch["page_indices"], batch["cu_q_lens"], batch["num_seqs"]),
            dict(zip(("k_scales", "v_scales"), batch["scales"])))


def time_attention(batch: dict, impl: str, iters: int) -> tuple[float, jax.Array]:
    fn = attention_fn(impl)
    args, scales = attention_args(batch)
    call = lambda: fn(*args, **scales)  # noqa: E731
    return median_ms(call, iters), call()


def time_write(batch: dict, iters: int) -> float:
    """The engine donates the cache to the step, so the scatter updates it in place; without
    donation XLA would copy the whole pool and time that instead. Consumes the batch's pages."""
    step = jax.jit(lambda cache, k, v, slots: write_kv(cache[0], cache[1], k, v, slots, *cache[2:]),
                   donate_argnums=0)
    cache = (batch.pop("k_pages"), batch.pop("v_pages"), *batch.pop("scales"))
    new = (batch["new_k"], batch["new_v"], batch["slots"])
    for _ in range(2):  # compile, warm up
        cache = jax.block_until_ready(step(cache, *new))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        cache = jax.block_until_ready(step(cache, *new))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def attention_rows(cases: list[AttentionCase], impl: str | None, platform_name: str,
                   bandwidth: float, flops_rate: float, iters: int) -> list[Row]:
    rows = []
    for i, case in enumerate(cases):
        batch = build_attention_batch(case, page_size_for(case.kv_dtype, platform_name), SEED + i)
        ref_ms, ref_out = time_attention(batch, "reference", iters)
        row = Row(case.name, case.kv_bytes_read(), 1e3 * case.kv_bytes_read() / bandwidth, ref_ms,
                  compute_floor_ms=1e3 * case.flops() / flops_rate, kernel_note=NA_CPU)
        if impl is not None:
            row.kernel_ms, out = time_attention(batch, impl, iters)
            row.max_diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32))))
        del ref_out
        if platform_name in GPU_PLATFORMS:
            row.peers = gpu_attention_peers(case, batch, iters)
        written = case.kv_bytes_written()
        rows.append(row)
        rows.append(Row(f"write_kv {case.num_tokens} tokens ({case.name})", written,
                        1e3 * written / bandwidth, time_write(batch, iters),
                        kernel_note="XLA scatter on every backend"))
        del batch
    return rows


ATTENTION_PEERS = ("jax pallas", "torch sdpa")


def gpu_attention_peers(case: AttentionCase, batch: dict, iters: int) -> dict[str, float | str]:
    """Milliseconds (or why not) of the attention a GPU user could run instead: JAX's
    Pallas GPU paged attention (jax.experimental.pallas.ops.gpu; decode only, one query
    per sequence) on the same pages and table, and torch's scaled_dot_product_attention on
    the same K/V gathered into contiguous [batch, kv heads, context, head_dim] tensors
    (bf16, equal lengths; it reads no page table, so it is the unpaged bound)."""
    out: dict[str, float | str] = {}
    if any(q != 1 for q in case.q_lens):
        out["jax pallas"] = "decode only"
    else:
        try:
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

            scales = dict(zip(("k_scales_pages", "v_scales_pages"), batch["scales"]))
            fn = jax.jit(lambda q, k, v, t, n: paged_attention(
                q * HEAD_DIM ** -0.5, k, v, t, n, **scales))
            args = (batch["q"], batch["k_pages"], batch["v_pages"], batch["page_indices"],
                    batch["kv_lens"])
            out["jax pallas"] = median_ms(lambda: fn(*args), iters)
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            out["jax pallas"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    if case.kv_dtype != "bfloat16" or len(set(case.kv_lens)) > 1 or len(set(case.q_lens)) > 1:
        out["torch sdpa"] = "bf16, equal lengths only"
        return out
    try:
        import torch

        batch_size, new, context = len(case.q_lens), case.q_lens[0], case.kv_lens[0]
        tokens = jnp.arange(context)
        table, page_size = batch["page_indices"], batch["k_pages"].shape[2]
        gather = jax.jit(lambda pages: pages[:, table[:, tokens // page_size],
                                             tokens % page_size].transpose(1, 0, 2, 3))
        k, v = (torch.from_dlpack(gather(batch[n])) for n in ("k_pages", "v_pages"))
        q = torch.from_dlpack(batch["q"].reshape(batch_size, new, NUM_Q_HEADS, HEAD_DIM)
                              .transpose(0, 2, 1, 3))
        call = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k, v, is_causal=new > 1, enable_gqa=True)
        for _ in range(1 + WARMUP_CALLS):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            for _ in range(CALLS_PER_SAMPLE):
                call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / CALLS_PER_SAMPLE)
        out["torch sdpa"] = statistics.median(times)
    except Exception as e:
        out["torch sdpa"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    return out


def matmul_shapes(on_cpu: bool, full: bool) -> tuple[list[tuple[int, int]], list[int]]:
    """(K, N) weight shapes and the M values to run: the MLP's up/gate and down projections."""
    if on_cpu and not full:
        return [(HIDDEN, INTERMEDIATE)], [1, 16]
    return [(HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)], [1, 16, 64]


def weight_variants(k: int, n: int, seed: int) -> dict[str, tuple[jax.Array, ...]]:
    """The bf16 weight and its int8 / int4 / fp8 quantizations of the same random matrix."""
    w = jax.random.normal(jax.random.PRNGKey(seed), (k, n), jnp.float32) / math.sqrt(k)
    variants = {"bf16": (w.astype(jnp.bfloat16),)}
    for kind in ("int8", "int4", "fp8", "fp4"):
        variants[kind] = quantize(w, kind, group_size=INT4_GROUP if kind == "int4" else None)
    return variants


def matmul_kernel_note(kind: str, impl: str | None) -> str:
    """Why a quantized row has no kernel timing, or "" when the kernel runs."""
    if impl is None or (impl == "cpu" and kind not in quantized_cpu.KINDS):
        return NA_CPU
    if impl == "cpu":
        return ""
    if choose_impl(kind, INT4_GROUP) != impl:
        return "n/a (no kernel for this format here)"
    return ""


def matmul_rows(on_cpu: bool, full: bool, impl: str | None, bandwidth: float, iters: int) -> list[Row]:
    shapes, ms = matmul_shapes(on_cpu, full)
    dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    rows = []
    for s, (k, n) in enumerate(shapes):
        weights = weight_variants(k, n, SEED + s)
        for m in ms:
            x = jax.random.normal(jax.random.PRNGKey(SEED + 100 + m), (m, k), jnp.bfloat16)
            peer_ms = median_ms(lambda: dot(x, weights["bf16"][0]), iters)  # noqa: B023
            nbytes = k * n * 2
            rows.append(Row(f"bf16 dot M={m} [{k}x{n}]", nbytes, 1e3 * nbytes / bandwidth, peer_ms,
                            kernel_note="(the peer)", peer_ms=peer_ms))
            for kind in ("int8", "int4", "fp8", "fp4"):
                rows.append(quantized_row(kind, x, weights[kind], impl, bandwidth, iters, peer_ms))
            del x
        del weights
    return rows


def quantized_row(kind: str, x: jax.Array, weight: tuple[jax.Array, jax.Array], impl: str | None,
                  bandwidth: float, iters: int, peer_ms: float) -> Row:
    values, scales = weight
    k, n = x.shape[1], values.shape[1]
    nbytes = values.nbytes + scales.nbytes
    fn = lambda i: jax.jit(functools.partial(quantized_matmul, kind=kind, impl=i))  # noqa: E731
    ref = fn("reference")
    row = Row(f"{kind} M={x.shape[0]} [{k}x{n}]", nbytes, 1e3 * nbytes / bandwidth,
              median_ms(lambda: ref(x, values, scales), iters), peer_ms=peer_ms,
              kernel_note=matmul_kernel_note(kind, impl))
    if row.kernel_note:
        return row
    if impl == "cpu":
        row.kernel_ms, out = time_packed_chain(kind, x, values, scales, iters)
    else:
        kernel = fn(impl)
        row.kernel_ms = median_ms(lambda: kernel(x, values, scales), iters)
        out = kernel(x, values, scales)
    diff = out.astype(jnp.float32) - ref(x, values, scales).astype(jnp.float32)
    row.max_diff = float(jnp.max(jnp.abs(diff)))
    return row


def time_packed_chain(kind: str, x: jax.Array, values: jax.Array, scales: jax.Array,
                      iters: int) -> tuple[float, jax.Array]:
    """The native CPU kernel on packed values, as the engine runs it: (ms per call in a
    chain over copies of the weight, at least DENSE_CHAIN_BYTES of them, each call
    waiting on the one before; the first call's result)."""
    packed = pack_strips(values)
    copies = max(2, math.ceil(DENSE_CHAIN_BYTES / (values.nbytes + scales.nbytes)))
    weights = [(jnp.array(packed, copy=True), jnp.array(scales, copy=True))
               for _ in range(copies)]

    @jax.jit
    def chain(x, weights):
        out = []
        for v, s in weights:
            y = quantized_matmul(x, v, s, kind=kind, impl="cpu", packed=True)
            x, y = jax.lax.optimization_barrier((x, y))
            out.append(y)
        return out

    ms = median_ms(lambda: chain(x, weights), iters) / copies
    return ms, chain(x, weights[:1])[0]


def moe_cases(on_cpu: bool, full: bool) -> list[tuple[tuple, int, str]]:
    """(layer, tokens, dtype) of the MoE rows."""
    layers = MOE_LAYERS[:1] if on_cpu and not full else MOE_LAYERS
    tokens = (1, 16) if on_cpu and not full else (1, 16, 64)
    dtypes = ("float32", "bfloat16") if on_cpu else ("bfloat16",)
    return [(layer, m, dtype) for layer in layers for dtype in dtypes for m in tokens]


def dense_loop_experts(x, weights, chosen, gate, up, down):
    """Every expert on every token, weighted by the router (zero where not chosen): the
    formulation a grouped matmul replaces. Reads each expert's weights once."""
    num_experts = gate.shape[0]
    dense_weights = jnp.zeros((x.shape[0], num_experts), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], chosen].add(weights.astype(jnp.float32))

    def one(e, acc):
        h = jax.nn.silu(x @ gate[e]) * (x @ up[e])
        return acc + dense_weights[:, e, None] * (h @ down[e]).astype(jnp.float32)

    out = jax.lax.fori_loop(0, num_experts, one, jnp.zeros(x.shape, jnp.float32))
    return out.astype(x.dtype)


# The experts' stacks: float, int4 in groups of 32 with zero points (a GGUF file's Q4_K or
# an AWQ checkpoint's experts, kept as stored), and fp4 (an MXFP4 checkpoint's: gpt-oss's).
MOE_FORMATS = (None, ("int4", 32, True), ("fp4", 32, False))


def moe_rows(on_cpu: bool, full: bool, impl: str | None, bandwidth: float, iters: int) -> list[Row]:
    """Dense loop (ref_ms; of a quantized stack: on its dequantized weights), ragged_dot
    (peer_ms) and the grouped matmul (kernel_ms)."""
    grouped = impl if impl in ("tpu", "gpu") else "cpu"
    rows = []
    for ((name, num_experts, hidden, inter, top_k), m, dtype), fmt in itertools.product(
            moe_cases(on_cpu, full), MOE_FORMATS):
        keys = jax.random.split(jax.random.PRNGKey(SEED + m), 5)
        scale = 1 / math.sqrt(hidden)
        gate, up = (jax.random.normal(k, (num_experts, hidden, inter), dtype) * scale
                    for k in keys[:2])
        down = jax.random.normal(keys[2], (num_experts, inter, hidden), dtype) / math.sqrt(inter)
        x = jax.random.normal(keys[3], (m, hidden), dtype)
        probs = jax.nn.softmax(jax.random.normal(keys[4], (m, num_experts)), axis=-1)
        weights, chosen = jax.lax.top_k(probs, top_k)
        weights = (weights / weights.sum(-1, keepdims=True)).astype(dtype)
        stacks = (gate, None, up, None, down, None)
        label, per_weight = dtype, jnp.dtype(dtype).itemsize
        if fmt is not None:
            kind, group, zero_points = fmt
            stacks = sum((grouped_quantize(w, kind, group, zero_points=zero_points)
                          for w in (gate, up, down)), ())
            gate, up, down = (grouped_dequantize(*stacks[i:i + 2], kind, dtype)
                              for i in (0, 2, 4))
            label = f"{dtype}, {kind} g{group}{' zp' if zero_points else ''} experts"
            scale_bytes = 2 if kind == "fp4" else 4  # bf16 / float32 scales (and zero points)
            per_weight = ((0.5 if kind in ("int4", "fp4") else 1)
                          + scale_bytes * (2 if zero_points else 1) / group)
        loop = jax.jit(dense_loop_experts)
        variants = {i: jax.jit(functools.partial(grouped_glu, impl=i))
                    for i in ("reference", grouped)}
        active = len(np.unique(np.asarray(chosen)))
        nbytes = int(active * 3 * hidden * inter * per_weight)
        row = Row(f"{name} M={m} {label}", nbytes, 1e3 * nbytes / bandwidth,
                  median_ms(lambda: loop(x, weights, chosen, gate, up, down), iters),  # noqa: B023
                  peer_ms=median_ms(lambda: variants["reference"](x, weights, chosen, stacks),  # noqa: B023
                                    iters),
                  kernel_note=f"{grouped}: {active} experts active")
        row.kernel_ms = median_ms(lambda: variants[grouped](x, weights, chosen, stacks), iters)  # noqa: B023
        diff = (variants[grouped](x, weights, chosen, stacks).astype(jnp.float32)
                - loop(x, weights, chosen, gate, up, down).astype(jnp.float32))
        row.max_diff = float(jnp.max(jnp.abs(diff)))
        rows.append(row)
    return rows


def moe_table(rows: list[Row]) -> str:
    header = ["row", "grouped impl, active experts", "active MB", "bw floor ms", "dense loop ms",
              "ragged_dot ms", "grouped ms", "grouped % floor", "grouped vs dense loop",
              "grouped vs ragged_dot", "max abs diff vs loop"]
    body = [[r.name, r.kernel_note, f"{r.bytes_moved / 1e6:.1f}", f"{r.floor_ms:.3f}",
             f"{r.ref_ms:.3f}", f"{r.peer_ms:.3f}", f"{r.kernel_ms:.3f}",
             pct(r.floor_ms, r.kernel_ms), f"{r.ref_ms / r.kernel_ms:.2f}x",
             f"{r.peer_ms / r.kernel_ms:.2f}x", f"{r.max_diff:.2g}"] for r in rows]
    return markdown(header, body)


def sampling_rows(impl: str | None, bandwidth: float, iters: int) -> list[Row]:
    """Top-p 0.9's threshold per row (the sampler's filter_logits) of random normal logits
    at temperature 0.7 (a flat row: most of the vocabulary in the nucleus, the kernel's
    worst case), [rows, vocab] for 1 and 64 rows of smollm2-135m's 49152 and 64 of 2048,
    and with top-k 50 too for 64 x 49152: XLA's sort of every row (ref_ms) and the CPU's
    native cut (kernel_ms, no sort)."""
    rows = []
    for r, v, k in ((1, SMOLLM2_VOCAB, 0), (64, 2048, 0), (64, SMOLLM2_VOCAB, 0),
                    (64, SMOLLM2_VOCAB, 50)):
        logits = jax.random.normal(jax.random.PRNGKey(SEED + r + v), (r, v))
        args = (logits, jnp.full(r, 0.7, jnp.float32), jnp.full(r, k, jnp.int32),
                jnp.full(r, 0.9, jnp.float32))  # logits, temperature, top_k, top_p
        ref = jax.jit(lambda x, temp, k, p: top_k_top_p_by_sort(x / temp[:, None], k, p))
        nbytes = logits.size * 4
        name = f"top-p 0.9 cut {r} x {v}" if k == 0 else f"top-k {k}, top-p 0.9 cut {r} x {v}"
        row = Row(name, nbytes, 1e3 * nbytes / bandwidth,
                  median_ms(lambda: ref(*args), iters))  # noqa: B023
        if impl == "cpu":
            call = jax.jit(jax.ffi.ffi_call("jaxserve_top_k_top_p_cut",
                                            jax.ShapeDtypeStruct((r,), jnp.float32)))
            row.kernel_ms = median_ms(lambda: call(*args), iters)  # noqa: B023
            row.max_diff = float(jnp.abs(call(*args) - ref(*args)).max())
        else:
            row.kernel_note = "n/a (a CPU kernel)" if impl else "reference only"
        rows.append(row)
    return rows


def embedding_rows(on_cpu: bool, iters: int) -> list[tuple[str, float, float, float]]:
    """Token lookups of Llama-3-8B's embedding table [128256, 4096] (T random ids; 1, 64
    and 512 tokens): (T, ms from the bf16 table, ms from the table held int4 in groups of
    32 with zero points by rows (an untied GGUF file's Q4_K `token_embd`,
    layers.quantized_rows), ms from the same values held as a tied LM head's columns
    (layers.quantized_embedding; packed in the native kernel's strips on a CPU))."""
    vocab, hidden = 128256, 4096
    table = (0.02 * jax.random.normal(jax.random.PRNGKey(SEED), (vocab, hidden))).astype(
        jnp.bfloat16)
    values, scales = jax.jit(lambda t: quantize(t.T.astype(jnp.float32), "int4", 32,
                                                zero_points=True))(table)
    by_rows = (values.T, jnp.swapaxes(scales, -1, -2))
    columns = (pack_strips(values), pack_strips(scales)) if on_cpu else (values, scales)
    del values, scales
    floats = jax.jit(lambda t, ids: t[ids])
    rows = jax.jit(lambda v, s, ids: quantized_rows(nnx.Param(v), nnx.Param(s), ids,
                                                    jnp.bfloat16))
    head = jax.jit(lambda v, s, ids: quantized_embedding(nnx.Param(v, packed=on_cpu),
                                                         nnx.Param(s), ids, jnp.bfloat16))
    out = []
    for t in (1, 64, 512):
        ids = jnp.asarray(np.random.default_rng(SEED + t).integers(0, vocab, t), jnp.int32)
        want = table[ids]
        for fn, args in ((rows, by_rows), (head, columns)):  # the same rows, within int4's step
            assert float(jnp.abs(fn(*args, ids) - want).max()) < 0.02, fn
        out.append((str(t), median_ms(lambda: floats(table, ids), iters),  # noqa: B023
                    median_ms(lambda: rows(*by_rows, ids), iters),  # noqa: B023
                    median_ms(lambda: head(*columns, ids), iters)))  # noqa: B023
    return out


def embedding_table(rows: list[tuple[str, float, float, float]]) -> str:
    header = ["tokens looked up", "bf16 table ms (1051 MB)", "int4 g32 zp by rows ms (394 MB)",
              "int4 g32 zp, a tied head's columns ms"]
    return markdown(header, [[t, f"{f:.3f}", f"{r:.3f}", f"{c:.3f}"] for t, f, r, c in rows])


def draw_rows(iters: int) -> list[tuple[str, float, float, float, float]]:
    """A whole step's sampling (`sampler.sample`, jitted, as a step samples its logits)
    of random normal logits at 1 and 64 rows of smollm2-135m's vocabulary and 256 of the
    tiny models' 2048: (shape, greedy ms, temperature 0.7 ms, temperature 0.7 with top-p
    0.9 ms, and with top-k 50 too). Each row draws with its own seed."""
    out = []
    for r, v in ((1, SMOLLM2_VOCAB), (64, SMOLLM2_VOCAB), (256, 2048)):
        logits = jax.random.normal(jax.random.PRNGKey(SEED + r + v), (r, v)) * 3
        run = jax.jit(lambda x, p: sample(x, p, None, jnp.int32(r)).token_ids)  # noqa: B023
        times = []
        for temperature, top_p, top_k in ((0.0, 1.0, 0), (0.7, 1.0, 0), (0.7, 0.9, 0),
                                          (0.7, 0.9, 50)):
            p = plain_sampling(r, v, temperature=temperature, top_p=top_p, top_k=top_k)
            times.append(median_ms(lambda: run(logits, p), iters))  # noqa: B023
        out.append((f"{r} x {v}", *times))
    return out


def plain_sampling(rows: int, vocab: int, **params) -> SamplingArrays:
    """Sampling arrays of `rows` requests asking for nothing but `params` (each row its
    own seed; no logprobs, grammar, bias or penalties)."""
    full = lambda value, dtype, shape=(): np.full((rows, *shape), value, dtype)  # noqa: E731
    return SamplingArrays(
        temperature=full(params.get("temperature", 1.0), np.float32),
        top_k=full(params.get("top_k", 0), np.int32),
        top_p=full(params.get("top_p", 1.0), np.float32), min_p=full(0, np.float32),
        presence_penalty=full(0, np.float32), frequency_penalty=full(0, np.float32),
        repetition_penalty=full(1, np.float32), seed=np.arange(rows, dtype=np.uint32),
        output_index=full(0, np.int32), banned_ids=full(-1, np.int32, (MAX_STOP_TOKEN_IDS,)),
        logprobs=full(False, np.bool_), bias_ids=full(-1, np.int32, (MAX_LOGIT_BIAS,)),
        bias_values=full(0, np.float32, (MAX_LOGIT_BIAS,)),
        grammar_mask=full(-1, np.int32, (-(-vocab // 32),)), draft_index=full(-1, np.int32),
        shift_row=full(-1, np.int32), group_drafts=full(0, np.int32))


def draw_table(rows: list[tuple[str, float, float, float, float]]) -> str:
    header = ["rows x vocab", "greedy ms", "temperature 0.7 ms", "+ top-p 0.9 ms",
              "+ top-k 50 ms", "temperature / greedy", "top-p / greedy"]
    body = [[name, f"{g:.3f}", f"{t:.3f}", f"{tp:.3f}", f"{tk:.3f}", f"{t / g:.2f}x",
             f"{tp / g:.2f}x"] for name, g, t, tp, tk in rows]
    return markdown(header, body)


def sampling_table(rows: list[Row]) -> str:
    header = ["row", "logits MB", "bw floor ms", "sort ms", "kernel ms", "kernel speedup",
              "kernel % floor", "max abs diff"]
    body = [[r.name, f"{r.bytes_moved / 1e6:.2f}", f"{r.floor_ms:.4f}", f"{r.ref_ms:.3f}",
             *([f"{r.kernel_ms:.3f}", f"{r.ref_ms / r.kernel_ms:.1f}x",
                pct(r.floor_ms, r.kernel_ms), f"{r.max_diff:.2g}"]
               if r.kernel_ms is not None else [r.kernel_note, "", "", ""])] for r in rows]
    return markdown(header, body)


def dense_shapes() -> list[tuple[str, int, int]]:
    """(name, K, N) of smollm2-135m's matmuls, per layer, and its LM head; the weights are
    timed as [N, K], the layout the engine keeps them in on one CPU device."""
    h, kv, mlp, vocab = SMOLLM2_HIDDEN, SMOLLM2_KV, SMOLLM2_MLP, SMOLLM2_VOCAB
    return [("q/o", h, h), ("k/v", h, kv), ("gate/up", h, mlp), ("down", mlp, h),
            ("LM head (tied)", h, vocab)]


def dense_chain(impl: str) -> Callable:
    """All the weights in turn, each call waiting on the previous one's result (an
    optimization barrier over both, no arithmetic), as a model's layers do."""
    def chain(x, weights, num_rows):
        out = []
        for w in weights:
            y = matmul(x, w, num_rows, transpose_w=True, impl=impl)
            x, y = jax.lax.optimization_barrier((x, y))
            out.append(y)
        return out
    return jax.jit(chain)


def dense_rows(impl: str | None, bandwidth: float, iters: int) -> list[Row]:
    rows = []
    rng = np.random.default_rng(SEED)
    for dtype in (jnp.float32, jnp.bfloat16):
        for name, k, n in dense_shapes():
            nbytes = k * n * jnp.dtype(dtype).itemsize
            copies = max(2, math.ceil(DENSE_CHAIN_BYTES / nbytes))
            weights = [jnp.asarray(rng.standard_normal((n, k), np.float32) / math.sqrt(k), dtype)
                       for _ in range(copies)]
            for m, bucket in DENSE_ROWS:
                # Compute-bound rows need fewer copies: about 4 GFLOP per chain.
                count = copies if m == 1 else max(2, min(copies, math.ceil(4e9 / (2 * m * k * n))))
                x = jnp.asarray(rng.standard_normal((bucket, k), np.float32), dtype)
                shape_m = f"M={m}" if m == bucket else f"M={m} of {bucket}"
                label = f"{jnp.dtype(dtype).name} {name} {shape_m} [{k}x{n}^T]"
                ref_ms, ref_out = time_dense("reference", x, weights[:count], iters, m)
                row = Row(label, nbytes, 1e3 * nbytes / bandwidth, ref_ms, kernel_note=NA_CPU,
                          flops=2 * m * k * n)
                if impl == "cpu":
                    row.kernel_ms, out = time_dense("cpu", x, weights[:count], iters, m)
                    row.max_diff = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                                         - ref_out.astype(jnp.float32))))
                elif impl is not None:
                    row.kernel_note = f"n/a (the {impl} path is XLA's dot)"
                rows.append(row)
            del weights
    return rows


def time_dense(impl: str, x: jax.Array, weights: list[jax.Array], iters: int,
               num_rows: int) -> tuple[float, jax.Array]:
    """(ms per call, the first call's result)."""
    chain, rows = dense_chain(impl), jnp.int32(num_rows)
    ms = median_ms(lambda: chain(x, weights, rows), iters) / len(weights)
    return ms, chain(x, weights[:1], rows)[0]


def rate(row: Row, ms: float) -> str:
    """% of the bandwidth floor at M = 1, GFLOP/s above."""
    if " M=1 " in row.name:
        return pct(row.floor_ms, ms) + " floor"
    return f"{row.flops / ms / 1e6:.0f} GFLOP/s"


def dense_table(rows: list[Row]) -> str:
    header = ["row", "weight MB", "bw floor ms", "ref ms", "ref rate", "kernel ms", "kernel rate",
              "kernel speedup", "max abs diff"]
    body = []
    for r in rows:
        kernel = ([f"{r.kernel_ms:.3f}", rate(r, r.kernel_ms), f"{r.ref_ms / r.kernel_ms:.2f}x",
                   f"{r.max_diff:.2g}"] if r.kernel_ms is not None else [r.kernel_note, "", "", ""])
        body.append([r.name, f"{r.bytes_moved / 1e6:.2f}", f"{r.floor_ms:.4f}", f"{r.ref_ms:.4f}",
                     rate(r, r.ref_ms), *kernel])
    return markdown(header, body)


def cpu_targets(attention: list[Row], dense: list[Row], cases: list[AttentionCase]) -> list[str]:
    """The CPU kernels' targets, met or missed, for the rows that ran a kernel."""
    lines = []
    for case in cases:
        row = next(r for r in attention if r.name == case.name)
        if case.name.startswith("decode") and row.kernel_ms is not None:
            frac = row.floor_ms / row.kernel_ms
            verdict = "met" if frac >= CPU_DECODE_TARGET else "missed"
            lines.append(f"- attention {case.name}: {100 * frac:.0f}% of the bandwidth floor "
                         f"(target >= {100 * CPU_DECODE_TARGET:.0f}%): {verdict}")
    for r in dense:
        if r.kernel_ms is None:
            continue
        if " M=1 " in r.name:
            frac = r.floor_ms / r.kernel_ms
            verdict = "met" if frac >= CPU_GEMV_TARGET else "missed"
            lines.append(f"- {r.name}: {100 * frac:.0f}% of the bandwidth floor "
                         f"(target >= {100 * CPU_GEMV_TARGET:.0f}%): {verdict}")
        elif r.name.startswith("bfloat16"):
            gflops = r.flops / r.kernel_ms / 1e6
            ok = r.kernel_ms < r.ref_ms and (" M=512 " not in r.name
                                             or gflops >= CPU_BF16_GFLOPS_TARGET)
            goal = (f">= {CPU_BF16_GFLOPS_TARGET:.0f} GFLOP/s and " if " M=512 " in r.name else "")
            lines.append(f"- {r.name}: {gflops:.0f} GFLOP/s vs XLA {r.flops / r.ref_ms / 1e6:.0f} "
                         f"(target: {goal}faster than XLA): {'met' if ok else 'missed'}")
    return lines


def pct(floor_ms: float, ms: float | None) -> str:
    if ms is None:
        return ""
    value = 100 * floor_ms / ms
    return f"{value:.0f}%" if value >= 10 else f"{value:.2g}%"  # keep small rows readable


def gbps(nbytes: int, ms: float | None) -> str:
    return "" if ms is None else f"{nbytes / ms / 1e6:.3g}"


def markdown(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def attention_table(rows: list[Row]) -> str:
    header = ["row", "MB moved", "bw floor ms", "compute floor ms", "ref ms", "ref GB/s",
              "ref % floor", "kernel ms", "kernel GB/s", "kernel % floor", "kernel speedup",
              "max abs diff"]
    peers = [p for p in ATTENTION_PEERS if any(p in r.peers for r in rows)]
    header += [f"{p} ms" for p in peers]
    body = []
    for r in rows:
        kernel = ([f"{r.kernel_ms:.3f}", gbps(r.bytes_moved, r.kernel_ms), pct(r.floor_ms, r.kernel_ms),
                   f"{r.ref_ms / r.kernel_ms:.2f}x", f"{r.max_diff:.2g}"]
                  if r.kernel_ms is not None else [r.kernel_note, "", "", "", ""])
        compute = "" if r.compute_floor_ms is None else f"{r.compute_floor_ms:.3f}"
        body.append([r.name, f"{r.bytes_moved / 1e6:.3g}", f"{r.floor_ms:.3f}", compute,
                     f"{r.ref_ms:.3f}", gbps(r.bytes_moved, r.ref_ms), pct(r.floor_ms, r.ref_ms),
                     *kernel, *(peer_cell(r.peers.get(p, "")) for p in peers)])
    return markdown(header, body)


def peer_cell(value: float | str) -> str:
    return f"{value:.3f}" if isinstance(value, float) else value


def matmul_table(rows: list[Row]) -> str:
    header = ["row", "weight MB", "bw floor ms", "ref ms", "ref % floor", "ref vs bf16 dot",
              "kernel ms", "kernel % floor", "kernel vs bf16 dot", "max abs diff"]
    body = []
    for r in rows:
        kernel = ([f"{r.kernel_ms:.3f}", pct(r.floor_ms, r.kernel_ms), f"{r.peer_ms / r.kernel_ms:.2f}x",
                   f"{r.max_diff:.2g}"] if r.kernel_ms is not None else [r.kernel_note, "", "", ""])
        body.append([r.name, f"{r.bytes_moved / 1e6:.1f}", f"{r.floor_ms:.3f}", f"{r.ref_ms:.3f}",
                     pct(r.floor_ms, r.ref_ms), f"{r.peer_ms / r.ref_ms:.2f}x", *kernel])
    return markdown(header, body)


def gpu_targets(attention: list[Row], matmuls: list[Row], cases: list[AttentionCase]) -> list[str]:
    """The issue's GPU targets, met or missed, for the rows that ran a kernel."""
    lines = []
    for case in cases:
        row = next(r for r in attention if r.name == case.name)
        if case.target and row.kernel_ms is not None:
            frac = row.floor_ms / row.kernel_ms
            verdict = "met" if frac >= DECODE_TARGET else "missed"
            lines.append(f"- attention {case.name}: {100 * frac:.0f}% of the bandwidth "
                         f"floor (target >= {100 * DECODE_TARGET:.0f}%): {verdict}")
        if row.kernel_ms is not None:
            times = {"XLA (reference)": row.ref_ms,
                     **{p: t for p, t in row.peers.items() if isinstance(t, float)}}
            fastest = min(times, key=times.get)
            verdict = "met" if row.kernel_ms < times[fastest] else "missed"
            lines.append(f"- attention {case.name}: kernel {row.kernel_ms:.3f} ms, fastest peer "
                         f"{fastest} {times[fastest]:.3f} ms (target: ahead): {verdict}")
    by_name = {r.name: r for r in matmuls}
    for r in matmuls:
        m = int(r.name.split("M=")[1].split()[0])
        if m > INT8_TARGET_MAX_M or r.kernel_ms is None:
            continue
        if r.name.startswith("int8"):
            verdict = "met" if r.kernel_ms < r.peer_ms else "missed"
            lines.append(f"- int8 W8A16 {r.name}: {r.kernel_ms:.3f} ms vs bf16 dot "
                         f"{r.peer_ms:.3f} ms (target: faster): {verdict}")
        int8 = by_name.get(r.name.replace("int4", "int8", 1))
        if r.name.startswith("int4") and int8 is not None and int8.kernel_ms is not None:
            verdict = "met" if r.kernel_ms < int8.kernel_ms else "missed"
            lines.append(f"- int4 W4A16 {r.name}: {r.kernel_ms:.3f} ms vs int8 "
                         f"{int8.kernel_ms:.3f} ms (target: faster still): {verdict}")
    return lines


def machine() -> str:
    dev = jax.devices()[0]
    host = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            host = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    host = f"{host}, {os.cpu_count()} cores"
    if dev.platform == "cpu":
        return f"CPU: {host}"
    return f"{dev.device_kind} ({dev.platform}) x{jax.device_count()}, host {host}"


def kernel_impl(requested: str | None, platform_name: str) -> str | None:
    """The kernel to time, or None for the reference only. Forcing a kernel that cannot
    run here is a user error, reported before anything is timed."""
    if platform_name == "tpu":
        native_impl = "tpu"
    elif platform_name in GPU_PLATFORMS:
        native_impl = "gpu"
    else:
        native_impl = "cpu" if platform_name == "cpu" and native.available() else None
    if requested is None:
        return native_impl
    if requested == "none":
        return None
    if requested != native_impl:
        where = {"cpu": "a CPU where the native kernels build"}.get(requested, f"a {requested.upper()}")
        raise SystemExit(f"--impl {requested} needs {where}, but JAX's device here is "
                         f"{platform_name}: use --impl none (reference only) or run on {where}")
    return requested


def print_header(args: argparse.Namespace, impl: str | None, platform_name: str,
                 bandwidth: float, flops_rate: float, flops_dtype, flops_by: str, iters: int,
                 seconds: float) -> None:
    on_cpu = platform_name == "cpu"
    print(f"\n## kernels, {datetime.date.today().isoformat()}\n")
    print(f"- machine: {machine()}")
    cpu_note = ""
    if impl == "cpu":
        cpu_note = f" (native CPU kernels, {native.isa()} path)"
    elif on_cpu and native.unavailable_reason():
        cpu_note = f" — native CPU kernels unavailable: {native.unavailable_reason()}"
    print(f"- jax {jax.__version__}, backend {platform_name}, kernel impl: "
          f"{impl or 'none (reference only)'}{cpu_note}")
    print(f"- measured memory bandwidth: {bandwidth / 1e9:.1f} GB/s; matmul rate: "
          f"{flops_rate / 1e9:.1f} GFLOP/s ({jnp.dtype(flops_dtype).name}; the faster of "
          f"{flops_by} GFLOP/s)")
    print(f"- shapes: {'full' if args.full or not on_cpu else 'CPU default (reduced; --full for all)'}; "
          f"median of {iters} calls; total {seconds:.0f} s\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the full shape set on CPU too")
    ap.add_argument("--impl", choices=["tpu", "gpu", "cpu", "none"], default=None,
                    help="kernel to time beside the reference (default: the platform's)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per row (default 10 on CPU, 20 else)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)")
    args = ap.parse_args()
    # Malloc on transparent huge pages, as under the `jaxserve` command and in
    # offline_throughput.py (restarts this process once; jaxserve/huge_pages.py): K/V pages
    # and weights on 4 KiB pages miss the TLB every 4 KiB, which the engine does not pay.
    restart_with_huge_pages()
    sections = set(args.only.split(","))
    if not sections <= set(SECTIONS):
        raise SystemExit(f"--only takes {', '.join(SECTIONS)}; got {args.only!r}")

    platform_name = jax.devices()[0].platform
    on_cpu = platform_name == "cpu"
    impl = kernel_impl(args.impl, platform_name)
    iters = args.iters or (10 if on_cpu else 20)
    start = time.perf_counter()
    bandwidth = measure_bandwidth()
    # The reference computes attention in float32 (XLA:CPU's path, and the CPU kernel's); the
    # accelerator kernels use bf16 dots.
    flops_dtype = jnp.float32 if on_cpu else jnp.bfloat16
    flops_rate, flops_by = measure_matmul(flops_dtype, n=2048 if on_cpu else 8192)

    cases = attention_cases(on_cpu, args.full)
    attention = (attention_rows(cases, impl, platform_name, bandwidth, flops_rate, iters)
                 if "attention" in sections else [])
    matmuls = matmul_rows(on_cpu, args.full, impl, bandwidth, iters) if "quantized" in sections else []
    dense = dense_rows(impl, bandwidth, iters) if "dense" in sections else []
    moe = moe_rows(on_cpu, args.full, impl, bandwidth, iters) if "moe" in sections else []
    sampling = sampling_rows(impl, bandwidth, iters) if "sampling" in sections else []
    draws = draw_rows(iters) if "sampling" in sections else []
    lookups = embedding_rows(on_cpu, iters) if "embedding" in sections else []

    print_header(args, impl, platform_name, bandwidth, flops_rate, flops_dtype, flops_by, iters,
                 time.perf_counter() - start)
    for rows, title, table in (
            (attention, "ragged paged attention (Llama-3-8B layer: 32 q / 8 kv heads, "
                        "head_dim 128, bf16)", attention_table),
            (matmuls, "quantized matmul (bf16 activations)", matmul_table),
            (dense, "dense matmul (smollm2-135m shapes; time per call in a chain of dependent "
                    "calls)", dense_table),
            (moe, "mixture-of-experts layer (the experts of one layer, routing given)",
             moe_table),
            (sampling, "sampling: top-k / top-p thresholds (float32 logits)", sampling_table),
            (draws, "sampling: a whole step's draw (sampler.sample, float32 logits)",
             draw_table),
            (lookups, "token embedding lookups (Llama-3-8B's table, bf16 out)",
             embedding_table)):
        if rows:
            print(f"### {title}\n\n{table(rows)}\n")
    if impl == "cpu" and attention and dense:
        print("\n### CPU targets\n")
        print("\n".join(cpu_targets(attention, dense, cases)) or "- no kernel rows ran")
    if platform_name in GPU_PLATFORMS and attention and matmuls:
        print("\n### GPU targets\n")
        print("\n".join(gpu_targets(attention, matmuls, cases)) or "- no kernel rows ran")


if __name__ == "__main__":
    main()
