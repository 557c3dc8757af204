"""Logical axis names → mesh axes. A strategy is a table; model code never names mesh axes.

Logical names used by the model: vocab, embed, q_heads, kv_heads, head_dim, mlp for
parameters; tokens and seqs for activations.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """A strategy: (logical axis, mesh axes) pairs; names not listed are replicated."""

    name: str = "replicated"
    table: tuple[tuple[str, MeshAxes], ...] = ()

    def spec(self, logical_axes: tuple[str | None, ...]) -> PartitionSpec:
        lookup = dict(self.table)
        return PartitionSpec(*(lookup.get(a) if a else None for a in logical_axes))


REPLICATED = ShardingRules()


@dataclasses.dataclass(frozen=True)
class ShardingContext:
    """What the model needs to place activations: the mesh and the strategy's rules."""

    mesh: Mesh
    rules: ShardingRules = REPLICATED

    def sharding(self, logical_axes: tuple[str | None, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(logical_axes))

    def constrain(self, x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
        """Pin an activation's layout; a no-op on one device."""
        if self.mesh.size == 1:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding(logical_axes))
