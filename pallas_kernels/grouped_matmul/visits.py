"""Which (group, row tile) pairs a grouped matmul visits: the plan every kernel shares.

Rows of x are sorted by group: group g holds rows `offsets[g]:offsets[g + 1]` (offsets is
the running sum of the group sizes, clipped to M). Cut the rows into tiles of `block_m`;
a group with rows touches the tiles from `offsets[g] // block_m` to
`(offsets[g + 1] - 1) // block_m`, and each (group, tile) pair is one visit: the tile's
rows times that group's weight, stored to the rows of the tile that are the group's.
An empty group has no visit. Visits run in group order, so the tiles they store to never
decrease: visits sharing a tile (a group boundary inside it) are consecutive.

There are at most `cdiv(M, block_m) + G - 1` visits (every group boundary inside a tile
adds one), a static bound; the `active` first of them do work and the rest repeat the
last active one (a kernel skips them, and on a TPU their blocks are the ones already
loaded, so they cost no DMA).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.tiling import round_up


class Visits(NamedTuple):
    offsets: jax.Array  # [G + 1] int32: group g's rows are offsets[g]:offsets[g + 1]
    group: jax.Array  # [V] int32: the group of each visit
    tile: jax.Array  # [V] int32: the row tile of each visit
    active: jax.Array  # [1] int32: how many leading visits do work


def num_visits(m: int, num_groups: int, block_m: int) -> int:
    """The static bound on visits: row tiles plus one per possible group boundary."""
    return round_up(m, block_m) // block_m + num_groups - 1


def plan_visits(group_sizes: jax.Array, m: int, block_m: int) -> Visits:
    """The visit plan for `group_sizes` (`[G]` int) over M rows in tiles of `block_m`."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    first = starts // block_m
    last = jnp.maximum(ends - 1, 0) // block_m
    count = jnp.where(ends > starts, last - first + 1, 0)
    seen = jnp.cumsum(count)  # visits of groups 0..g
    active = seen[-1]
    # Past the active visits, repeat the last one (or visit nothing real: group 0, tile 0).
    v = jnp.minimum(jnp.arange(num_visits(m, sizes.shape[0], block_m)),
                    jnp.maximum(active - 1, 0))
    group = jnp.minimum(jnp.searchsorted(seen, v, side="right"), sizes.shape[0] - 1)
    tile = jnp.where(active > 0, first[group] + v - (seen[group] - count[group]), 0)
    return Visits(offsets=jnp.concatenate([starts, ends[-1:]]), group=group.astype(jnp.int32),
                  tile=tile.astype(jnp.int32), active=active.reshape(1).astype(jnp.int32))


def zero_rows_outside_groups(out: jax.Array, offsets: jax.Array) -> jax.Array:
    """Rows past the last group belong to no group: zeros (as jax.lax.ragged_dot gives),
    whatever a kernel left in them."""
    rows = jnp.arange(out.shape[0])[:, None]
    return jnp.where(rows < offsets[-1], out, jnp.zeros((), out.dtype))
