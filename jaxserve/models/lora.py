"""LoRA adapters on the decoder's projections: the stacks of every adapter slot and the
delta they add to a mixed batch (pallas_kernels/lora).

The stacks live outside the model's parameters (they change at run time: an adapter is
loaded into a slot without recompiling): per layer, per target module, `A [G, in, r]` and
`B [G, r, out]` for G = `max_loras` slots, ranks padded to `r = max_lora_rank` with
zeros, each adapter's scale (alpha / rank, or alpha / sqrt(rank) with rsLoRA) folded into
its B. Every projection an adapter can target has stacks; an adapter that leaves one out
has zeros there. On a mesh the stacks are replicated: each device computes the delta of
its own projection's output from them (small next to the weights: a rank-16 slot of a
Llama-3-8B is 0.3% of its parameters).

Who computes the delta (`delta_impl`): on one CPU device, where the float matmuls are
native, the native kernel (pallas_kernels/lora/cpu.py: every projection of an input in one
call, in place); on one TPU or GPU the grouped matmuls' Pallas kernels over the step's
tokens sorted by slot (pallas_kernels/lora); on a mesh the same grouped matmuls as XLA's
`ragged_dot`, which XLA partitions along the projection's own sharding (a Pallas kernel
cannot be partitioned automatically; the deltas are small next to the projections).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.config import ModelConfig
from pallas_kernels.lora import LoraPlan, cpu, lora_delta_sorted, plan

# The projections an adapter may target, by the inputs they share (one sort each).
ATTENTION_IN = ("q_proj", "k_proj", "v_proj")
MLP_IN = ("gate_proj", "up_proj")
MODULES = ATTENTION_IN + ("o_proj",) + MLP_IN + ("down_proj",)


def module_shapes(cfg: ModelConfig, kv_replicas: int = 1) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module, as our model holds it (k/v heads repeated
    `kv_replicas` times under tensor parallelism)."""
    e, m, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * kv_replicas * d
    return {"q_proj": (e, q), "k_proj": (e, kv), "v_proj": (e, kv), "o_proj": (q, e),
            "gate_proj": (e, m), "up_proj": (e, m), "down_proj": (m, e)}


def dense_layers(cfg: ModelConfig) -> list[bool]:
    """Whether each layer's MLP is dense (an adapter's MLP modules apply there only; the
    experts of a MoE layer take none)."""
    return [not sparse for sparse in cfg.sparse_layers]


def abstract_stacks(cfg: ModelConfig, max_loras: int, max_rank: int, dtype,
                    kv_replicas: int = 1) -> list[dict[str, tuple]]:
    """ShapeDtypeStructs of every layer's stacks: `{module: (A, B)}` per layer (no MLP
    modules in a MoE layer)."""
    shapes = module_shapes(cfg, kv_replicas)
    out = []
    for dense in dense_layers(cfg):
        mods = MODULES if dense else ATTENTION_IN + ("o_proj",)
        out.append({name: (jax.ShapeDtypeStruct((max_loras, shapes[name][0], max_rank), dtype),
                           jax.ShapeDtypeStruct((max_loras, max_rank, shapes[name][1]), dtype))
                    for name in mods})
    return out


def stacks_bytes(stacks) -> int:
    """Bytes of every stack (`abstract_stacks`'s, abstract or not; 0 for None): what each
    device holds, the stacks being replicated."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(stacks))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraInputs:
    """What a forward pass needs for adapters: every layer's stacks, the step's tokens'
    slots and their plan (the tokens sorted by slot; the native kernel needs only the
    slots, and XLA drops the plan's work when nothing reads it)."""

    stacks: list[dict[str, tuple[jax.Array, jax.Array]]]
    slots: jax.Array
    plan: LoraPlan

    @classmethod
    def of(cls, stacks, slots: jax.Array) -> LoraInputs:
        g = next(iter(stacks[0].values()))[0].shape[0]
        return cls(stacks, slots, plan(slots, g))

    def layer(self, i: int, impl: str | None) -> LoraLayer:
        """Layer i's view, its deltas computed by `impl` (`delta_impl`)."""
        return LoraLayer(self.stacks[i], self.slots, self.plan, impl)


def delta_impl(one_device: bool, native: bool) -> str | None:
    """Who computes the deltas: "native" (the native CPU kernel, where the float matmuls
    are native on one device), None (the grouped matmul's choice for the platform, one
    device) or "reference" (XLA's ragged_dot, on a mesh)."""
    if not one_device:
        return "reference"
    return "native" if native else None


@dataclasses.dataclass
class LoraLayer:
    stacks: dict[str, tuple[jax.Array, jax.Array]]
    slots: jax.Array
    plan: LoraPlan
    impl: str | None  # delta_impl's

    def add(self, x: jax.Array, names: tuple[str, ...], ys: list[jax.Array]) -> list[jax.Array]:
        """Each projection `names[i]` of x (`ys[i]`, any shape with x's leading token
        dim) plus its LoRA delta; x is sorted once for all of them."""
        x2 = x.reshape(x.shape[0], -1)
        if self.impl == "native" and cpu.supports(x2):
            return cpu.lora_add(x2, self.slots, ys, [self.stacks[name] for name in names])
        p = self.plan
        xs = x2[p.order]
        impl = "reference" if self.impl == "reference" else None
        out = []
        for name, y in zip(names, ys):
            a, b = self.stacks[name]
            delta = lora_delta_sorted(xs, a, b, p, impl)[p.inverse]
            out.append(y + delta.reshape(y.shape).astype(y.dtype))
        return out
