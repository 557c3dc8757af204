"""Sampling on device, batched, with per-request parameters as arrays.

Order (as vLLM): grammar mask → logit bias → penalties → (greedy argmax | temperature →
top-k → top-p → min-p → draw by inverse CDF). Each sequence draws with its own key,
`fold_in(key(seed), output index)`, so a seeded request gets the same tokens whatever else
shares its batch. Logprobs are those of the model's distribution as the grammar mask leaves
it (before bias, penalties and filters), computed only when a sequence of the batch asks
for them (zeros otherwise).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sampling_params import MAX_LOGPROBS

_NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-sequence sampling parameters `[S]` (banned_ids and bias_*: `[S, N]`)."""

    temperature: jax.Array  # f32, 0 = greedy
    top_k: jax.Array  # i32, 0 = off
    top_p: jax.Array  # f32, 1 = off
    min_p: jax.Array  # f32, 0 = off
    presence_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    repetition_penalty: jax.Array  # f32
    seed: jax.Array  # u32
    output_index: jax.Array  # i32, how many tokens the sequence has generated
    banned_ids: jax.Array  # i32, -1 padded: stop tokens forbidden until min_tokens is reached
    logprobs: jax.Array  # bool, the request asked for logprobs
    bias_ids: jax.Array  # i32 [S, MAX_LOGIT_BIAS], -1 padded: logit_bias's tokens
    bias_values: jax.Array  # f32 [S, MAX_LOGIT_BIAS]: what is added to their logits
    # i32 [S, ceil(V/32)]: bit t % 32 of word t // 32 set = token t allowed (structured
    # output); all ones (-1) for a row without a grammar.
    grammar_mask: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenHistory:
    """Token ids seen by each sequence, for penalties: `tokens[S, H]` (-1 padded)."""

    tokens: jax.Array
    prompt_lens: jax.Array  # [S]; tokens at index >= prompt_len are generated


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    token_ids: jax.Array  # [S] i32
    logprob: jax.Array  # [S] f32, of the sampled token
    top_ids: jax.Array  # [S, MAX_LOGPROBS] i32
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] f32


def apply_penalties(logits: jax.Array, p: SamplingArrays, history: TokenHistory) -> jax.Array:
    s, v = logits.shape
    tokens = jnp.where(history.tokens >= 0, history.tokens, v)  # v is out of range: dropped
    rows = jnp.arange(s)[:, None]
    generated = jnp.arange(tokens.shape[1])[None, :] >= history.prompt_lens[:, None]
    counts = jnp.zeros((s, v), jnp.float32).at[rows, tokens].add(generated, mode="drop")
    seen = jnp.zeros((s, v), jnp.bool_).at[rows, tokens].set(True, mode="drop")
    rep = p.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - p.frequency_penalty[:, None] * counts
    return logits - p.presence_penalty[:, None] * (counts > 0)


def apply_grammar_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Tokens whose bit is clear get -inf. Skipped (one check of the mask) when no row
    of the batch has a grammar."""
    s, v = logits.shape

    def masked(logits):
        bits = (mask[:, :, None] >> jnp.arange(32, dtype=mask.dtype)) & 1
        allowed = bits.reshape(s, -1)[:, :v].astype(jnp.bool_)
        return jnp.where(allowed, logits, _NEG_INF)

    return jax.lax.cond(jnp.any(mask != -1), masked, lambda x: x, logits)


def add_logit_bias(logits: jax.Array, p: SamplingArrays) -> jax.Array:
    v = logits.shape[1]
    ids = jnp.where(p.bias_ids >= 0, p.bias_ids, v)
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].add(p.bias_values, mode="drop")


def ban_tokens(logits: jax.Array, banned_ids: jax.Array) -> jax.Array:
    v = logits.shape[1]
    banned = jnp.where(banned_ids >= 0, banned_ids, v)
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, banned].set(_NEG_INF, mode="drop")


def filter_logits(logits: jax.Array, p: SamplingArrays) -> jax.Array:
    """Mask (to -inf) tokens outside top-k, outside the top-p nucleus, or below min-p."""
    v = logits.shape[1]

    def top_k_top_p(logits):
        sorted_desc = -jnp.sort(-logits, axis=-1)
        k = jnp.where((p.top_k > 0) & (p.top_k < v), p.top_k, v)
        kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
        sorted_desc = jnp.where(jnp.arange(v)[None, :] < k[:, None], sorted_desc, _NEG_INF)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: token i stays if the mass
        # before it is below top_p.
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < p.top_p[:, None]
        last = jnp.sum(keep, axis=-1) - 1
        threshold = jnp.maximum(kth[:, 0], jnp.take_along_axis(sorted_desc, last[:, None], -1)[:, 0])
        return jnp.where(logits >= threshold[:, None], logits, _NEG_INF)

    needs_sort = jnp.any((p.top_k > 0) & (p.top_k < v)) | jnp.any(p.top_p < 1.0)
    logits = jax.lax.cond(needs_sort, top_k_top_p, lambda x: x, logits)

    def min_p(logits):
        probs = jax.nn.softmax(logits, axis=-1)
        floor = p.min_p[:, None] * probs.max(axis=-1, keepdims=True)
        return jnp.where(probs >= floor, logits, _NEG_INF)

    return jax.lax.cond(jnp.any(p.min_p > 0), min_p, lambda x: x, logits)


def sample(raw_logits: jax.Array, p: SamplingArrays, history: TokenHistory | None) -> SampleOutput:
    """Pick one token per row of `raw_logits[S, V]` (float32)."""
    raw_logits = apply_grammar_mask(raw_logits, p.grammar_mask)
    logits = add_logit_bias(raw_logits, p)
    logits = logits if history is None else apply_penalties(logits, p, history)
    logits = ban_tokens(logits, p.banned_ids)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits):
        temp = jnp.where(p.temperature > 0, p.temperature, 1.0)
        scaled = filter_logits(logits / temp[:, None], p)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(p.seed, p.output_index)
        # Inverse CDF: the first token whose cumulative probability passes the row's one
        # uniform draw. Gumbel noise per token (argmax of logits + noise) picks from the same
        # distribution but costs 64 x 49k random numbers a step: ~6x the time on a CPU.
        u = jnp.maximum(jax.vmap(jax.random.uniform)(keys), jnp.finfo(jnp.float32).tiny)
        cdf = jnp.cumsum(jnp.exp(scaled - scaled.max(axis=-1, keepdims=True)), axis=-1)
        drawn = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)
        drawn = jnp.minimum(drawn, logits.shape[1] - 1)
        return jnp.where(p.temperature > 0, drawn, greedy_ids)

    token_ids = jax.lax.cond(jnp.any(p.temperature > 0), draw, lambda _: greedy_ids, logits)
    s, k = raw_logits.shape[0], min(MAX_LOGPROBS, raw_logits.shape[1])

    def with_logprobs(_):
        logprobs = jax.nn.log_softmax(raw_logits, axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
        chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_logprobs

    def without(_):  # nobody asked: skip a softmax and a top-k over the vocabulary
        return (jnp.zeros(s, jnp.float32), jnp.zeros((s, k), jnp.int32),
                jnp.zeros((s, k), jnp.float32))

    chosen, top_ids, top_logprobs = jax.lax.cond(jnp.any(p.logprobs), with_logprobs, without,
                                                 None)
    return SampleOutput(token_ids, chosen, top_ids, top_logprobs)
