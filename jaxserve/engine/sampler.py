"""Sampling on device, batched, with per-request parameters as arrays.

Order (as vLLM): grammar mask → logit bias → penalties → (greedy argmax | temperature →
top-k → top-p → min-p → draw by inverse CDF); stop tokens banned until min_tokens. Each sequence draws with its own key,
`fold_in(key(seed), output index)`, so a seeded request gets the same tokens whatever else
shares its batch. Logprobs are those of the model's distribution as the grammar mask leaves
it (before bias, penalties and filters), computed only when a sequence of the batch asks
for them (zeros otherwise).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.outputs import Logprob
from jaxserve.sampling_params import MAX_LOGPROBS
from pallas_kernels import cpu as native
from pallas_kernels.platform import current_platform

# Row counts a batch's real sequences are sampled in when fewer than the bucket's (sample).
ROW_TIERS = (1, 8)
# Logits above this many bytes are sampled ROW_TIERS[-1] rows at a time: a sample's
# temporaries are ~7x its float32 logits (89 MB for [64, 49152]), and glibc maps a block
# over 32 MiB afresh for every allocation (see `_sample_in_chunks`).
CHUNK_ABOVE_BYTES = 4 << 20

_NEG_INF = -jnp.inf


class Static(NamedTuple):
    """What a program's sampling settles when it is compiled, not on the device. Without
    one (None) the sampling branches on the rows' parameters with `lax.cond`s (greedy or
    drawn, a grammar mask or bias or not, top-k / top-p's sort, logprobs, the row tiers),
    which cost XLA:CPU and TPU nothing when a branch is skipped; XLA:GPU runs a
    `lax.cond` by copying its predicate to the host and waiting for it (its
    ConditionalThunk), so a program holding one returns to its caller only when the
    device has reached it, and no step is queued behind another. There the host picks
    the program instead (ModelRunner.branch_free): every row's draw and greedy pick are
    computed and each row takes its own; `sorts` False leaves out top-k / top-p (no row
    may ask for them) and `logprobs` False the logprobs (zeros; no row may ask)."""

    sorts: bool
    logprobs: bool


FAST = Static(sorts=False, logprobs=False)  # greedy, temperature, min-p, bias, masks
FULL = Static(sorts=True, logprobs=True)  # also top-k, top-p and logprobs


def _native_cpu() -> bool:
    """Whether the programs being traced run on a CPU with the native kernels
    (pallas_kernels/cpu: the cut, the greedy pick and the draw)."""
    return current_platform() == "cpu" and native.available()


def asks_sort(p: SamplingArrays) -> bool:
    """Whether a row of a batch's sampling arrays (on the host) asks for top-k or top-p,
    which only a `Static` with `sorts` applies (padding rows ask for nothing)."""
    return bool((p.top_k > 0).any() or (p.top_p < 1.0).any())


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
    # i32 [S]: the row verifies a draft a proposer drew from its own distribution (see
    # `verify_drafts`): its index in the step's `SampledDrafts`; -1: none (no draft, or a
    # guess made for sure, which the row's own draw verifies).
    draft_index: jax.Array
    # i32 [S]: the row's sequence's `StepBatch.shift_row` (its output_index moves back by
    # the drafts its pending step rejected: device.resolve_pending); -1: none.
    shift_row: jax.Array
    # i32 [S]: at a sequence's first row, the drafts of its chain the rows after it verify
    # (the step's acceptance is left on the device for the next step: CarryLayout); else 0.
    group_drafts: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampledDrafts:
    """Drafts drawn from a proposer's distributions (`draw_drafts`), on the device: draft
    i is `ids[i]`, drawn from `probs[i]` `[V]` (the target's vocabulary)."""

    ids: jax.Array  # [N] i32
    probs: jax.Array  # [N, V] f32


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


def grammar_allowed(mask: jax.Array, v: int) -> jax.Array:
    """`[S, V]` bool: bit `t % 32` of word `t // 32` of each row's mask. An expression XLA
    fuses into whatever reads it, so no `[S, V]` array is written for it."""
    s, w = mask.shape
    words = jnp.broadcast_to(mask[:, :, None], (s, w, 32)).reshape(s, w * 32)[:, :v]
    return ((words >> (jnp.arange(v, dtype=mask.dtype) % 32)) & 1) == 1


def apply_grammar_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Tokens whose bit is clear get -inf."""
    return jnp.where(grammar_allowed(mask, logits.shape[1]), logits, _NEG_INF)


def bias_and_ban(logits: jax.Array, p: SamplingArrays) -> jax.Array:
    """Adds each row's logit_bias, and -inf to its banned tokens, in one scatter (XLA:CPU
    copies the whole array for each scatter it cannot do in place)."""
    v = logits.shape[1]
    ids = jnp.concatenate([p.bias_ids, p.banned_ids], axis=1)
    ids = jnp.where(ids >= 0, ids, v)  # v is out of range: dropped
    values = jnp.concatenate([p.bias_values, jnp.full(p.banned_ids.shape, _NEG_INF)], axis=1)
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].add(values, mode="drop")


def top_k_top_p_by_sort(logits: jax.Array, top_k: jax.Array, top_p: jax.Array
                        ) -> jax.Array:
    """Each row's top-k / top-p threshold `[S]` (`filter_logits`) from the row sorted in
    descending order: the larger of its k-th value and the value of the last token whose
    mass before it, within the top k renormalised, is below top_p."""
    v = logits.shape[1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    sorted_desc = jnp.where(jnp.arange(v)[None, :] < k[:, None], sorted_desc, _NEG_INF)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: token i stays if the mass before
    # it is below top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p[:, None]
    last = jnp.sum(keep, axis=-1) - 1
    return jnp.maximum(kth[:, 0], jnp.take_along_axis(sorted_desc, last[:, None], -1)[:, 0])


def filter_logits(logits: jax.Array, p: SamplingArrays, top: jax.Array | None = None,
                  sorts: bool | None = None) -> jax.Array:
    """Mask (to -inf) tokens outside top-k, outside the top-p nucleus, or below min-p:
    each a per-row threshold on the logits (`filter_cut`), one `where` applies them all.
    `top`: each row's maximum, if the caller has it (no filter removes it)."""
    top = row_max(logits) if top is None else top
    cut = filter_cut(logits, p, top, sorts)
    return jnp.where(logits >= cut[:, None], logits, _NEG_INF)


def filter_cut(logits: jax.Array, p: SamplingArrays, top: jax.Array,
               sorts: bool | None = None, temp: jax.Array | None = None) -> jax.Array:
    """Each row's threshold `[S]` of top-k, top-p and min-p on `logits / temp[:, None]`
    (`temp` None: on `logits`), whose row maxima are `top`: the tokens at or above it
    stay.

    Only top-k / top-p need a sort, under a `lax.cond` (on the thresholds; the scaled
    logits are made inside it, so nothing of `[S, V]` is written when no row asks).
    `sorts` (Static.sorts): sort or not whatever the rows ask; None: the `lax.cond`. On
    a CPU the thresholds come from the native kernel (`jaxserve_top_k_top_p_cut`), which
    sorts no row: XLA:CPU's sort took top-p over one row of a 49k vocabulary 11 ms, over
    64 rows 674 ms (2-core Xeon)."""
    s, v = logits.shape

    def top_k_top_p(operands):
        logits, temp = operands
        if _native_cpu():  # it scales each logit as it reads it (as XLA's x / temp)
            call = jax.ffi.ffi_call("jaxserve_top_k_top_p_cut",
                                    jax.ShapeDtypeStruct((s,), jnp.float32))
            temp = jnp.ones(s, jnp.float32) if temp is None else temp.astype(jnp.float32)
            return call(logits.astype(jnp.float32), temp, p.top_k.astype(jnp.int32),
                        p.top_p.astype(jnp.float32)).astype(logits.dtype)
        scaled = logits if temp is None else logits / temp[:, None]
        return top_k_top_p_by_sort(scaled, p.top_k, p.top_p)

    if sorts is None:
        needs_sort = jnp.any((p.top_k > 0) & (p.top_k < v)) | jnp.any(p.top_p < 1.0)
        cut = jax.lax.cond(needs_sort, top_k_top_p, lambda _: jnp.full(s, _NEG_INF, top.dtype),
                           (logits, temp))
    else:
        cut = top_k_top_p((logits, temp)) if sorts else jnp.full(s, _NEG_INF, top.dtype)
    # min-p: p_t >= min_p * p_max  <=>  logit_t >= logit_max + log(min_p) (the softmax's
    # normaliser cancels); log(0) = -inf keeps everything.
    return jnp.maximum(cut, top + jnp.log(p.min_p))


BLOCK = 128  # tokens per block of the two-level argmax and inverse CDF


def _first_max_index(x: jax.Array) -> jax.Array:
    """argmax over the last axis of a small array: the first index of the maximum."""
    n = x.shape[-1]
    index = jnp.where(x == x.max(axis=-1, keepdims=True), jnp.arange(n, dtype=jnp.int32), n)
    return jnp.minimum(index.min(axis=-1), n - 1)


def _blocks(x: jax.Array, fill: float) -> jax.Array:
    """`[S, V]` as `[S, ceil(V / BLOCK), BLOCK]`, the end padded with `fill`."""
    s, v = x.shape
    return jnp.pad(x, ((0, 0), (0, -v % BLOCK)), constant_values=fill).reshape(s, -1, BLOCK)


def row_max(x: jax.Array) -> jax.Array:
    """`x.max(axis=-1)` of `[S, V]`, block by block (see `first_argmax`)."""
    return _blocks(x, _NEG_INF).max(axis=-1).max(axis=-1)


def first_argmax(logits: jax.Array) -> jax.Array:
    """`argmax` over the last axis of `[S, V]`: the first index of the maximum (int32).
    On a CPU the native kernel (`jaxserve_argmax`, float32 or bf16 logits as they come;
    a NaN ranks above every number there, as in np.argmax); elsewhere `two_level_argmax`.
    A tiny model's fused decode step (vocabulary 2048, 2-core Xeon) took ~1.00 ms at 64
    rows with XLA's, ~0.86 with the native one; 256 rows 2.1 -> 1.9 ms."""
    if _native_cpu() and logits.dtype in (jnp.float32, jnp.bfloat16):
        call = jax.ffi.ffi_call("jaxserve_argmax",
                                jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))
        return call(logits)
    return two_level_argmax(logits)


def two_level_argmax(logits: jax.Array) -> jax.Array:
    """`first_argmax` in XLA, in two levels: each block's maximum (one pass over the
    logits, a plain reduction that XLA:CPU vectorises and fuses with whatever made the
    logits), the first block holding the row's maximum, the first index of it there.
    XLA:CPU's own argmax, a reduction over (value, index) pairs, takes 6.5 ms for [64,
    49152]; a max then a min over the indices that reach it, 1.8 ms, and 12 ms behind a
    mask (the maximum is broadcast into a full-size array); this, 0.4-0.6 ms."""
    blocks = _blocks(logits, _NEG_INF)
    block = _first_max_index(blocks.max(axis=-1))
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    return block * BLOCK + _first_max_index(inner)


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """For each row of unnormalised `weights[S, V]` (>= 0, some > 0), the first token
    whose cumulative weight reaches `u * total` (`u` in (0, 1)): a draw from the weights.

    In two levels, so no scan runs over the whole vocabulary (a cumsum over [64, 49152]
    takes XLA:CPU 6.4 ms): the block of BLOCK tokens holding the target, from a
    cumulative sum over block totals, then the token within it. A token of zero weight is
    never picked, whatever the rounding (the pick is at most the block's last token of
    positive weight, and that block is at most the last one of positive weight)."""
    return _inverse_cdf_in_blocks(_blocks(weights, 0.0), lambda x: x, u)


def draw_from(logits: jax.Array, weights: Weights, u: jax.Array) -> jax.Array:
    """Each row's draw from `weights(logits)` `[S, V]` with its uniform `u` `[S]`:
    `inverse_cdf`'s pick, no array of weights written. On a CPU the native kernel
    (`jaxserve_draw`: one pass summing the weights block by block, then the picked block
    again); elsewhere `_inverse_cdf_in_blocks` (XLA:CPU: 1.6-1.8 ms over [64, 49152],
    the kernel 0.8 with AVX-512, 1.2 with AVX2; 2-core Xeon)."""
    if _native_cpu():
        call = jax.ffi.ffi_call("jaxserve_draw",
                                jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        return call(f32(logits), f32(weights.temp), f32(weights.top), f32(weights.cut), f32(u))
    return _inverse_cdf_in_blocks(_blocks(logits, _NEG_INF), weights, u)


def _inverse_cdf_in_blocks(blocks: jax.Array, weight, u: jax.Array) -> jax.Array:
    """`inverse_cdf` of the weights `weight(blocks)` of `blocks` `[S, V / B, B]`
    (`weight` elementwise, each row its own parameters, 0 for the padding): the blocks'
    totals are summed as the weights are made, and only the picked block's are made
    again, so no `[S, V]` array of weights is written (a draw over [64, 49152] on a CPU
    read the logits three times and wrote them twice more)."""
    s = blocks.shape[0]
    block_cdf = jnp.cumsum(weight(blocks).sum(axis=-1), axis=-1)  # [S, V / B]
    target = u * block_cdf[:, -1]
    last_block = jnp.max(jnp.where(block_cdf > jnp.concatenate(
        [jnp.zeros((s, 1), block_cdf.dtype), block_cdf[:, :-1]], axis=-1),
        jnp.arange(block_cdf.shape[1]), 0), axis=-1)
    block = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), last_block)
    before = jnp.where(block > 0, jnp.take_along_axis(
        block_cdf, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = weight(jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0])  # [S, B]
    last = jnp.max(jnp.where(inner > 0, jnp.arange(BLOCK), 0), axis=-1)
    within = jnp.sum(before[:, None] + jnp.cumsum(inner, axis=-1) < target[:, None], axis=-1)
    return (block * BLOCK + jnp.minimum(within, last)).astype(jnp.int32)


def sample(raw_logits: jax.Array, p: SamplingArrays, history: TokenHistory | None,
           num_rows: jax.Array | None = None, drafts: SampledDrafts | None = None,
           static: Static | None = None) -> SampleOutput:
    """Pick one token per row of `raw_logits[S, V]` (float32, or the model's dtype: then
    widened to float32 here, only the rows sampled).

    `num_rows` (int32 scalar, traced; None: all rows) says how many leading rows are real
    sequences, the rest padding of the bucket. When they fit in one of ROW_TIERS smaller
    than S, only that many rows are sampled (the rest come out zero): a bucket of 64
    sequences holding one prefill samples 1 row, not 64 (9 ms of a 33 ms step on a CPU at
    a 49k vocabulary). Every row is sampled on its own (its seed and output index), so
    the real rows' tokens do not depend on the tier. `drafts`: those the rows with a
    `draft_index` verify (`verify_drafts`). `static`: what is settled when compiled
    (`Static`; then every row is sampled, no tier picked on the device)."""
    s = raw_logits.shape[0]
    tiers = [t for t in ROW_TIERS if t < s]
    if num_rows is None or not tiers or static is not None:
        return _sample(raw_logits, p, history, drafts, static)

    def first(rows: int):
        def run(operands):
            out = _sample(*jax.tree.map(lambda a: a[:rows], operands), drafts)
            return jax.tree.map(
                lambda a: jnp.pad(a, [(0, s - rows)] + [(0, 0)] * (a.ndim - 1)), out)
        return run

    tier = jnp.searchsorted(jnp.asarray(tiers), num_rows)  # the first that holds them
    return jax.lax.switch(tier, [*map(first, tiers),
                                 lambda operands: _sample_in_chunks(*operands, drafts)],
                          (raw_logits, p, history))


def _sample_in_chunks(raw_logits: jax.Array, p: SamplingArrays, history: TokenHistory | None,
                      drafts: SampledDrafts | None) -> SampleOutput:
    """`_sample`, ROW_TIERS[-1] rows at a time (a loop), so the program's temporaries are
    those of a few rows: XLA:CPU allocates them afresh for every run, and glibc maps a
    block over 32 MiB anew each time, every page of it faulting on first touch (64 rows
    at a 49k vocabulary: 89 MB of temporaries, a greedy sample 4.3 ms, 1.1-1.6 ms without
    the faults). Rows are sampled independently, so the tokens do not change; logprobs
    are computed for the chunks where a row asks. Below CHUNK_ABOVE_BYTES of logits the
    loop costs more than it saves (16 rows: 0.49 against 0.39 ms)."""
    s, rows = raw_logits.shape[0], ROW_TIERS[-1]
    if s <= rows or s % rows or raw_logits.size * 4 <= CHUNK_ABOVE_BYTES:  # float32 bytes
        return _sample(raw_logits, p, history, drafts)

    def in_chunks(operands):
        chunks = jax.tree.map(lambda a: a.reshape(s // rows, rows, *a.shape[1:]), operands)
        out = jax.lax.map(lambda operands: _sample(*operands, drafts), chunks)
        return jax.tree.map(lambda a: a.reshape(s, *a.shape[2:]), out)

    if history is not None:
        return in_chunks((raw_logits, p, history))
    # A batch of untouched rows without logprobs writes no [S, V] temporaries when greedy,
    # or on a CPU with the native kernels (their cut and draw keep what they need): in one
    # piece (64 greedy rows at a 49k vocabulary: 1.1 -> 0.9 ms).
    whole = ~jnp.any(p.logprobs) & _untouched(p)
    if not _native_cpu():
        whole &= ~jnp.any(p.temperature > 0)
    return jax.lax.cond(whole, lambda operands: _sample(*operands, drafts), in_chunks,
                        (raw_logits, p, history))


def _untouched(p: SamplingArrays) -> jax.Array:
    """Whether no row has a grammar mask, a logit bias or banned tokens (bool scalar)."""
    return ~(jnp.any(p.grammar_mask != -1) | jnp.any(p.bias_ids >= 0)
             | jnp.any(p.banned_ids >= 0))


def _keys(p: SamplingArrays, ahead: int | jax.Array = 0, stream: int = 0) -> jax.Array:
    """Each row's key for its output number output_index + `ahead`; `stream` > 0 for
    randomness of its own that draw (the target's row) must not share."""
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
        p.seed, p.output_index + ahead)
    return keys if stream == 0 else jax.vmap(jax.random.fold_in, (0, None))(keys, stream)


def _uniform(keys: jax.Array) -> jax.Array:
    """One draw in (0, 1) per key."""
    return jnp.maximum(jax.vmap(jax.random.uniform)(keys), jnp.finfo(jnp.float32).tiny)


class Weights(NamedTuple):
    """Each row's sampling distribution, unnormalised (its maximum's weight 1), as a
    function of its logits: exp(l / temp - top) where l / temp is at or above the row's
    `cut` (top-k, top-p, min-p), else 0 (`sampling_weights`)."""

    temp: jax.Array  # [S]: a greedy row's taken as 1
    top: jax.Array  # [S]: the row's maximum of l / temp
    cut: jax.Array  # [S]

    def __call__(self, x: jax.Array) -> jax.Array:
        """The weights of `x` `[S, ...]`, row s of it from row s's logits."""
        rows = lambda a: a.reshape((-1,) + (1,) * (x.ndim - 1))  # noqa: E731
        scaled = x / rows(self.temp)
        return jnp.where(scaled >= rows(self.cut), jnp.exp(scaled - rows(self.top)), 0.0)


def sampling_weights(logits: jax.Array, p: SamplingArrays, sorts: bool | None = None,
                     top: jax.Array | None = None) -> Weights:
    """The rows' `Weights`: temperature, then top-k, top-p and min-p (`filter_cut`).
    `top`: the rows' maxima of `logits`, if the caller has them (the maximum of
    l / temp is theirs / temp: dividing by a positive number keeps the order, rounded
    too)."""
    temp = jnp.where(p.temperature > 0, p.temperature, 1.0)
    top = (row_max(logits) if top is None else top) / temp
    return Weights(temp, top, filter_cut(logits, p, top, sorts, temp))


def _weights(logits: jax.Array, p: SamplingArrays, sorts: bool | None = None) -> jax.Array:
    """The rows' sampling weights `[S, V]` (`sampling_weights`)."""
    return sampling_weights(logits, p, sorts)(logits)


def verify_drafts(weights: jax.Array, q: jax.Array, drafts: jax.Array, u: jax.Array,
                  u_residual: jax.Array) -> jax.Array:
    """Rejection sampling of drafts drawn from distributions `q` `[S, V]` by the rows'
    target distributions (`weights`, unnormalised): draft d is kept with probability
    min(1, p(d) / q(d)) (when `u` q(d) < p(d)); else the token is drawn (by `u_residual`)
    from the residual max(0, p - q), renormalised. Each token is then distributed as p
    whatever q is: P(x) = min(p, q)(x) + max(0, p - q)(x). A residual that is all zero
    (p = q up to rounding) keeps every draft but for rounding: p is drawn then. The
    residual never holds a rejected draft (p(d) > q(d) keeps it surely), so the token
    equals the draft exactly when it is kept."""
    p = weights / weights.sum(axis=-1, keepdims=True)
    p_d = jnp.take_along_axis(p, drafts[:, None], axis=-1)[:, 0]
    q_d = jnp.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
    residual = jnp.maximum(p - q, 0.0)
    residual = jnp.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)
    return jnp.where(u * q_d < p_d, drafts, inverse_cdf(residual, u_residual))


DRAFT_STREAM = 2  # a proposer's draws' keys (`_keys`); 1 is the residual's


def draw_drafts(logits: jax.Array, p: SamplingArrays, ahead: int | jax.Array,
                columns: jax.Array | None = None, vocab: int | None = None,
                sorts: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """A proposer's guess per row of its `logits` `[S, V]` for the row's output number
    output_index + `ahead`, and the distribution it is drawn from `[S, V]`: the argmax
    for a greedy row (its distribution unused: zeros when no row samples); for a sampled
    row a draw from the row's logit bias and banned tokens, temperature, top-k, top-p and
    min-p applied to the logits, as the target's row applies them (not its penalties,
    which need the history; and the bans are those of output_index, not of the later
    outputs a proposer's later rounds guess: a q that differs from p there changes how
    often the target keeps a guess, never what it outputs), with keys of their own
    (DRAFT_STREAM), so `verify_drafts` sees a draft independent of its own draws.
    `columns` `[V]`: the target's token id of each column, for a proposer with a
    vocabulary of its own (EAGLE-3's) within the target's `vocab`; None: the target's.
    `sorts` (as `Static.sorts`: settled by the host, where the programs are branch-free):
    every row's draw computed (greedy rows' distributions too), with top-k and top-p or
    without; None: on the device, by `lax.cond`s."""
    greedy = first_argmax(logits)

    def sampled(logits):
        weights = _weights(bias_and_ban_columns(logits, p, columns, vocab), p, sorts)
        drawn = inverse_cdf(weights, _uniform(_keys(p, ahead, DRAFT_STREAM)))
        probs = weights / weights.sum(axis=-1, keepdims=True)
        return jnp.where(p.temperature > 0, drawn, greedy), probs

    if sorts is not None:
        return sampled(logits)
    return jax.lax.cond(jnp.any(p.temperature > 0), sampled,
                        lambda logits: (greedy, jnp.zeros_like(logits)), logits)


def bias_and_ban_columns(logits: jax.Array, p: SamplingArrays, columns: jax.Array | None,
                         vocab: int | None) -> jax.Array:
    """`bias_and_ban` of logits whose column c is the target's token `columns[c]` (None:
    column c is token c)."""
    if columns is None:
        return bias_and_ban(logits, p)
    dense = bias_and_ban(jnp.zeros((logits.shape[0], vocab), logits.dtype), p)
    return logits + dense[:, columns]


def _sample(raw_logits: jax.Array, p: SamplingArrays, history: TokenHistory | None,
            drafts: SampledDrafts | None = None, static: Static | None = None
            ) -> SampleOutput:
    # The grammar mask rules tokens out whatever the bias adds (-inf plus a finite bias
    # stays -inf), so it goes first: its output is a new array, which the bias's scatter
    # then updates in place. (Mask last, XLA:CPU wrote the logits three times: a copy for
    # the scatter, the masked copy, and the masked raw logits for logprobs, which are now
    # made only when a row asks for them: 10-15 ms of a 64-row greedy sample, 4 ms after.)
    # The logits come in the model's dtype and are widened to float32 where they are
    # changed or weighed; a greedy pick of untouched rows reads them as they are.

    def adjusted(raw_logits):
        raw_logits = raw_logits.astype(jnp.float32)
        logits = bias_and_ban(apply_grammar_mask(raw_logits, p.grammar_mask), p)
        return logits if history is None else apply_penalties(logits, p, history)

    def draw_adjusted(logits):
        # One pass over the logits for the greedy pick, whose logit is the row's maximum;
        # one more for the weights' block totals.
        greedy_ids = first_argmax(logits)
        top = jnp.take_along_axis(logits, greedy_ids[:, None], axis=-1)[:, 0]
        weights = sampling_weights(logits, p, None if static is None else static.sorts, top)
        # Inverse CDF: the first token whose cumulative probability passes the row's one
        # uniform draw. Gumbel noise per token (argmax of logits + noise) picks from the same
        # distribution but costs 64 x 49k random numbers a step: ~6x the time on a CPU.
        u = _uniform(_keys(p))
        drawn = draw_from(logits, weights, u)
        if drafts is not None:  # rows verifying drawn drafts
            def verify(drawn):
                index = jnp.maximum(p.draft_index, 0)
                kept = verify_drafts(weights(logits), drafts.probs[index], drafts.ids[index],
                                     u, _uniform(_keys(p, stream=1)))
                return jnp.where(p.draft_index >= 0, kept, drawn)

            drawn = (verify(drawn) if static is not None else
                     jax.lax.cond(jnp.any(p.draft_index >= 0), verify, lambda x: x, drawn))
        return jnp.where(p.temperature > 0, drawn, greedy_ids)

    def draw(raw_logits):
        # As greedy's: untouched rows are drawn from their logits as they are (the mask's
        # select and the scatter: 0.9 ms of a 64 x 49152 draw on a CPU, 4.7 ms in all).
        if history is not None or static is not None:
            return draw_adjusted(adjusted(raw_logits))
        return jax.lax.cond(_untouched(p), lambda x: draw_adjusted(x.astype(jnp.float32)),
                            lambda x: draw_adjusted(adjusted(x)), raw_logits)

    def greedy(raw_logits):
        # A batch where no row has a grammar, a logit bias, banned tokens or penalties
        # takes the argmax of the raw logits: the mask's select and the scatter wrote the
        # whole [S, V] for nothing (256 rows at a 2048 vocabulary: 0.34 -> 0.28 ms on a CPU).
        if history is not None:
            return first_argmax(adjusted(raw_logits))
        return jax.lax.cond(_untouched(p), first_argmax, lambda x: first_argmax(adjusted(x)),
                            raw_logits)

    if static is not None:  # each row's draw and greedy pick, each row taking its own
        token_ids = draw(raw_logits)
    else:
        token_ids = jax.lax.cond(jnp.any(p.temperature > 0), draw, greedy, raw_logits)
    s, k = raw_logits.shape[0], min(MAX_LOGPROBS, raw_logits.shape[1])

    def with_logprobs(_):  # of the model's distribution as the grammar mask leaves it
        logprobs = jax.nn.log_softmax(
            apply_grammar_mask(raw_logits.astype(jnp.float32), p.grammar_mask), axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
        chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_logprobs

    def without(_):  # nobody asked: skip a softmax and a top-k over the vocabulary
        return (jnp.zeros(s, jnp.float32), jnp.zeros((s, k), jnp.int32),
                jnp.zeros((s, k), jnp.float32))

    if static is not None:
        chosen, top_ids, top_logprobs = (with_logprobs if static.logprobs else without)(None)
    else:
        chosen, top_ids, top_logprobs = jax.lax.cond(jnp.any(p.logprobs), with_logprobs,
                                                     without, None)
    return SampleOutput(token_ids, chosen, top_ids, top_logprobs)


# A token the grammar mask rules out has logprob -inf: given as -9999 (as vLLM does), so it
# stays a JSON number.
MIN_LOGPROB = -9999.0


def _entries(token: int, logprob, rank, top_ids, top_logprobs, n: int
             ) -> dict[int, Logprob]:
    """The `n` most likely tokens with their logprobs and ranks, and `token`'s (first,
    when it is not among them; `rank` a function giving its rank then)."""
    top = {int(t): Logprob(max(float(lp), MIN_LOGPROB), rank=r + 1)
           for r, (t, lp) in enumerate(zip(top_ids[:n], top_logprobs[:n]))}
    if token not in top:
        top = {token: Logprob(max(float(logprob), MIN_LOGPROB), rank=rank()), **top}
    return top


def prompt_token_logprobs(score: tuple, token: int, n: int) -> dict[int, Logprob]:
    """A prompt token's entry of prompt_logprobs from its score (logprob, rank, top ids,
    top logprobs: Request.prompt_scores)."""
    logprob, rank, top_ids, top_logprobs = score
    return _entries(token, logprob, lambda: rank, top_ids, top_logprobs, n)


def token_logprobs(out: SampleOutput, i: int, token: int, n: int) -> dict[int, Logprob]:
    """Row `i`'s entry for its sampled `token` (its rank known when among the top 20)."""
    top_ids = out.top_ids[i]
    return _entries(token, out.logprob[i],
                    lambda: next((r + 1 for r, t in enumerate(top_ids) if t == token), None),
                    top_ids, out.top_logprobs[i], n)
