"""A decoder layer's row-wise ops: RMSNorm (optionally after the residual add), gated
activations (SwiGLU's `silu(gate) * up`, GeGLU's `gelu_tanh(gate) * up`) and the rotary
embedding of q and k.

The references are pure JAX over every row of the bucket. On a CPU the native kernels
(`jaxserve_rms_norm`, `jaxserve_gated_act` in pallas_kernels/cpu/rows.h) compute only
the first `rows` rows (the batch's real tokens) and leave the rows past them unwritten,
as the native matmul does, in one call each: XLA:CPU makes an RMSNorm four or five small
programs and evaluates silu's exp over every padding row (a 32-token prompt in the 64-token bucket of
smollm2-135m spent 3.2 ms of its 39 ms in silu * up).

Rounding as the references: the norm rounds x * rsqrt(mean(x^2) + eps) to the input's
dtype and then its product with the weight (offset, Gemma: x * rsqrt(...) * (1 + w) in
float32, rounded once); the residual sum is rounded before the norm reads it; act(gate)
is computed in float32 and rounded before its product with up, as transformers does (the
reference's jax.nn.silu on bf16 also rounds the sigmoid before multiplying it by gate, so
it can be a unit or two of bf16 off both). The kernel's exp is a polynomial within about
1 ulp of float32 (tests/test_cpu_kernels.py checks both against float64). The rotary
embedding (`jaxserve_rope`) takes cos and sin from XLA, computed once a step for all
layers: fused into the rotation, XLA:CPU evaluated them for every head of every layer
(float32, 64 rows: 5.2 ms of a 132 ms step of smollm2-135m).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu as native
from pallas_kernels.platform import current_platform

IMPLS = ("reference", "cpu")
ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
NATIVE_ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float, offset: bool = False
                       ) -> jax.Array:
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face Llama does);
    with `offset` (Gemma), scaled by `1 + weight` in float32 and then cast."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def _native(impl: str | None, *arrays: jax.Array, ndim: int = 2) -> bool:
    if impl is None:
        return (current_platform() == "cpu" and native.available()
                and all(a.ndim == ndim and a.dtype in (jnp.float32, jnp.bfloat16)
                        for a in arrays))
    if impl not in IMPLS:
        raise ValueError(f"rows impl must be one of {IMPLS} or None, got {impl!r}")
    if impl == "cpu" and not native.available():
        raise RuntimeError(f"native CPU kernels unavailable: {native.unavailable_reason()}")
    return impl == "cpu"


def _rows(rows: jax.Array | int | None, m: int) -> jax.Array:
    return jnp.asarray(m if rows is None else rows, jnp.int32).reshape(())


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: bool = False, *,
             residual: jax.Array | None = None, rows: jax.Array | int | None = None,
             impl: str | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """RMSNorm of `x` `[T, hidden]`; with `residual`, of `s = x + residual` (in x's dtype),
    returning `(norm(s), s)`. `rows`: the real rows (the native kernel computes those and
    leaves the rows past them unwritten; the reference computes every row). `impl`: one of IMPLS, None
    for the native kernel on a CPU where it runs and the operands are 2-D f32/bf16."""
    operands = (x,) if residual is None else (x, residual)
    if not _native(impl, *operands):
        s = x if residual is None else x + residual
        y = rms_norm_reference(s, weight, eps, offset)
        return y if residual is None else (y, s)
    if any(a.shape != x.shape or a.dtype != x.dtype for a in operands) or weight.shape != x.shape[1:]:
        raise ValueError(f"rms_norm: x {x.shape} {x.dtype}, residual and weight "
                         f"{weight.shape} must match it")
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    call = jax.ffi.ffi_call("jaxserve_rms_norm", (out,) * len(operands))
    results = call(x, jnp.zeros((0,), x.dtype) if residual is None else residual,
                   weight.astype(x.dtype), _rows(rows, x.shape[0]),
                   eps=np.float32(eps), offset=bool(offset))
    return results[0] if residual is None else tuple(results)


def gated_activation(gate: jax.Array, up: jax.Array, act: str, *,
                     rows: jax.Array | int | None = None, impl: str | None = None) -> jax.Array:
    """`ACTIVATIONS[act](gate) * up`; `rows` and `impl` as for rms_norm."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    if not _native(impl, gate, up):
        return ACTIVATIONS[act](gate) * up
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gated_activation: gate {gate.shape} {gate.dtype} and up "
                         f"{up.shape} {up.dtype} must match")
    call = jax.ffi.ffi_call("jaxserve_gated_act", (jax.ShapeDtypeStruct(gate.shape, gate.dtype),))
    return call(gate, up, _rows(rows, gate.shape[0]), act=np.int64(NATIVE_ACTS[act]))[0]


def rope_freqs(positions: jax.Array, inv_freq: np.ndarray, sections: tuple[int, ...] = ()
               ) -> jax.Array:
    """The angles `[T, D/2]`: each position times each frequency; with M-RoPE `sections`
    (Qwen2.5-VL) `positions` is `[3, T]` and the i-th run of `sections[i]` frequencies
    turns by stream i (time, height, width)."""
    if sections:
        stream = np.repeat(np.arange(len(sections)), sections)  # each frequency's stream
        return positions.astype(jnp.float32).T[:, stream] * jnp.asarray(inv_freq)[None, :]
    return positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]


def rope_reference(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
                   sections: tuple[int, ...] = ()) -> jax.Array:
    """Rotate `x[T, H, D]` by position, in the 'rotate half' layout of HF checkpoints
    (M-RoPE with `sections`: `rope_freqs`)."""
    freqs = rope_freqs(positions, inv_freq, sections)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = jnp.cos(emb).astype(x.dtype)[:, None, :]
    sin = jnp.sin(emb).astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rope(q: jax.Array, k: jax.Array, positions: jax.Array, inv_freq: np.ndarray, *,
         rows: jax.Array | int | None = None, impl: str | None = None,
         sections: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """`rope_reference` of q `[T, Hq, D]` and of k `[T, Hk, D]`; `rows` and `impl` as for
    rms_norm (the native kernel takes 3-D f32/bf16 q and k of one dtype)."""
    takes = q.ndim == k.ndim == 3 and q.dtype == k.dtype and q.shape[2] % 2 == 0
    if not (_native(impl, q, k, ndim=3) and takes):
        if impl == "cpu":
            raise ValueError(f"rope: q {q.shape} {q.dtype} and k {k.shape} {k.dtype} must "
                             "be [T, heads, D] of one float dtype, D even")
        return (rope_reference(q, positions, inv_freq, sections),
                rope_reference(k, positions, inv_freq, sections))
    freqs = rope_freqs(positions, inv_freq, sections)
    call = jax.ffi.ffi_call("jaxserve_rope", (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                              jax.ShapeDtypeStruct(k.shape, k.dtype)))
    return tuple(call(q, k, jnp.cos(freqs), jnp.sin(freqs), _rows(rows, q.shape[0])))
