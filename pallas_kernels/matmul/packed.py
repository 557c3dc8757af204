"""Float weights packed for the native CPU matmul at load: `[N, K]` arrays whose 64-row
strips are stored as the kernel's panels, so that it reads them in place for every row
count instead of copying each strip into a panel on every call.

A strip holds output columns `[64 s, 64 s + 64)` (rows of the `[N, K]` weight), the same
`64 K` elements as before, reordered:
- bfloat16: `[K / 2][64][2]`: for each pair of k, the 64 columns' pairs `(w[c, 2p],
  w[c, 2p + 1])`, one 32-bit unit each (what one vdpbf16ps multiplies by a broadcast pair
  of x);
- float32: `[K][64]`: for each k, the 64 columns' values.
The array keeps its shape (`[N, K]`, or the model's out + in dims), so shapes, sharding
specs and reshapes are unchanged; only code that reads the values needs `unpack`.
Packable: N a multiple of 64 and, in bfloat16, K even.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu as native
from pallas_kernels.matmul.cpu import TUNED_ISA

STRIP = 64


def packable(n: int, k: int, dtype) -> bool:
    """Whether an `[N, K]` weight of `dtype` has the packed layout."""
    name = jnp.dtype(dtype).name
    return name in TUNED_ISA and n > 0 and k > 0 and n % STRIP == 0 and (
        name != "bfloat16" or k % 2 == 0)


def worth_packing(dtype) -> bool:
    """Whether this CPU runs the kernel's packed path for `dtype` (its AVX-512 panels;
    below them packed weights take the generic loops, so they stay unpacked)."""
    name, level = jnp.dtype(dtype).name, native.isa()
    return (name in TUNED_ISA and level is not None
            and native.ISA_LEVELS[level] >= native.ISA_LEVELS[TUNED_ISA[name]])


def _strips(n: int, k: int, bf16: bool) -> tuple[int, ...]:
    return (n // STRIP, STRIP, k // 2, 2) if bf16 else (n // STRIP, STRIP, k)


def pack(w: jax.Array) -> jax.Array:
    """`[N, K]` -> the same shape, each strip of 64 rows laid out as a panel."""
    n, k = w.shape
    if not packable(n, k, w.dtype):
        raise ValueError(f"cannot pack a {w.dtype}{list(w.shape)} weight: N must be a "
                         f"multiple of {STRIP} and, in bfloat16, K even")
    bf16 = w.dtype == jnp.bfloat16
    order = (0, 2, 1, 3) if bf16 else (0, 2, 1)
    return jnp.transpose(w.reshape(_strips(n, k, bf16)), order).reshape(n, k)


def take_rows(w: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows `ids` of the `[N, K]` weight that `w` packs (a packed tied embedding's
    lookup): `ids.shape + (K,)`."""
    n, k = w.shape
    strip, col = ids // STRIP, ids % STRIP
    if w.dtype == jnp.bfloat16:
        return w.reshape(n // STRIP, k // 2, STRIP, 2)[strip, :, col, :].reshape(ids.shape + (k,))
    return w.reshape(n // STRIP, k, STRIP)[strip, :, col]


def unpack(w: jax.Array) -> jax.Array:
    """The inverse of `pack`: the `[N, K]` weight."""
    n, k = w.shape
    bf16 = w.dtype == jnp.bfloat16
    shape = _strips(n, k, bf16)
    panels = (shape[0], shape[2], STRIP, 2) if bf16 else (shape[0], k, STRIP)
    order = (0, 2, 1, 3) if bf16 else (0, 2, 1)
    return jnp.transpose(w.reshape(panels), order).reshape(n, k)


__all__ = ["STRIP", "pack", "packable", "take_rows", "unpack", "worth_packing"]
