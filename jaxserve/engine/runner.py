"""The jitted step and the device state it runs on: parameters, KV cache, compiled buckets."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxserve.config import ModelConfig
from jaxserve.engine.batch import BatchBuilder, BucketKey, Carry, StepBatch
from jaxserve.engine.broadcast import FORWARD, SAMPLE, STEP
from jaxserve.engine.compile_cache import counting_hits
from jaxserve.engine.executable_cache import ExecutableCache, one_device
from jaxserve.engine.sampler import (
    SampledDrafts, SampleOutput, SamplingArrays, TokenHistory, draw_drafts, first_argmax,
    sample)
from jaxserve.models.medusa import MedusaHeads, medusa_tokens
from jaxserve.models.parallel import KV_CACHE_AXES
from jaxserve.models.transformer import AttentionMetadata, KVCache, kv_cache_layout
from sharding.rules import ShardingContext

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_GIB = 1.0
FEATURE_AXES = ("pages", None)  # an EAGLE feature cache [slots, F]: split as the pages are


def forward(graphdef: nnx.GraphDef, params: nnx.State, kv_caches: KVCache, batch: StepBatch,
            prev_tokens: jax.Array, expert_load: jax.Array | None,
            medusa: MedusaHeads | None = None, features: jax.Array | None = None, *,
            features_from: tuple[int, ...] = (), carry: Carry, page_size: int,
            verifies: bool = True) -> tuple[KVCache, jax.Array, jax.Array | None,
                                            jax.Array | None, jax.Array | None, jax.Array]:
    """One forward pass over a ragged batch: float32 logits `[R, vocab]` at the tokens the
    batch samples (`batch.sample_index`: each sequence's last token, and the tokens
    before it that verify drafts).

    `prev_tokens` (laid out as `carry` says) holds the previous step's sampled tokens,
    then a proposer's guesses, still on the device: tokens with `batch.prev_index >= 0`
    take their id from there, so the host can schedule this step before it has seen
    them (and sequences whose pending step rejected drafts move back: `resolve_pending`;
    a program for buckets without drafts, `verifies` False, has none: BatchBuilder.build).
    `expert_load` (`[sparse layers,
    num_experts]`, None for a dense model) counts the real tokens each expert has taken
    since start; returned with this step's added. `medusa`: Medusa heads, whose guesses
    `[R, heads, top]` at the sampled rows come back fourth when `batch.propose` (zeros when
    not; None without heads). `features`: an EAGLE head's feature cache (`[slots, F]`, see
    `write_features`), returned with every real token's features (the layers
    `features_from`, Transformer.__call__) written at its KV slot; None without a head.
    Last, the token id at each sampled row `[R]` (the sampling records the acceptance of
    drafts from them: `record_acceptance`).
    """
    model = nnx.merge(graphdef, params)
    input_ids, batch = resolve_pending(batch, prev_tokens, carry, page_size, verifies)
    (hidden, kv_caches, new_features), sown = nnx.capture(model.run, nnx.Intermediate)(
        input_ids, batch.positions, kv_caches, batch.attn, expert_load is not None,
        features_from)
    if expert_load is not None:  # MoE layers' counts, in layer order
        sown = sorted(nnx.to_flat_state(sown), key=lambda kv: kv[0])
        counts = [v.get_value()[0] for _, v in sown]
        expert_load = expert_load + jnp.stack(counts)
    data_shards = batch.attn.num_seqs.shape[0]
    rows = sampled_rows(hidden, batch.sample_index, data_shards)
    # In the matmul's dtype: the sampler widens only the rows it samples (a 1-sequence
    # prefill in a 64-row bucket converted 64 rows of a 49k vocabulary: 1.2 ms on a CPU).
    logits = model.logits(rows, rows=batch.num_rows[0] if data_shards == 1 else None,
                          dtype=None)
    guesses = None
    if medusa is not None:
        guesses = jax.lax.cond(
            batch.propose, lambda: medusa_tokens(model.final_norm(rows), medusa),
            lambda: jnp.zeros((rows.shape[0], medusa.lm_heads.shape[0], medusa.top),
                              jnp.int32))
    if features is not None:
        features = write_features(features, new_features, batch.attn.slot_mapping, data_shards)
    row_tokens = jnp.take_along_axis(input_ids.reshape(data_shards, -1),
                                     batch.sample_index.reshape(data_shards, -1), 1)
    return kv_caches, logits, expert_load, guesses, features, row_tokens.reshape(-1)


def resolve_pending(batch: StepBatch, prev_tokens: jax.Array, carry: Carry, page_size: int,
                    move_back: bool = True) -> tuple[jax.Array, StepBatch]:
    """The batch's input ids, those still on the device (`batch.prev_index`) read from
    `prev_tokens`; and the batch with every sequence whose pending step rejected drafts
    (`batch.shift_row`, the `carry.rejected` block) moved back by as many positions: its
    tokens' positions and KV slots (from its page table) and its KV length. The host
    counted all of that step's drafts as accepted when it laid the batch out; a
    sequence's tokens here all follow them. Without `carry.overlap` or `move_back`, only
    the ids."""
    input_ids = jnp.where(batch.prev_index >= 0,
                          prev_tokens[jnp.maximum(batch.prev_index, 0)], batch.input_ids)
    if not (carry.overlap and move_back):
        return input_ids, batch
    meta = batch.attn
    d, t, s = meta.num_seqs.shape[0], input_ids.shape[0], meta.kv_lens.shape[0]
    rejected = jnp.where(batch.shift_row >= 0,
                         prev_tokens[carry.rejected + jnp.maximum(batch.shift_row, 0)], 0)
    # Each real token's sequence, within its data shard's block of tokens and sequences.
    cu = meta.cu_q_lens.reshape(d, -1)
    local = jnp.arange(t // d)
    seq = jax.vmap(lambda c: jnp.searchsorted(c[1:], local, side="right",
                                              method="compare_all"))(cu)
    real = local[None, :] < jnp.take_along_axis(cu, meta.num_seqs[:, None], 1)
    seq = (jnp.minimum(seq, s // d - 1) + (jnp.arange(d) * (s // d))[:, None]).reshape(-1)
    back = jnp.where(real.reshape(-1), rejected[seq], 0)
    positions = batch.positions - back
    slots = jnp.where(back > 0, position_slots(meta.page_indices[seq], positions, page_size),
                      meta.slot_mapping)
    attn = dataclasses.replace(meta, slot_mapping=slots, kv_lens=meta.kv_lens - rejected)
    return input_ids, dataclasses.replace(batch, positions=positions, attn=attn)


def shift_sampling(sampling: SamplingArrays, prev_tokens: jax.Array, carry: Carry
                   ) -> SamplingArrays:
    """The rows of sequences whose pending step rejected drafts sample output numbers as
    many lower (`resolve_pending`)."""
    if not carry.overlap:
        return sampling
    back = jnp.where(sampling.shift_row >= 0,
                     prev_tokens[carry.rejected + jnp.maximum(sampling.shift_row, 0)], 0)
    return dataclasses.replace(sampling, output_index=sampling.output_index - back)


def record_acceptance(prev_tokens: jax.Array, token_ids: jax.Array, row_tokens: jax.Array,
                      group_drafts: jax.Array, carry: Carry, verifies: bool = True
                      ) -> jax.Array:
    """`prev_tokens` with the step's acceptance of its chains written in `carry`'s blocks
    at each sequence's first row r (`group_drafts[r]` drafts, verified by rows r..r+k):
    its drafts accepted a are the leading rows whose sample equals the token at the row
    after (the draft it verifies; the host's rule, token_tree.accepted_path); it emits
    the samples of rows r..r+a, the last (`bonus`) after the token at row r+a (`last`),
    and rejects k - a drafts. A step without drafts (`verifies` False) emits each row's
    sample after its token, and leaves `rejected` as it was: the builder moves back only
    sequences whose pending step had drafts."""
    r = token_ids.shape[0]
    if not verifies:
        return (prev_tokens.at[carry.bonus:carry.bonus + r].set(token_ids)
                .at[carry.last:carry.last + r].set(row_tokens))
    rows = jnp.arange(r)
    at = lambda x, i: x[jnp.minimum(i, r - 1)]  # noqa: E731
    accepted, run = jnp.zeros(r, jnp.int32), jnp.ones(r, jnp.bool_)
    for j in range(carry.k):
        run = run & (j < group_drafts) & (at(token_ids, rows + j) == at(row_tokens, rows + j + 1))
        accepted = accepted + run
    end = jnp.minimum(rows + accepted, r - 1)
    return (prev_tokens.at[carry.bonus + rows].set(token_ids[end])
            .at[carry.last + rows].set(row_tokens[end])
            .at[carry.rejected + rows].set(group_drafts - accepted))


def position_slots(page_indices: jax.Array, positions: jax.Array, page_size: int
                   ) -> jax.Array:
    """The KV slot of each row's position in its page table (`[N, pages]`, `[N]`), on the
    device; positions past the table read its last page (callers mask those writes)."""
    page = jnp.minimum(positions // page_size, page_indices.shape[1] - 1)
    return (jnp.take_along_axis(page_indices, page[:, None], 1)[:, 0] * page_size
            + positions % page_size)


def global_slots(slots: jax.Array, num_slots: int, data_shards: int) -> jax.Array:
    """Each token's KV slot (within its data shard's pool of `num_slots`) as an index into
    all shards' slots together; padding tokens' (out of their pool) are out of range."""
    shard = jnp.arange(slots.shape[0]) // (slots.shape[0] // data_shards)
    return jnp.where(slots < num_slots, shard * num_slots + slots, data_shards * num_slots)


def write_features(cache: jax.Array, features: jax.Array, slots: jax.Array,
                   data_shards: int) -> jax.Array:
    """The feature cache `[D x slots, F]` (one row per KV slot of every data shard's pool,
    sharded as the pages are) with `features` `[T, F]` written at the tokens' slots;
    padding tokens write nothing."""
    index = global_slots(slots, cache.shape[0] // data_shards, data_shards)
    return cache.at[index].set(features.astype(cache.dtype), mode="drop")


def sample_step(logits: jax.Array, sampling: SamplingArrays, history: TokenHistory | None,
                prev_tokens: jax.Array, num_rows: jax.Array, draft_probs: jax.Array | None,
                row_tokens: jax.Array, *, carry: Carry, verifies: bool = True
                ) -> tuple[SampleOutput, jax.Array]:
    """Sample one token per row; returns them also written into `prev_tokens` (laid out as
    `carry` says: its first rows, and with `carry.overlap` the acceptance of the step's
    chains, `record_acceptance`, from the forward pass's `row_tokens`), where the next
    step reads its PLACEHOLDER tokens.
    `num_rows` (the batch's real rows per data shard) lets one shard's batch sample its
    real rows only (under data parallelism each shard's rows are a block of their own:
    all rows). `draft_probs` (BatchBuilder.sampled_drafts; else None): the distributions
    the guesses in `prev_tokens` were drawn from, in their order. `verifies` False: a
    bucket without drafts (no sequence of it moves back, none verifies)."""
    drafts = None
    if draft_probs is not None:
        drafts = SampledDrafts(
            prev_tokens[carry.guesses_end - draft_probs.shape[0]:carry.guesses_end],
            draft_probs)
    if verifies:
        sampling = shift_sampling(sampling, prev_tokens, carry)
    out = sample(logits, sampling, history, num_rows[0] if num_rows.shape[0] == 1 else None,
                 drafts)
    n = min(out.token_ids.shape[0], carry.guesses_end)
    prev_tokens = prev_tokens.at[:n].set(out.token_ids[:n])
    if carry.overlap:
        prev_tokens = record_acceptance(prev_tokens, out.token_ids, row_tokens,
                                        sampling.group_drafts, carry, verifies)
    return out, prev_tokens


def next_decode(batch: StepBatch, token_ids: jax.Array, page_size: int) -> StepBatch:
    """The decode batch after `batch` (every sequence one token, row r of data shard d
    sequence r of d, as BatchBuilder lays a batch without drafts out): each real row's
    sample `token_ids[r]` as its sequence's token, one position later (its KV slot from
    the page table, one more KV token), sampling the next output number."""
    meta, s = batch.attn, batch.sampling
    d, t, r = meta.num_seqs.shape[0], batch.input_ids.shape[0], token_ids.shape[0]
    shard = jnp.arange(r) // (r // d)
    real = jnp.arange(r) % (r // d) < batch.num_rows[shard]
    token = jnp.where(real, shard * (t // d) + batch.sample_index, t)  # t: dropped
    positions = batch.positions.at[token].add(1, mode="drop")
    row_positions = positions[jnp.minimum(token, t - 1)]
    slots = meta.slot_mapping.at[token].set(
        position_slots(meta.page_indices, row_positions, page_size), mode="drop")
    attn = dataclasses.replace(meta, slot_mapping=slots, kv_lens=meta.kv_lens + real)
    sampling = dataclasses.replace(s, output_index=s.output_index + real)
    return dataclasses.replace(
        batch, input_ids=batch.input_ids.at[token].set(token_ids, mode="drop"),
        positions=positions, attn=attn, sampling=sampling,
        prev_index=jnp.full_like(batch.prev_index, -1))


def decode_steps(graphdef: nnx.GraphDef, params: nnx.State, kv_caches: KVCache,
                 batch: StepBatch, prev_tokens: jax.Array, expert_load: jax.Array | None,
                 num_steps: jax.Array, *, steps: int, carry: Carry, page_size: int
                 ) -> tuple[KVCache, SampleOutput, jax.Array, jax.Array | None]:
    """`num_steps` (<= `steps`) decode steps of a batch of decoding sequences in one
    program: each a forward pass and its sampling (`forward`, `sample_step`), the next
    feeding each sequence its sample (`next_decode`). The host gives every sequence pages
    for all of them and reads the tokens back once (Engine: `num_scheduler_steps`);
    outputs are `[steps, R]` (step i's samples at i; those past `num_steps` zeros), the
    last step's samples in `prev_tokens` as after one step."""
    def one(kv, batch, prev, load):
        inputs = dataclasses.replace(batch, sampling=None, history=None)
        kv, logits, load, _, _, row_tokens = forward(
            graphdef, params, kv, inputs, prev, load, carry=carry, page_size=page_size,
            verifies=False)
        out, prev = sample_step(logits, batch.sampling, None, prev, batch.num_rows, None,
                                row_tokens, carry=carry, verifies=False)
        return kv, out, prev, load

    out = jax.eval_shape(one, kv_caches, batch, prev_tokens, expert_load)[1]
    outs = jax.tree.map(lambda x: jnp.zeros((steps, *x.shape), x.dtype), out)

    def step(i, state):
        kv, batch, prev, load, outs = state
        kv, out, prev, load = one(kv, batch, prev, load)
        outs = jax.tree.map(lambda acc, x: acc.at[i].set(x), outs, out)
        return kv, next_decode(batch, out.token_ids, page_size), prev, load, outs

    kv_caches, _, prev_tokens, expert_load, outs = jax.lax.fori_loop(
        0, num_steps, step, (kv_caches, batch, prev_tokens, expert_load, outs))
    return kv_caches, outs, prev_tokens, expert_load


def write_guesses(prev_tokens: jax.Array, guesses: jax.Array, carry: Carry) -> jax.Array:
    """`prev_tokens` with a proposer's guesses `[R, S]` written where `carry` keeps them:
    guess j of row r at max_num_seqs x (1 + j) + r (`Sequence.draft_prev_index`)."""
    r, s = guesses.shape
    block = jnp.zeros((r, carry.max_num_seqs), jnp.int32).at[:, :s].set(guesses)
    return jax.lax.dynamic_update_slice(prev_tokens, block.reshape(-1), (carry.max_num_seqs,))


def round_guesses(logits: jax.Array, sampling: SamplingArrays | None, j: int | jax.Array,
                  probs: jax.Array | None, max_num_seqs: int, to_target=lambda ids: ids
                  ) -> tuple[jax.Array, jax.Array | None]:
    """A proposer's round j + 1 (`j` 0-based) over its `logits` `[S, V']`: each row's
    guess as a target token id (`to_target` maps a draft vocabulary's), and `probs` (the
    target's `draft_probs`; None: every guess greedy) with the guesses' distributions
    (sampler.draw_drafts, spread over the target's vocabulary) at rows
    max_num_seqs x j + r."""
    if probs is None:
        return to_target(first_argmax(logits)), None
    vocab = probs.shape[1]
    columns = None if logits.shape[1] == vocab else to_target(jnp.arange(logits.shape[1]))
    ids, q = draw_drafts(logits, sampling, j, columns, vocab)
    if columns is not None:  # a draft vocabulary's
        q = jnp.zeros((q.shape[0], vocab), q.dtype).at[:, columns].set(q)
    return to_target(ids), jax.lax.dynamic_update_slice(probs, q, (max_num_seqs * j, 0))


def seqs_as_tokens(meta: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
    """For a proposer's later rounds, one token per sequence (token i is sequence i's,
    each data shard's a block): their `cu_q_lens`, and which sequences are real."""
    d, s = meta.num_seqs.shape[0], meta.kv_lens.shape[0]
    cu = jnp.minimum(jnp.arange(s // d + 1)[None, :], meta.num_seqs[:, None]).reshape(-1)
    return cu, (jnp.arange(s) % (s // d)) < jnp.repeat(meta.num_seqs, s // d)


def round_metadata(meta: AttentionMetadata, j: int | jax.Array, limits: jax.Array,
                   page_size: int, drop_slot: int) -> tuple[jax.Array, AttentionMetadata]:
    """Round j + 1 of a proposer whose round 1 attended `meta` (each sequence's last token
    at kv_lens - 1): each sequence's token at position kv_lens - 1 + j, seeing those
    before it, its K/V written where `j <= limits[i]` (the pages it holds). Returns the
    positions and the metadata."""
    cu, real = seqs_as_tokens(meta)
    pos = meta.kv_lens - 1 + j
    slots = position_slots(meta.page_indices, pos, page_size)
    return pos, AttentionMetadata(
        slot_mapping=jnp.where(real & (j <= limits), slots, drop_slot), cu_q_lens=cu,
        kv_lens=jnp.where(real, meta.kv_lens + j, 0), page_indices=meta.page_indices,
        num_seqs=meta.num_seqs)


def sampled_rows(hidden: jax.Array, sample_index: jax.Array, data_shards: int) -> jax.Array:
    """The hidden states of the tokens the batch samples, `[R, hidden]`, taken within each
    data shard's block of tokens (so no shard reads another's)."""
    blocks = hidden.reshape(data_shards, -1, hidden.shape[-1])
    index = sample_index.reshape(data_shards, -1)
    return jnp.take_along_axis(blocks, index[:, :, None], axis=1).reshape(-1, hidden.shape[-1])


def move_slots(kv_caches: KVCache, features: jax.Array | None, src: jax.Array,
               dst: jax.Array) -> tuple[KVCache, jax.Array | None]:
    """Every layer's K/V (and an EAGLE feature cache's rows) copied from slots `src` to
    slots `dst` of one data shard's pool, all read before any is written; a `dst` out of
    the pool copies nothing. After a tree step (engine/token_tree.py): the accepted nodes'
    into the slots of their positions."""
    def move(x):  # [heads, pages, page_size, ...]
        flat = x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])
        return flat.at[:, dst].set(flat[:, src], mode="drop").reshape(x.shape)

    kv_caches = [tuple(move(x) for x in layer) for layer in kv_caches]
    if features is not None:
        features = features.at[dst].set(features[src], mode="drop")
    return kv_caches, features


class StepPrograms(NamedTuple):
    """The jitted programs of a step: its `forward` pass (KV cache and logits, which stay
    on the device), then `sample_step`. Every step runs both; a step whose sampling waits
    for the host (penalties, grammars: see `Engine.step`) dispatches the second later.
    `move` (`move_slots` per device) runs after a step whose trees accepted nodes outside
    the slots of their positions.
    (One program for both measured slower on a CPU: a 64-sequence bucket's prefill step
    27-34 ms against 23 ms for the two, one decode step alike, and workload (b) of
    benchmarks/offline_throughput.py 747-799 against 800-834 tokens/s, bf16.)"""

    forward: dict[bool, Callable]  # by `verifies` (ModelRunner.programs)
    sample: dict[bool, Callable]
    move: Callable
    steps: Callable | None = None  # `decode_steps` (None: one step per program)


def on_param_leaves(graphdef: nnx.GraphDef, params, fn: Callable) -> Callable:
    """`fn(graphdef, params, *args)` as a function of the parameters' flat list of leaves
    (`jax.tree.leaves(params)`; `params` may be abstract): flattening an nnx.State on every
    call costs the host ~1 µs per parameter."""
    treedef = jax.tree.structure(params)
    return lambda leaves, *args: fn(graphdef, jax.tree.unflatten(treedef, leaves), *args)


def jit_programs(graphdef: nnx.GraphDef, params, cache_shardings, shard: ShardingContext,
                 carry: Carry, page_size: int, features_from: tuple[int, ...] = (),
                 medusa: MedusaHeads | None = None, max_decode_steps: int = 1) -> StepPrograms:
    """The programs, jitted with fixed layouts in and out (params, KV cache and Medusa
    heads as given, logits as the model leaves them, batch and samples replicated, an
    EAGLE feature cache split as the pages are), so the donated caches and params never
    reshard. They take the parameters as their flat list of leaves (`on_param_leaves`)."""
    param_shardings = [x.sharding for x in jax.tree.leaves(params)]
    replicated = shard.sharding(())
    logits_sharding = shard.sharding(("seqs", "vocab"))
    features = shard.sharding(FEATURE_AXES)
    heads = jax.tree.map(lambda x: x.sharding, medusa) if medusa is not None else replicated
    inputs = (param_shardings, cache_shardings, replicated, replicated, replicated, heads,
              features)
    slots = shard.rules.spec(("pages",))  # each data shard's moves, a block of its own
    move = move_slots
    if shard.mesh.size > 1:  # every device moves its own pages' slots of its own heads
        specs = lambda tree: jax.tree.map(lambda x: x.spec, tree)  # noqa: E731
        io = (specs(cache_shardings), features.spec if features_from else None)
        move = jax.shard_map(move_slots, mesh=shard.mesh, check_vma=False,
                             in_specs=(*io, slots, slots), out_specs=io)

    def jitted(verifies: bool) -> tuple[Callable, Callable]:
        step = functools.partial(forward, features_from=features_from, carry=carry,
                                 page_size=page_size, verifies=verifies)
        return (jax.jit(on_param_leaves(graphdef, params, step), donate_argnums=(1, 6),
                        in_shardings=inputs,
                        out_shardings=(cache_shardings, logits_sharding, replicated,
                                       replicated, features, replicated)),
                jax.jit(functools.partial(sample_step, carry=carry, verifies=verifies),
                        in_shardings=(logits_sharding, replicated, replicated, replicated,
                                      replicated, replicated, replicated),
                        out_shardings=(replicated, replicated)))

    verify = jitted(True)
    plain = jitted(False) if carry.overlap else verify  # else `verifies` changes nothing
    steps = None
    if max_decode_steps > 1:
        # XLA's loop-invariant code motion would hoist the embedding gather's widening of
        # the whole bf16 table to float32 out of the loop: a copy of it every call
        # (smollm2-135m: 113 MB; one step 21 ms instead of 9.5).
        steps = jax.jit(
            on_param_leaves(graphdef, params, functools.partial(
                decode_steps, steps=max_decode_steps, carry=carry, page_size=page_size)),
            donate_argnums=(1,), in_shardings=inputs[:3] + (replicated,) * 3,
            out_shardings=(cache_shardings, replicated, replicated, replicated),
            compiler_options={"xla_disable_hlo_passes": "while-loop-invariant-code-motion"})
    return StepPrograms(
        forward={False: plain[0], True: verify[0]}, sample={False: plain[1], True: verify[1]},
        move=jax.jit(move, donate_argnums=(0, 1),
                     in_shardings=(cache_shardings, features, replicated, replicated),
                     out_shardings=(cache_shardings, features)),
        steps=steps)


def kv_page_bytes(cfg: ModelConfig, page_size: int, kv_dtype,
                  shard: ShardingContext | None = None) -> int:
    """Bytes of one page across all layers: K and V, and their scales when quantized.
    With `shard`, the bytes one device holds of it (its share of the cache heads)."""
    replicas = shard.rules.kv_head_replicas if shard else 1
    split = shard.axis_size(shard.rules.spec(KV_CACHE_AXES)[0]) if shard else 1
    layer = kv_cache_layout(cfg, 1, page_size, kv_dtype, replicas)
    return cfg.num_layers * sum(int(np.prod(shape)) * jnp.dtype(dtype).itemsize
                                for shape, dtype, _ in layer) // split


def abstract_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, kv_dtype,
                      shard: ShardingContext) -> list[tuple[jax.ShapeDtypeStruct, ...]]:
    """The KV cache's shapes, dtypes and shardings (`num_pages` in all data shards),
    allocating nothing."""
    layout = kv_cache_layout(cfg, num_pages, page_size, kv_dtype, shard.rules.kv_head_replicas)
    layer = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=shard.sharding(axes))
                  for shape, dtype, axes in layout)
    return [layer] * cfg.num_layers


def pool_size(page_bytes: int, pages_needed: int, memory_gib: float | None,
              utilization: float, device, reserved: int = 0) -> int:
    """Pages that fit the memory budget, at most what max_num_seqs full contexts can use.

    The budget is `memory_gib` if given, else `utilization` of the device's free memory
    (accelerators) less `reserved` bytes (arrays allocated beside the pool), else
    DEFAULT_CPU_KV_GIB (CPU reports no memory limit).
    """
    if memory_gib is not None:
        budget = memory_gib * 2**30
    else:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and "bytes_limit" in stats:
            budget = (stats["bytes_limit"] * utilization - stats.get("bytes_in_use", 0)
                      - reserved)
        else:
            budget = DEFAULT_CPU_KV_GIB * 2**30
    return max(0, min(int(budget // page_bytes), pages_needed))


class ModelRunner:
    """Owns params and KV cache on device; runs the step for one bucket-padded batch,
    whole (`dispatch`) or in two halves (`dispatch_forward`, then `dispatch_sample`)."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, shard: ShardingContext,
                 builder: BatchBuilder, cfg: ModelConfig, kv_dtype, broadcaster=None,
                 medusa: MedusaHeads | None = None, features_from: tuple[int, ...] = (),
                 decode_steps: int = 1):
        self.graphdef = graphdef
        self.params = params
        self._param_leaves = jax.tree.leaves(params)
        self.shard = shard
        self.builder = builder
        abstract = abstract_kv_cache(cfg, builder.num_pages * builder.data_shards,
                                     builder.page_size, kv_dtype, shard)
        self._abstract_kv = abstract
        self.kv_caches: KVCache = self.zeros(self._abstract_kv)
        # An EAGLE head's inputs: the layers `features_from` (Transformer.__call__) of every
        # token computed, at its KV slot (`write_features`); None without a head.
        self.features_from = features_from
        self.features: jax.Array | None = None
        if features_from:
            dtype = jax.tree.leaves(params)[0].dtype
            self._abstract_features = jax.ShapeDtypeStruct(
                (abstract[0][0].shape[1] * builder.page_size,
                 len(features_from) * cfg.hidden_size), dtype,
                sharding=shard.sharding(FEATURE_AXES))
            self.features = self.zeros(self._abstract_features)
        # Decode steps a program may run (`dispatch_steps`; 1: one step per program).
        self.decode_steps = decode_steps
        self._programs = jit_programs(graphdef, params,
                                      jax.tree.map(lambda x: x.sharding, abstract), shard,
                                      builder.carry, builder.page_size, features_from, medusa,
                                      decode_steps)
        # Programs compiled, by (program, shape): ("forward", T, S, R, tree, verifies),
        # ("sample", R, history, verifies), ("move",) (`programs`),
        # ("steps", T, S, decode_steps) (`steps_program`).
        self._executables: dict[tuple, Callable] = {}
        self._cache = ExecutableCache.for_process(repr((str(graphdef), features_from)))
        self._from_cache = 0  # programs the caches gave
        self.warmed_up = False
        self.compiles_after_warmup = 0
        self.programs_from_cache = 0
        # Multi-host, process 0: sends each step to the other processes (broadcast.py).
        self.broadcaster = broadcaster
        replicated = shard.sharding(())
        self._open_masks: dict[int, jax.Array] = {}  # BatchBuilder.open_mask, on the device
        # The last step's sampled tokens, on the device (see `forward`), then room for a
        # proposer's guesses and the acceptance of drafts (BatchBuilder.carry).
        self.sampled = jax.device_put(np.zeros(builder.carry.size, np.int32), replicated)
        # With sampled drafts (BatchBuilder.sampled_drafts), the distributions a proposer
        # drew those in `sampled` from, draft j of row r at max_num_seqs x j + r; written
        # by the proposer's program, read by the step's sampling.
        self._abstract_draft_probs = jax.ShapeDtypeStruct(
            (builder.max_num_seqs * builder.num_speculative_tokens, builder.vocab_size),
            jnp.float32, sharding=replicated)
        self.draft_probs = (self.zeros(self._abstract_draft_probs) if builder.sampled_drafts
                            else None)
        self._logits: jax.Array | None = None  # from dispatch_forward, for dispatch_sample
        self._row_tokens: jax.Array | None = None  # likewise (forward's last output)
        self._logits_dtype = None  # the forward pass's logits' (warm-up samples zeros of it)
        self.medusa = medusa  # Medusa heads (device arrays), or None
        self.guesses: jax.Array | None = None  # the last forward pass's Medusa guesses
        # Real tokens each expert of each MoE layer has taken since start (None: dense).
        # Replaced, not donated, each step, so another thread may read any copy.
        layers = sum(cfg.sparse_layers)
        self.expert_load = (jax.device_put(np.zeros((layers, cfg.num_experts), np.int32),
                                           replicated) if layers else None)

    @staticmethod
    def zeros(abstract):
        """Arrays of zeros shaped, typed and placed as the pytree of ShapeDtypeStructs
        `abstract`, made by one program: a program per array cost a warm start 0.7 s of
        tracing and cache lookups for a 30-layer KV cache."""
        return jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract),
                       out_shardings=jax.tree.map(lambda x: x.sharding, abstract))()

    def recover(self) -> bool:
        """After a failed step: if it consumed the donated KV cache (or the last samples),
        make new ones. Returns whether the KV cache was lost (every page's content)."""
        self._logits = None
        lost = any(x.is_deleted() for layer in self.kv_caches for x in layer)
        if self.features is not None and self.features.is_deleted():
            self.features, lost = self.zeros(self._abstract_features), True
        if lost:
            self.kv_caches = self.zeros(self._abstract_kv)
        if self.sampled.is_deleted():
            self.sampled = jax.device_put(np.zeros(self.builder.carry.size, np.int32),
                                          self.shard.sharding(()))
        if self.draft_probs is not None and self.draft_probs.is_deleted():
            self.draft_probs = self.zeros(self._abstract_draft_probs)
        return lost

    def programs(self, key: BucketKey) -> list[tuple]:
        """The programs a bucket's steps run: its forward pass and its sampling. Where
        steps with drafts run async (`Carry.overlap`), a bucket without drafts has programs
        of its own (`verifies` False) that neither move sequences back nor search for
        accepted drafts: they cost a draft model's plain steps (speculation turned off for
        a large batch, prefills) what speculation off's do."""
        verifies = bool(key.drafts) or not self.builder.carry.overlap
        return [("forward", key.tokens, key.seqs, key.rows, key.tree, verifies),
                ("sample", key.rows, key.history, verifies)]

    def warmup(self, progress: bool = True) -> None:
        """Compile every program of every bucket now, so nothing compiles while serving,
        and run each once on an all-padding batch (which writes and samples nothing a
        request sees; a tree's `move` copies nothing). The progress bar counts the
        programs read from the caches (executable_cache.py, compile_cache.py)."""
        todo, seen = [], set(self._executables)
        for key in self.builder.all_buckets():
            for program in self.programs(key):
                if program not in seen:
                    seen.add(program)
                    todo.append((key, program))
        if self.builder.tree and ("move",) not in seen:
            todo.append((None, ("move",)))
        for key in self.builder.decode_buckets() if self.decode_steps > 1 else ():
            if self.steps_program(key) not in seen:
                todo.append((key, self.steps_program(key)))
        bar = tqdm(todo, desc="compiling step programs", unit="program",
                   disable=not progress or not todo)
        before = self._from_cache
        for key, program in bar:
            if program[0] == "forward":
                self._forward(self.builder.empty(key), program)
            elif program[0] == "steps":
                self.dispatch_steps(self.builder.empty(key), key, 1)
            elif program[0] == "sample":
                self._logits = jax.device_put(
                    np.zeros((key.rows, self.builder.vocab_size), self._logits_dtype),
                    self.shard.sharding(("seqs", "vocab")))
                self._row_tokens = jax.device_put(np.zeros(key.rows, np.int32),
                                                  self.shard.sharding(()))
                self._sample(self.builder.empty(key), program)
            else:
                self._move(*self.moves([]))
            bar.set_postfix_str(f"{self._from_cache - before} from cache")
        jax.block_until_ready(self.sampled)
        self.programs_from_cache = self._from_cache - before
        if todo:
            log.info("step programs: %d compiled, %d read from the compilation cache",
                     len(todo) - self.programs_from_cache, self.programs_from_cache)
        self.warmed_up = True

    def _run(self, program: tuple, fn: Callable, args: tuple):
        """`fn(*args)` (a program of StepPrograms), compiled once per program. In a process
        with one device it runs as a compiled program from the executable cache; with more
        (a mesh, or one device of several) through `fn`, the jit, which places host arrays
        where the program expects them (a compiled program called with them failed on 8
        emulated devices: "Expected args ... to have 8 shards")."""
        executable = self._executables.get(program)
        if executable is not None:
            return executable(*args)
        if self.warmed_up:
            self.compiles_after_warmup += 1
            log.warning("compiling %s after warm-up: a bucket is missing", program)
        if not one_device():
            with counting_hits() as events:
                out = fn(*args)
            executable, cached = fn, events.hits > 0
        else:
            executable, cached = self._cache.compile("-".join(map(str, program)), fn, args)
            out = executable(*args)
        self._executables[program] = executable
        self._from_cache += cached
        return out

    def dispatch(self, batch: StepBatch, key: BucketKey) -> SampleOutput:
        """Start the whole step (forward pass, then sampling) and return its outputs as
        device arrays, without waiting.

        Placeholder tokens of the batch read the previous dispatched step's samples."""
        forward, sample = self.programs(key)
        if self.broadcaster is not None:
            self.broadcaster.send(STEP, batch, key)
        self._forward(batch, forward)
        return self._sample(batch, sample)

    def dispatch_forward(self, batch: StepBatch, key: BucketKey) -> None:
        """Start the step's forward pass; its logits wait on the device for
        `dispatch_sample`, which must come next (after any host work)."""
        if self.broadcaster is not None:
            self.broadcaster.send(FORWARD, batch, key)
        self._forward(batch, self.programs(key)[0])

    def dispatch_sample(self, batch: StepBatch, key: BucketKey) -> SampleOutput:
        """Sample from the last `dispatch_forward`'s logits with the batch's sampling
        arrays and history (filled since)."""
        if self.broadcaster is not None:
            self.broadcaster.send(SAMPLE, batch, key)
        return self._sample(batch, self.programs(key)[1])

    def steps_program(self, key: BucketKey) -> tuple:
        return ("steps", key.tokens, key.seqs, self.decode_steps)

    def dispatch_steps(self, batch: StepBatch, key: BucketKey, num_steps: int) -> SampleOutput:
        """Start `num_steps` (<= `decode_steps`) decode steps of a batch of decoding
        sequences without drafts in one program (`decode_steps`); its outputs are
        `[decode_steps, R]`, step i's samples at i."""
        batch = dataclasses.replace(batch, history=None)
        batch.sampling.grammar_mask = self._grammar_mask(batch.sampling.grammar_mask)
        args = (self._param_leaves, self.kv_caches, batch, self.sampled, self.expert_load,
                np.int32(num_steps))
        self.kv_caches, out, self.sampled, self.expert_load = self._run(
            self.steps_program(key), self._programs.steps, args)
        return out

    def moves(self, moves: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) of `move`: (data shard, src slot, dst slot) laid out as one block per
        shard of `max_num_seqs x num_speculative_tokens` (the most a step accepts), the
        rest copying nothing."""
        b = self.builder
        block = b.max_num_seqs * b.num_speculative_tokens
        src = np.zeros((b.data_shards, block), np.int32)
        dst = np.full((b.data_shards, block), b.num_pages * b.page_size, np.int32)
        used = [0] * b.data_shards
        for shard, s, d in moves:
            src[shard, used[shard]], dst[shard, used[shard]] = s, d
            used[shard] += 1
        return src.reshape(-1), dst.reshape(-1)

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Start copying K/V (and EAGLE features) between slots (`moves`' arrays)."""
        if self.broadcaster is not None:
            self.broadcaster.send_moves(src, dst)
        self._move(src, dst)

    def _move(self, src: np.ndarray, dst: np.ndarray) -> None:
        args = (self.kv_caches, self.features, src, dst)
        self.kv_caches, self.features = self._run(("move",), self._programs.move, args)

    def _forward(self, batch: StepBatch, program: tuple) -> None:
        inputs = dataclasses.replace(batch, sampling=None, history=None)
        args = (self._param_leaves, self.kv_caches, inputs, self.sampled, self.expert_load,
                self.medusa, self.features)
        (self.kv_caches, self._logits, self.expert_load, self.guesses,
         self.features, self._row_tokens) = self._run(program,
                                                      self._programs.forward[program[-1]], args)
        self._logits_dtype = self._logits.dtype

    def _sample(self, batch: StepBatch, program: tuple) -> SampleOutput:
        logits, self._logits = self._logits, None
        batch.sampling.grammar_mask = self._grammar_mask(batch.sampling.grammar_mask)
        args = (logits, batch.sampling, batch.history, self.sampled, batch.num_rows,
                self.draft_probs, self._row_tokens)
        out, self.sampled = self._run(program, self._programs.sample[program[-1]], args)
        return out

    def _grammar_mask(self, mask: np.ndarray) -> jax.Array:
        """The batch's grammar mask on the device; one that allows everything is the copy
        kept there (no transfer). Always a device array, as at warm-up: a numpy array in
        its place would miss jit's fast dispatch path (~30 ms a step for this model on a
        CPU). On several hosts every process decides alike (they see the same mask):
        putting a host array on the global devices is itself a collective."""
        if mask is not self.builder.open_mask(mask.shape[0]) and not (mask == -1).all():
            return jax.device_put(mask, self.shard.sharding(()))
        if mask.shape[0] not in self._open_masks:
            self._open_masks[mask.shape[0]] = jax.device_put(
                self.builder.open_mask(mask.shape[0]), self.shard.sharding(()))
        return self._open_masks[mask.shape[0]]

    def compiled(self, key: BucketKey) -> jax.stages.Compiled:
        """The compiled forward pass of a bucket (every collective and kernel of its step
        is there), for reading its HLO (compiles it again)."""
        batch = dataclasses.replace(self.builder.empty(key), sampling=None, history=None)
        forward = self._programs.forward[self.programs(key)[0][-1]]
        return forward.lower(self._param_leaves, self.kv_caches, batch, self.sampled,
                             self.expert_load, self.medusa, self.features).compile()

    @property
    def num_compiled(self) -> int:
        return len(self._executables)


def fetch(out: SampleOutput) -> SampleOutput:
    """Wait for a dispatched step's outputs and copy them to the host (they are replicated:
    on several hosts, this process's copy)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), out)


def pages_per_seq(max_model_len: int, page_size: int) -> int:
    return math.ceil(max_model_len / page_size)
