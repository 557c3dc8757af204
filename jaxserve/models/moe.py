"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 / V3): a
router picks `num_experts_per_tok` experts per token, each a SwiGLU MLP, and their outputs
are summed with the router's weights (plus Qwen2-MoE's shared expert, gated by a sigmoid,
or DeepSeek's shared experts, ungated).

Routing follows transformers exactly: router logits in the model's dtype, softmax in
float32, `top_k` of the probabilities (ties go to the lower expert index, as torch.topk
and lax.top_k both do), renormalised over the chosen experts when `norm_topk_prob`
(always for Mixtral); Mixtral keeps the weights in float32, the Qwen models cast them to
the model's dtype. DeepSeek's (`route_grouped`) is in float32 throughout.

The experts run as grouped matmuls, not a loop over experts: the token-expert pairs
(T x top_k of them) are sorted by expert, and each projection is one grouped matmul
(pallas_kernels/grouped_matmul: our TPU and GPU kernels, a loop over the experts with
tokens on a CPU) over the sorted rows with the experts' stacked weights `[E, in, out]`,
float or quantized per expert (int8 / int4 / fp8, like the dense layers); the results go
back to their tokens weighted and summed. On a mesh each device does this for the experts
(or the slices of every expert's MLP) it holds, and the partial sums are all-reduced
(parallel.expert_parallel; strategies in sharding/rules.py). Qwen2-MoE's shared expert is
a dense MLP (mlp.py) of its own size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig, ModelOptions
from jaxserve.models.layers import activation, param
from jaxserve.models.mlp import MLP
from jaxserve.models.parallel import expert_parallel
from pallas_kernels.grouped_matmul import grouped_matmul, quantized_shapes
from pallas_kernels.quantized_matmul.formats import kind_of
from sharding.rules import ShardingContext

# Logical axes of the stacked expert weights (sharding/rules.py).
EXPERT_IN_AXES = ("experts", "embed", "expert_mlp")  # gate_proj, up_proj: [E, hidden, I]
EXPERT_OUT_AXES = ("experts", "expert_mlp", "embed")  # down_proj: [E, I, hidden]
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_stack(shape: tuple[int, int, int], axes: tuple[str, ...], dtype,
                 options: ModelOptions) -> tuple[nnx.Param, nnx.Param | None]:
    """(weights, scales) of one projection of every expert, `[E, in, out]`: float, or the
    stacked quantized format of pallas_kernels/grouped_matmul (each expert quantized on
    its own, in the options' groups, with zero points when asymmetric; checkpoints
    overwrite the zeros at load)."""
    if options.quantization is None:
        return param(shape, axes, dtype), None
    (vshape, vdtype), (sshape, sdtype) = quantized_shapes(
        *shape, options.quantization, options.quant_group_size, options.quant_zero_points)
    # Group scales follow the in-features' sharding; a zero-point stack's [2] axis is whole.
    scale_axes = (axes[1] if sshape[-2] > 1 else None, axes[2])
    scale_axes = (axes[0],) + (None,) * (len(sshape) - 3) + scale_axes
    return (nnx.Param(jnp.zeros(vshape, vdtype), logical_axes=axes),
            nnx.Param(jnp.ones(sshape, sdtype), logical_axes=scale_axes))


def route(x: jax.Array, router: jax.Array, top_k: int, normalize: bool,
          weights_dtype, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(weights `[T, top_k]`, expert ids `[T, top_k]`) for tokens `x[T, hidden]`; `bias`
    (gpt-oss) is added to the logits. gpt-oss's softmax over the top-k logits is this
    top-k of the softmax renormalised (`normalize`)."""
    logits = jnp.dot(x, router.astype(x.dtype))
    if bias is not None:
        logits = logits + bias.astype(x.dtype)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights.astype(weights_dtype), experts


def route_grouped(x: jax.Array, router: jax.Array, bias: jax.Array | None, cfg: ModelConfig
                  ) -> tuple[jax.Array, jax.Array]:
    """DeepSeek's routing, (float32 weights `[T, top_k]`, expert ids `[T, top_k]`): float32
    logits, softmax (V2) or sigmoid (V3) scores; V3 adds its per-expert `bias` to the
    scores it chooses by (the weights are the unbiased scores); the experts are chosen
    among the `topk_group` best of `n_group` groups, a group scored by its best expert
    (V2) or the sum of its best two (V3); the weights renormalised when `norm_topk_prob`,
    then times routed_scaling_factor."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
    scores = (jax.nn.sigmoid(logits) if cfg.router_scoring == "sigmoid"
              else jax.nn.softmax(logits, axis=-1))
    choice = scores if bias is None else scores + bias
    if cfg.n_group > 1:
        groups = choice.reshape(choice.shape[0], cfg.n_group, -1)
        group_scores = (jax.lax.top_k(groups, 2)[0].sum(-1) if bias is not None
                        else groups.max(-1))
        kept = jax.lax.top_k(group_scores, cfg.topk_group)[1]
        mask = jnp.zeros(group_scores.shape, bool).at[
            jnp.arange(choice.shape[0])[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(mask, groups.shape[-1], axis=-1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


def clamped_swiglu(limit: float, alpha: float):
    """gpt-oss's gated activation of (gate, up), as transformers computes it."""
    def glu(gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, limit)
        return (jnp.clip(up, -limit, limit) + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    return glu


def grouped_glu(x: jax.Array, weights: jax.Array, experts: jax.Array, stacks: tuple,
                act=jax.nn.silu, impl: str | None = None, interpret: bool = False,
                biases: tuple[jax.Array, jax.Array] | None = None, glu=None) -> jax.Array:
    """`sum_j weights[t, j] * expert_{experts[t, j]}(x[t])` for every token, each expert
    `down(act(x @ gate) * (x @ up))` (`glu(x @ gate, x @ up)` when given), as grouped
    matmuls over the pairs sorted by expert (an expert no token chose is an empty group).
    `stacks` is (gate, gate scales, up, up scales, down, down scales), the scales None for
    float stacks (a quantized stack's kind is read from its values: a GGUF file may hold
    each in another format); `biases` (gpt-oss): the experts' gate and up biases `[E, I]`,
    added to their projections (a down bias is the caller's: it must be added once where
    the experts' MLP columns are split over devices). Pairs
    whose expert is outside `[0, num_experts)` add nothing: another device holds that
    expert (expert parallelism), and sorted last they fall outside every group."""
    gate_w, gate_s, up_w, up_s, down_w, down_s = stacks
    t, k = experts.shape
    num_experts = gate_w.shape[0]
    flat = experts.reshape(-1)
    ids = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = jnp.argsort(ids, stable=True)
    tokens = order // k
    group_sizes = jnp.bincount(ids, length=num_experts + 1)[:num_experts].astype(jnp.int32)

    def project(rows, w, scales):
        return grouped_matmul(rows, w, group_sizes, scales,
                              kind=None if scales is None else kind_of(w, scales), impl=impl,
                              interpret=interpret)

    rows = x[tokens]
    gate, up = project(rows, gate_w, gate_s), project(rows, up_w, up_s)
    if biases is not None:  # each sorted row's expert's (an outside pair's: any, unused)
        row_expert = jnp.minimum(ids[order], num_experts - 1)
        gate = gate + biases[0][row_expert].astype(gate.dtype)
        up = up + biases[1][row_expert].astype(up.dtype)
    h = glu(gate, up) if glu is not None else act(gate) * up
    out = project(h, down_w, down_s)
    out = out * jnp.where(ids < num_experts, weights.reshape(-1), 0)[order][:, None]
    return jnp.zeros((t, x.shape[-1]), out.dtype).at[tokens].add(out).astype(x.dtype)


class MoE(nnx.Module):
    """The sparse feed-forward block of one layer (see the module doc)."""

    def __init__(self, cfg: ModelConfig, dtype, options: ModelOptions, path: str | None = None):
        e, m, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.router = param((e, n), ("embed", None), dtype)
        if cfg.router_bias:  # DeepSeek-V3's e_score_correction_bias
            self.router_bias = param((n,), (None,), jnp.float32)
        if cfg.expert_biases:  # gpt-oss: the router's logits, the experts' projections
            self.router_logit_bias = param((n,), (None,), dtype)
            self.gate_bias = param((n, m), EXPERT_IN_AXES[::2], dtype)
            self.up_bias = param((n, m), EXPERT_IN_AXES[::2], dtype)
            # Whole on every device (E x hidden: 0.7 MB for gpt-oss-120b's): each token's
            # chosen rows are gathered where it is. Split by experts, the gather was a masked
            # local one and an all-reduce of [T, top_k, hidden] per layer under ep.
            self.down_bias = param((n, e), (None, EXPERT_OUT_AXES[2]), dtype)
        # Each stack's format (`path`: this module's parameter path in the decoder).
        gate, up, down = (options.weight_options(path and f"{path}.{p}") for p in PROJECTIONS)
        self.gate_proj, self.gate_proj_scales = expert_stack(
            (n, e, m), EXPERT_IN_AXES, dtype, gate)
        self.up_proj, self.up_proj_scales = expert_stack(
            (n, e, m), EXPERT_IN_AXES, dtype, up)
        self.down_proj, self.down_proj_scales = expert_stack(
            (n, m, e), EXPERT_OUT_AXES, dtype, down)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, dtype, options, cfg.shared_expert_intermediate_size,
                                     path=path and f"{path}.shared_expert")
            if cfg.shared_expert_gated:
                self.shared_expert_gate = param((e, 1), ("embed", None), dtype)
        self.cfg = cfg
        self.options = options

    def __call__(self, x: jax.Array, shard: ShardingContext, rows=None,
                 real: jax.Array | None = None, sow_stats: bool = False) -> jax.Array:
        """`x[T, hidden]` -> `[T, hidden]`; on a mesh the experts run per device
        (parallel.expert_parallel). `real` (`[T]` bool, the batch's real tokens) keeps the
        bucket's padding tokens away from every expert (their rows cost no expert work and
        come out zero); with `sow_stats` it sows how many real tokens chose each expert
        (`expert_tokens`, `[num_experts]`), for the engine's router statistics. `rows` (the
        real tokens' count) reaches the shared expert's dense matmuls."""
        cfg, options = self.cfg, self.options
        if cfg.router_scoring:
            weights, chosen = route_grouped(
                x, self.router[...], self.router_bias[...] if cfg.router_bias else None, cfg)
        else:
            weights_dtype = jnp.float32 if cfg.model_type == "mixtral" else x.dtype
            weights, chosen = route(
                x, self.router[...], cfg.num_experts_per_tok, cfg.norm_topk_prob,
                weights_dtype, self.router_logit_bias[...] if cfg.expert_biases else None)
        if real is not None:
            if sow_stats:
                counts = jnp.zeros(cfg.num_experts, jnp.int32).at[chosen].add(
                    real[:, None].astype(jnp.int32))
                self.sow(nnx.Intermediate, "expert_tokens", counts)
            chosen = jnp.where(real[:, None], chosen, -1)
        impl = options.kernel_impl  # None, "reference", "cpu", "tpu" or "gpu", as here

        glu = clamped_swiglu(cfg.swiglu_limit, cfg.swiglu_alpha) if cfg.swiglu_limit else None

        def experts(x, weights, chosen, *stacks, first_expert=0):
            return grouped_glu(x, weights, chosen - first_expert, stacks[:6],
                               activation(cfg.hidden_act), impl,
                               options.interpret and impl in ("tpu", "gpu"),
                               biases=stacks[6:] or None, glu=glu)

        stacks = [getattr(self, name + suffix) for name in PROJECTIONS
                  for suffix in ("", "_scales")]
        if cfg.expert_biases:
            stacks += [self.gate_bias, self.up_bias]
        out = expert_parallel(experts, x, weights, chosen, stacks, shard)
        if cfg.expert_biases:  # each chosen expert's down bias, weighted (none for padding)
            bias = self.down_bias[...][jnp.maximum(chosen, 0)]  # [T, top_k, hidden]
            w = jnp.where(chosen >= 0, weights, 0).astype(bias.dtype)
            out = out + jnp.einsum("tk,tkh->th", w, bias).astype(out.dtype)
        if cfg.shared_expert_intermediate_size:
            shared = self.shared_expert(x, shard, rows)
            if cfg.shared_expert_gated:
                shared = jax.nn.sigmoid(x @ self.shared_expert_gate[...]) * shared
            out = out + shared
        return out
