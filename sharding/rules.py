"""Logical axis names → mesh axes. A strategy is a table; model code never names mesh axes.

Logical names used by the model: vocab, embed, q_heads, kv_heads, head_dim, mlp for
parameters; residual (the residual stream's token axis), tokens and seqs for activations.
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
STRATEGIES = ("tp", "tp+sp")


def strategy_rules(name: str, mesh: Mesh, num_heads: int, num_kv_heads: int, vocab_size: int,
                   intermediate_size: int) -> ShardingRules:
    """The table of a named strategy for a model on a mesh.

    tp (Megatron): q/k/v and gate/up split by heads / mlp columns, o and down by rows (so
    each block ends in one all-reduce), embedding and logits split by vocabulary. KV heads
    are replicated when there are fewer of them than `model` devices (or they do not
    divide); the KV cache follows the kv_heads rule.
    tp+sp adds sequence parallelism: the residual stream between blocks is split over
    tokens on the same `model` axis.
    """
    if name not in STRATEGIES:
        raise ValueError(f"sharding strategy {name!r} is unknown; choose one of {STRATEGIES}")
    tp = mesh.shape.get("model", 1)
    if tp == 1:
        return ShardingRules(name)
    if num_heads % tp:
        raise ValueError(f"tensor parallelism over {tp} devices needs num_attention_heads "
                         f"({num_heads}) divisible by {tp}")
    if intermediate_size % tp:
        raise ValueError(f"tensor parallelism over {tp} devices needs intermediate_size "
                         f"({intermediate_size}) divisible by {tp}")
    table = [("q_heads", "model"), ("mlp", "model")]
    if num_kv_heads % tp == 0:
        table.append(("kv_heads", "model"))
    if vocab_size % tp == 0:
        table.append(("vocab", "model"))
    if name == "tp+sp":
        table.append(("residual", "model"))
    return ShardingRules(name, tuple(table))


def model_sharding(mesh: Mesh, strategy: str, cfg) -> "ShardingContext":
    """The sharding context of a model (a ModelConfig) on a mesh under a named strategy."""
    return ShardingContext(mesh, strategy_rules(strategy, mesh, cfg.num_heads, cfg.num_kv_heads,
                                                cfg.vocab_size, cfg.intermediate_size))


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
