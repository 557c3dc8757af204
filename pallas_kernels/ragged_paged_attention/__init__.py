"""Ragged paged attention: a Pallas kernel per accelerator beside the pure-JAX reference.

`ragged_paged_attention(...)` picks the Mosaic kernel (tpu.py) on TPU, the Pallas GPU
kernel (gpu.py) on NVIDIA GPUs and the reference (reference.py) elsewhere; `impl`
overrides the choice, and `interpret=True` runs a kernel on CPU (tests). Page layout and
work items: work_items.py.
"""

from __future__ import annotations

from pallas_kernels.platform import GPU_PLATFORMS, current_platform
from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.ragged_paged_attention.reference import quantize_kv, write_kv

IMPLS = ("reference", "tpu", "gpu")


def default_impl(platform: str | None = None) -> str:
    """The backend for a platform name (default: where a jitted call lands now)."""
    platform = platform or current_platform()
    if platform == "tpu":
        return "tpu"
    if platform in GPU_PLATFORMS:
        return "gpu"
    return "reference"


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           impl: str | None = None, interpret: bool = False, **kwargs):
    """See reference.ragged_paged_attention for the arguments; `impl` is one of IMPLS."""
    impl = impl or default_impl()
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "reference":
        return reference.ragged_paged_attention(*args, **kwargs)
    if impl == "tpu":
        from pallas_kernels.ragged_paged_attention import tpu
        return tpu.ragged_paged_attention(*args, interpret=interpret, **kwargs)
    if impl == "gpu":
        from pallas_kernels.ragged_paged_attention import gpu
        return gpu.ragged_paged_attention(*args, interpret=interpret, **kwargs)
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")


__all__ = ["IMPLS", "default_impl", "quantize_kv", "ragged_paged_attention", "write_kv"]
