"""Logical axis names → mesh axes. A strategy is a table; model code never names mesh axes.

Logical names used by the model: vocab, embed, q_heads, cache_heads (KV heads, times
`kv_head_replicas`), head_dim, mlp, experts and expert_mlp (a mixture of experts' stacked
expert weights) for parameters; residual (the residual stream's token
axis), tokens and seqs for activations; cache_heads and pages for the KV cache.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.strategies import DATA, MODEL, STRATEGIES

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """A strategy: (logical axis, mesh axes) pairs; names not listed are replicated.

    `kv_head_replicas` > 1 when KV heads are fewer than `model` devices: each KV head is
    stored that many times, in the k/v projections and the KV cache (one copy per device
    that reads it), so both still split over `model` (transformer.Attention).
    """

    name: str = "replicated"
    table: tuple[tuple[str, MeshAxes], ...] = ()
    kv_head_replicas: int = 1

    def spec(self, logical_axes: tuple[str | None, ...]) -> PartitionSpec:
        lookup = dict(self.table)
        return PartitionSpec(*(lookup.get(a) if a else None for a in logical_axes))


REPLICATED = ShardingRules()


def _check_strategy(name: str, mesh: Mesh, num_experts: int) -> set[str]:
    """The strategy's parts (dp, tp, sp, ep), checked against the mesh and the model."""
    if name not in STRATEGIES:
        raise ValueError(f"sharding strategy {name!r} is unknown; choose one of {STRATEGIES}")
    parts = set(name.split("+"))
    dp, tp = mesh.shape.get(DATA, 1), mesh.shape.get(MODEL, 1)
    if dp > 1 and "dp" not in parts:
        raise ValueError(f"the mesh has data={dp} but strategy {name!r} has no data "
                         "parallelism; use dp, dp+tp or dp+tp+sp")
    if tp > 1 and not parts & {"tp", "ep"}:
        raise ValueError(f"the mesh has model={tp} but strategy {name!r} has no tensor or "
                         "expert parallelism; use tp, tp+sp, dp+tp, dp+tp+sp, or for a "
                         "mixture of experts ep, tp+ep, dp+ep, dp+tp+ep")
    if "ep" in parts and not num_experts:
        raise ValueError(f"strategy {name!r} splits experts, and this model has none; use "
                         "tp, tp+sp, dp+tp or dp+tp+sp")
    if "ep" in parts and num_experts % (dp * tp):
        raise ValueError(f"expert parallelism over {dp * tp} devices (every device of the "
                         f"mesh) needs num_experts ({num_experts}) divisible by {dp * tp}; "
                         "use a smaller mesh, or a strategy without ep (tp splits every "
                         "expert's MLP instead)")
    return parts


def strategy_rules(name: str, mesh: Mesh, num_heads: int, num_kv_heads: int, vocab_size: int,
                   intermediate_size: int, num_experts: int = 0,
                   expert_intermediate_size: int = 0,
                   shared_expert_intermediate_size: int = 0) -> ShardingRules:
    """The table of a named strategy for a model on a mesh.

    tp (Megatron): q/k/v and gate/up split by heads / mlp columns, o and down by rows (so
    each block ends in one all-reduce), embedding and logits split by vocabulary. With
    fewer KV heads than `model` devices, each device holds the one KV head its query
    heads read (k/v projections and cache, `kv_head_replicas` copies of each head); where
    the counts do not divide that way, k/v and the cache are replicated whole.
    sp adds sequence parallelism: the residual stream between blocks is split over tokens
    on the `model` axis (and `data`, under dp).
    dp: weights replicated over `data`; tokens, sequences and KV pages split over `data`
    (each data shard has its own page pool and its own requests).
    Mixtures of experts: under tp each expert's MLP splits by its intermediate columns /
    rows like the dense MLP; ep instead gives every device of the mesh whole experts
    (num_experts / (data x model) of them: under dp+ep and dp+tp+ep the data shards share
    one copy of the experts, as vLLM's data parallelism with expert parallelism and
    SGLang's DP attention do), and alone (ep, dp+ep) leaves the rest of the model
    replicated over `model`. A layer's experts end in one all-reduce over `model` of
    their partial sums, and with experts over `data` its data shards' tokens are
    all-gathered first and the sums reduce-scattered back (models/parallel.py:
    expert_parallel).
    """
    parts = _check_strategy(name, mesh, num_experts)
    dp, tp = mesh.shape.get(DATA, 1), mesh.shape.get(MODEL, 1)
    table: list[tuple[str, MeshAxes]] = []
    replicas = 1
    if dp > 1:
        table += [("tokens", DATA), ("seqs", DATA), ("pages", DATA), ("residual", DATA)]
    if "ep" in parts and dp * tp > 1:
        table.append(("experts", MODEL if dp == 1 else DATA if tp == 1 else (DATA, MODEL)))
    elif tp > 1 and num_experts and expert_intermediate_size % tp == 0:
        table.append(("expert_mlp", MODEL))
    if tp > 1 and "tp" in parts:
        for what, size in (("num_attention_heads", num_heads),
                           ("intermediate_size", intermediate_size),
                           ("shared_expert_intermediate_size", shared_expert_intermediate_size)):
            if size % tp:
                raise ValueError(f"tensor parallelism over {tp} devices needs {what} ({size}) "
                                 f"divisible by {tp}")
        table += [("q_heads", MODEL), ("mlp", MODEL)]
        if num_kv_heads % tp == 0:
            table.append(("cache_heads", MODEL))
        elif tp % num_kv_heads == 0:
            replicas = tp // num_kv_heads
            table.append(("cache_heads", MODEL))
        if vocab_size % tp == 0:
            table.append(("vocab", MODEL))
        if "sp" in parts:
            table = [(k, v) for k, v in table if k != "residual"]
            table.append(("residual", (DATA, MODEL) if dp > 1 else MODEL))
    return ShardingRules(name, tuple(table), replicas)


def model_sharding(mesh: Mesh, strategy: str, cfg) -> "ShardingContext":
    """The sharding context of a model (a ModelConfig) on a mesh under a named strategy."""
    return ShardingContext(mesh, strategy_rules(strategy, mesh, cfg.num_heads, cfg.num_kv_heads,
                                                cfg.vocab_size, cfg.intermediate_size,
                                                cfg.num_experts, cfg.moe_intermediate_size,
                                                cfg.shared_expert_intermediate_size))


@dataclasses.dataclass(frozen=True)
class ShardingContext:
    """What the model needs to place activations: the mesh and the strategy's rules."""

    mesh: Mesh
    rules: ShardingRules = REPLICATED

    @property
    def data_shards(self) -> int:
        """Data-parallel shards: each has its own requests and KV page pool."""
        return self.mesh.shape.get(DATA, 1) if dict(self.rules.table).get("pages") else 1

    def axis_size(self, axes: MeshAxes) -> int:
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        return math.prod(self.mesh.shape[a] for a in axes)

    def sharding(self, logical_axes: tuple[str | None, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(logical_axes))

    def param_spec(self, var) -> PartitionSpec:
        """A parameter's spec (an nnx variable, abstract or placed): its logical axes'
        mesh axes, except that a dimension they do not divide is whole on every device (a
        quantized weight's scale groups, fewer than the devices or not a multiple of
        them: Qwen2.5-14B's 108 groups of 128 rows in down_proj on 8)."""
        spec = self.rules.spec(var.get_metadata()["logical_axes"])
        return PartitionSpec(*(None if axes is None or dim % self.axis_size(axes) else axes
                               for axes, dim in zip(spec, var.shape)))

    def param_sharding(self, var) -> NamedSharding:
        return NamedSharding(self.mesh, self.param_spec(var))

    def constrain(self, x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
        """Pin an activation's layout; a no-op on one device."""
        if self.mesh.size == 1:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding(logical_axes))
