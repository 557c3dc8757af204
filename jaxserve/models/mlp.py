"""The dense feed-forward block: SwiGLU (Llama, Qwen, Mistral) or GeGLU (Gemma),
`down(act(x @ gate) * (x @ up))`, its weights float or quantized (layers.linear), split
Megatron-style over the mesh (gate/up by columns, down by rows: one all-reduce). Also
Qwen2-MoE's shared expert, with its own intermediate size."""

from __future__ import annotations

import jax
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.models.layers import act_order_perm, linear, rows_impl
from jaxserve.models.lora import MLP_IN, LoraLayer
from jaxserve.models.parallel import dense_group, row_parallel
from pallas_kernels.rows import gated_activation
from sharding.rules import ShardingContext


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, options: ModelOptions,
                 intermediate_size: int | None = None, path: str | None = None):
        e, m = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        # Each projection's format (`path`: this module's parameter path in the decoder).
        gate, up, down = (options.weight_options(path and f"{path}.{p}_proj")
                          for p in ("gate", "up", "down"))
        self.gate_proj, self.gate_proj_scales = linear(
            (e,), (m,), ("embed",), ("mlp",), dtype, gate)
        self.up_proj, self.up_proj_scales = linear((e,), (m,), ("embed",), ("mlp",), dtype, up)
        self.down_proj, self.down_proj_scales = linear(
            (m,), (e,), ("mlp",), ("embed",), dtype, down)
        self.gate_proj_perm = act_order_perm(e, gate)  # act-order checkpoints, else None
        self.up_proj_perm = act_order_perm(e, up)
        self.down_proj_perm = act_order_perm(m, down)
        self.options = options
        self.sizes = (e, m)
        self.act = cfg.hidden_act

    def __call__(self, x: jax.Array, shard: ShardingContext, rows: jax.Array | None = None,
                 lora: LoraLayer | None = None) -> jax.Array:
        e, m = self.sizes
        gate, up = dense_group(x, [(self.gate_proj, self.gate_proj_scales, (m,), self.gate_proj_perm),
                                   (self.up_proj, self.up_proj_scales, (m,), self.up_proj_perm)],
                               self.options, shard, rows)
        if lora is not None:
            gate, up = lora.add(x, MLP_IN, [gate, up])
        h = gated_activation(gate, up, self.act, rows=rows, impl=rows_impl(self.options, rows))
        h = shard.constrain(h, ("tokens", "mlp"))
        y = row_parallel(h, self.down_proj, self.down_proj_scales, 1, (e,), self.options,
                         shard, rows, self.down_proj_perm)
        if lora is not None:
            (y,) = lora.add(h, ("down_proj",), [y])
        return y
