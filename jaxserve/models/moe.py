"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks
`num_experts_per_tok` experts per token, each a SwiGLU MLP, and their outputs are summed
with the router's weights (plus Qwen2-MoE's shared expert, gated by a sigmoid).

Routing follows transformers exactly: router logits in the model's dtype, softmax in
float32, `top_k` of the probabilities (ties go to the lower expert index, as torch.topk
and lax.top_k both do), renormalised over the chosen experts when `norm_topk_prob`
(always for Mixtral); Mixtral keeps the weights in float32, the Qwen models cast them to
the model's dtype.

The experts run as grouped matmuls, not a loop over experts: the token-expert pairs
(T x top_k of them) are sorted by expert, and each projection is one `jax.lax.ragged_dot`
over the sorted rows with the experts' stacked weights `[E, in, out]`; the results go
back to their tokens weighted and summed. On a mesh each device does this for the experts
(or the slices of every expert's MLP) it holds, and the partial sums are all-reduced
(parallel.expert_parallel; strategies in sharding/rules.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.models.layers import param
from jaxserve.models.parallel import expert_parallel
from sharding.rules import ShardingContext

# Logical axes of the stacked expert weights (sharding/rules.py).
EXPERT_IN_AXES = ("experts", "embed", "expert_mlp")  # gate_proj, up_proj: [E, hidden, I]
EXPERT_OUT_AXES = ("experts", "expert_mlp", "embed")  # down_proj: [E, I, hidden]


def route(x: jax.Array, router: jax.Array, top_k: int, normalize: bool,
          weights_dtype) -> tuple[jax.Array, jax.Array]:
    """(weights `[T, top_k]`, expert ids `[T, top_k]`) for tokens `x[T, hidden]`."""
    logits = jnp.dot(x, router.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights.astype(weights_dtype), experts


def grouped_swiglu(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
                   up_proj: jax.Array, down_proj: jax.Array) -> jax.Array:
    """`sum_j weights[t, j] * expert_{experts[t, j]}(x[t])` for every token, each expert
    `down(silu(x @ gate) * (x @ up))`, as grouped matmuls over the pairs sorted by expert
    (an expert no token chose is an empty group). Pairs whose expert is outside
    `[0, num_experts)` add nothing: another device holds that expert (expert parallelism),
    and sorted last they fall outside every group (ragged_dot gives them zeros)."""
    t, k = experts.shape
    num_experts = gate_proj.shape[0]
    flat = experts.reshape(-1)
    ids = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = jnp.argsort(ids, stable=True)
    tokens = order // k
    group_sizes = jnp.bincount(ids, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    rows = x[tokens]
    gate = jax.lax.ragged_dot(rows, gate_proj, group_sizes)
    up = jax.lax.ragged_dot(rows, up_proj, group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_proj, group_sizes)
    out = out * jnp.where(ids < num_experts, weights.reshape(-1), 0)[order][:, None]
    return jnp.zeros((t, x.shape[-1]), out.dtype).at[tokens].add(out).astype(x.dtype)


class MoE(nnx.Module):
    """The sparse feed-forward block of one layer (see the module doc)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None, options: ModelOptions):
        if options.quantization is not None:
            raise ValueError(f"quantization {options.quantization!r} of mixture-of-experts "
                             "weights is not supported yet; serve this model unquantized")
        e, m, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.router = param(rngs, (e, n), ("embed", None), dtype)
        self.gate_proj = param(rngs, (n, e, m), EXPERT_IN_AXES, dtype)
        self.up_proj = param(rngs, (n, e, m), EXPERT_IN_AXES, dtype)
        self.down_proj = param(rngs, (n, m, e), EXPERT_OUT_AXES, dtype)
        s = cfg.shared_expert_intermediate_size
        if s:
            self.shared_gate_proj = param(rngs, (e, s), ("embed", "expert_mlp"), dtype)
            self.shared_up_proj = param(rngs, (e, s), ("embed", "expert_mlp"), dtype)
            self.shared_down_proj = param(rngs, (s, e), ("expert_mlp", "embed"), dtype)
            self.shared_expert_gate = param(rngs, (e, 1), ("embed", None), dtype)
        self.cfg = cfg

    def __call__(self, x: jax.Array, shard: ShardingContext, rows=None,
                 real: jax.Array | None = None) -> jax.Array:
        """`x[T, hidden]` -> `[T, hidden]`; on a mesh the experts run per device
        (parallel.expert_parallel). With `real` (`[T]` bool, the batch's real tokens) it
        sows how many real tokens chose each expert (`expert_tokens`, `[num_experts]`), for
        the engine's router statistics. `rows` (the native matmul's) is unused."""
        cfg = self.cfg
        weights_dtype = jnp.float32 if cfg.model_type == "mixtral" else x.dtype
        weights, chosen = route(x, self.router[...], cfg.num_experts_per_tok,
                                cfg.norm_topk_prob, weights_dtype)
        if real is not None:
            counts = jnp.zeros(cfg.num_experts, jnp.int32).at[chosen].add(
                real[:, None].astype(jnp.int32))
            self.sow(nnx.Intermediate, "expert_tokens", counts)

        def experts(x, weights, chosen, gate_proj, up_proj, down_proj, first_expert=0):
            return grouped_swiglu(x, weights, chosen - first_expert, gate_proj, up_proj,
                                  down_proj)

        out = expert_parallel(experts, x, weights, chosen, self.gate_proj, self.up_proj,
                              self.down_proj, shard)
        if cfg.shared_expert_intermediate_size:
            h = jax.nn.silu(x @ self.shared_gate_proj[...]) * (x @ self.shared_up_proj[...])
            gate = jax.nn.sigmoid(x @ self.shared_expert_gate[...])
            out = out + gate * (h @ self.shared_down_proj[...])
        return out
