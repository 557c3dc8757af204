"""Tile arithmetic the kernels share: powers of two (Triton), sublane tiles (TPU), padding."""

from __future__ import annotations

import jax.numpy as jnp


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def sublane_tile(dtype) -> int:
    """Rows of a TPU (sublane, 128) tile for this dtype: 8 for 32-bit, 16 for 16-bit, 32 for
    8-bit (narrower rows pack into one sublane)."""
    return 32 // jnp.dtype(dtype).itemsize
