"""Ragged paged attention: a Pallas kernel per accelerator beside the pure-JAX reference.

`ragged_paged_attention(...)` validates its inputs once (work_items.AttentionInputs), then
runs the Mosaic kernel (tpu.py) on TPU, the Pallas GPU kernel (gpu.py) on NVIDIA GPUs, the
native kernel (cpu.py, pallas_kernels/cpu) on CPUs where it builds, and the reference
(reference.py) elsewhere, or for inputs the native kernel does not take; `impl` overrides
the choice, and `interpret=True` runs a Pallas kernel on CPU (tests). Page layout and the
K/V writer: kv_cache.py. Work items: work_items.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import cpu as native
from pallas_kernels.platform import GPU_PLATFORMS, current_platform
from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.ragged_paged_attention.kv_cache import quantize_kv, write_kv, write_latent
from pallas_kernels.ragged_paged_attention.work_items import AttentionInputs

IMPLS = ("reference", "tpu", "gpu", "cpu")


def default_impl(platform: str | None = None) -> str:
    """The backend for a platform name (default: where a jitted call lands now)."""
    platform = platform or current_platform()
    if platform == "tpu":
        return "tpu"
    if platform in GPU_PLATFORMS:
        return "gpu"
    if platform == "cpu" and native.available():
        return "cpu"
    return "reference"


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, k_scales=None, v_scales=None,
                           tree_start=None, tree_mask=None, image_end=None, sinks=None,
                           impl: str | None = None, interpret: bool = False,
                           **block_sizes) -> jax.Array:
    """Causal attention of ragged queries over paged K/V (and, with `tree_start` and
    `tree_mask`, trees of speculative tokens whose nodes see their ancestors only; with
    `image_end`, images whose tokens see each other; with `sinks`, gpt-oss's attention
    sinks, a logit per query head in every row's softmax):
    `[T, num_q_heads, head_dim]` in q's dtype, zeros for padding queries.

    The reference and the GPU kernel read `image_end`; another `impl` runs as asked for a
    step without image tokens, and the reference for one with them (`lax.cond`: on a GPU
    a wait for the host, so the GPU kernel takes images itself).

    The arguments are described in work_items.AttentionInputs; `impl` is one of IMPLS (None:
    by platform). `block_sizes` are the backend's overrides (pages_per_block,
    queries_per_block; the kernels' own in their modules).
    """
    x = AttentionInputs.validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                 num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                                 soft_cap=soft_cap, k_scales=k_scales, v_scales=v_scales,
                                 tree_start=tree_start, tree_mask=tree_mask,
                                 image_end=image_end, sinks=sinks)
    if impl is None:
        impl = default_impl()
        if impl == "cpu":
            from pallas_kernels.ragged_paged_attention import cpu
            impl = "cpu" if cpu.supports(x) else "reference"
    if impl == "reference":
        return reference.ragged_paged_attention(x, **block_sizes)
    if x.image_end is not None and impl != "gpu":
        plain = dataclasses.replace(x, image_end=None)
        return jax.lax.cond(jnp.any(x.image_end >= 0),
                            lambda: reference.ragged_paged_attention(x),
                            lambda: _kernel(plain, impl, interpret, block_sizes))
    return _kernel(x, impl, interpret, block_sizes)


def _kernel(x: AttentionInputs, impl: str, interpret: bool, block_sizes: dict) -> jax.Array:
    if impl == "tpu":
        from pallas_kernels.ragged_paged_attention import tpu
        return tpu.ragged_paged_attention(x, interpret=interpret, **block_sizes)
    if impl == "gpu":
        from pallas_kernels.ragged_paged_attention import gpu
        return gpu.ragged_paged_attention(x, interpret=interpret, **block_sizes)
    if impl == "cpu":
        from pallas_kernels.ragged_paged_attention import cpu
        return cpu.ragged_paged_attention(x, **block_sizes)
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")


__all__ = ["IMPLS", "default_impl", "quantize_kv", "ragged_paged_attention", "write_kv",
           "write_latent"]
