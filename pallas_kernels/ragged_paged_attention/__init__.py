"""Ragged paged attention. Only the pure-JAX reference exists so far; it runs everywhere.

The Pallas TPU and GPU kernels (tpu.py, gpu.py) will dispatch from here by platform.
"""

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention, write_kv

__all__ = ["ragged_paged_attention", "write_kv"]
