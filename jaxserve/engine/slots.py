"""KV slots on the device: where a position's K/V lives in its page table, and a data
shard's slot as an index into every shard's slots together."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def position_slots(page_indices: jax.Array, positions: jax.Array, page_size: int
                   ) -> jax.Array:
    """The KV slot of each row's position in its page table (`[N, pages]`, `[N]`); positions
    past the table read its last page (callers mask those writes)."""
    page = jnp.minimum(positions // page_size, page_indices.shape[1] - 1)
    return (jnp.take_along_axis(page_indices, page[:, None], 1)[:, 0] * page_size
            + positions % page_size)


def global_slots(slots: jax.Array, num_slots: int, data_shards: int) -> jax.Array:
    """Each token's KV slot (within its data shard's pool of `num_slots`) as an index into
    all shards' slots together; padding tokens' (out of their pool) are out of range."""
    shard = jnp.arange(slots.shape[0]) // (slots.shape[0] // data_shards)
    return jnp.where(slots < num_slots, shard * num_slots + slots, data_shards * num_slots)
