"""LoRA deltas of a mixed batch: `y[t] = x[t] · A[s(t)] · B[s(t)]` for every token t, whose
sequence's adapter sits in slot s(t) of the stacks (slot 0: no adapter, a zero delta).

`A` is a stack `[G, in, r]` and `B` `[G, r, out]` (slot s at index s - 1; ranks below r
padded with zeros, the adapter's scale folded into B). The batch's tokens are sorted by
slot once per step (`plan`, tokens without an adapter last), and each projection is two
grouped matmuls over them (pallas_kernels/grouped_matmul: the expert kernels, "tpu" /
"gpu" Pallas kernels, a plain-JAX loop on a CPU): the work follows the tokens that have
an adapter and the slots they use, not slots x batch; tokens past the groups (no
adapter, padding) cost nothing and come out zero. `reference.lora_delta` is the truth,
token by token. On one CPU device the model calls `cpu.lora_add` instead (a native
kernel: the deltas of every projection of an input added in place, in one call).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import grouped_matmul


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraPlan:
    """A step's tokens sorted by adapter slot: `order[i]` is the token at sorted place i,
    `inverse` its inverse, `group_sizes[g]` the tokens of slot g + 1."""

    order: jax.Array  # [T]
    inverse: jax.Array  # [T]
    group_sizes: jax.Array  # [G]


def plan(slots: jax.Array, num_slots: int) -> LoraPlan:
    """The plan of a step whose token t uses slot `slots[t]` (0: none) of `num_slots`."""
    key = jnp.where(slots > 0, slots, num_slots + 1)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    sizes = jnp.bincount(jnp.clip(slots, 0, num_slots), length=num_slots + 1)[1:]
    return LoraPlan(order, inverse, sizes.astype(jnp.int32))


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, p: LoraPlan,
               impl: str | None = None, interpret: bool = False) -> jax.Array:
    """`[T, in]` -> the `[T, out]` delta (x's dtype) for the plan's tokens; `impl` as
    grouped_matmul's (None: by platform)."""
    return lora_delta_sorted(x[p.order], a, b, p, impl, interpret)[p.inverse]


def lora_delta_sorted(xs: jax.Array, a: jax.Array, b: jax.Array, p: LoraPlan,
                      impl: str | None = None, interpret: bool = False) -> jax.Array:
    """`lora_delta` of tokens already in the plan's order, left in it (several projections
    of one input sort it once)."""
    h = grouped_matmul(xs, a.astype(xs.dtype), p.group_sizes, impl=impl, interpret=interpret)
    return grouped_matmul(h, b.astype(xs.dtype), p.group_sizes, impl=impl, interpret=interpret)


__all__ = ["LoraPlan", "plan", "lora_delta", "lora_delta_sorted"]
