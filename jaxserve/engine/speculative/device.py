"""Speculative decoding on the device, inside the target's step programs: reading drafts and
the last step's tokens from the carry, moving sequences back by the drafts the step in
flight rejected, recording a step's acceptance for the step after it, and the K/V (and
EAGLE features) a tree's accepted nodes leave out of place.

The carry is the device array a step reads its tokens still on the device from, laid out
as `batch.CarryLayout` says: the last step's samples, a proposer's guesses, and (where
steps verifying a draft model's chains run async) each sequence's acceptance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.engine.batch import CarryLayout, StepBatch
from jaxserve.engine.sampler import SamplingArrays
from jaxserve.engine.slots import global_slots, position_slots
from jaxserve.models.transformer import KVCache


def resolve_pending(batch: StepBatch, carry: jax.Array, layout: CarryLayout, page_size: int,
                    move_back: bool = True) -> tuple[jax.Array, StepBatch]:
    """The batch's input ids, those still on the device (`batch.prev_index`) read from the
    `carry`; and the batch with every sequence whose pending step rejected drafts
    (`batch.shift_row`, the layout's `rejected` block) moved back by as many positions:
    its tokens' positions and KV slots (from its page table) and its KV length. The host
    counted all of that step's drafts as accepted when it laid the batch out; a
    sequence's tokens here all follow them. Without `layout.overlap` or `move_back`, only
    the ids."""
    input_ids = jnp.where(batch.prev_index >= 0,
                          carry[jnp.maximum(batch.prev_index, 0)], batch.input_ids)
    if not (layout.overlap and move_back):
        return input_ids, batch
    meta = batch.attn
    d, t, s = meta.num_seqs.shape[0], input_ids.shape[0], meta.kv_lens.shape[0]
    rejected = jnp.where(batch.shift_row >= 0,
                         carry[layout.rejected + jnp.maximum(batch.shift_row, 0)], 0)
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


def shift_sampling(sampling: SamplingArrays, carry: jax.Array, layout: CarryLayout
                   ) -> SamplingArrays:
    """The rows of sequences whose pending step rejected drafts sample output numbers as
    many lower (`resolve_pending`)."""
    if not layout.overlap:
        return sampling
    back = jnp.where(sampling.shift_row >= 0,
                     carry[layout.rejected + jnp.maximum(sampling.shift_row, 0)], 0)
    return dataclasses.replace(sampling, output_index=sampling.output_index - back)


def record_acceptance(carry: jax.Array, token_ids: jax.Array, row_tokens: jax.Array,
                      group_drafts: jax.Array, layout: CarryLayout, verifies: bool = True
                      ) -> jax.Array:
    """The `carry` with the step's acceptance of its chains written in the layout's blocks
    at each sequence's first row r (`group_drafts[r]` drafts, verified by rows r..r+k):
    its drafts accepted a are the leading rows whose sample equals the token at the row
    after (the draft it verifies; the host's rule, drafts.accepted_path); it emits the
    samples of rows r..r+a, the last (`bonus`) after the token at row r+a (`last`), and
    rejects k - a drafts. A step without drafts (`verifies` False) emits each row's
    sample after its token, and leaves `rejected` as it was: the builder moves back only
    sequences whose pending step had drafts."""
    r = token_ids.shape[0]
    if not verifies:
        return (carry.at[layout.bonus:layout.bonus + r].set(token_ids)
                .at[layout.last:layout.last + r].set(row_tokens))
    rows = jnp.arange(r)
    at = lambda x, i: x[jnp.minimum(i, r - 1)]  # noqa: E731
    accepted, run = jnp.zeros(r, jnp.int32), jnp.ones(r, jnp.bool_)
    for j in range(layout.k):
        run = run & (j < group_drafts) & (at(token_ids, rows + j) == at(row_tokens, rows + j + 1))
        accepted = accepted + run
    end = jnp.minimum(rows + accepted, r - 1)
    return (carry.at[layout.bonus + rows].set(token_ids[end])
            .at[layout.last + rows].set(row_tokens[end])
            .at[layout.rejected + rows].set(group_drafts - accepted))


def write_guesses(carry: jax.Array, guesses: jax.Array, layout: CarryLayout) -> jax.Array:
    """The `carry` with a proposer's guesses `[R, S]` written where the layout keeps them:
    guess j of row r at max_num_seqs x (1 + j) + r (`Drafts.device_index`)."""
    r, s = guesses.shape
    block = jnp.zeros((r, layout.max_num_seqs), jnp.int32).at[:, :s].set(guesses)
    return jax.lax.dynamic_update_slice(carry, block.reshape(-1), (layout.max_num_seqs,))


def write_features(cache: jax.Array, features: jax.Array, slots: jax.Array,
                   data_shards: int) -> jax.Array:
    """An EAGLE head's feature cache `[D x slots, F]` (one row per KV slot of every data
    shard's pool, sharded as the pages are) with `features` `[T, F]` written at the
    tokens' slots; padding tokens write nothing."""
    index = global_slots(slots, cache.shape[0] // data_shards, data_shards)
    return cache.at[index].set(features.astype(cache.dtype), mode="drop")


def move_slots(kv_caches: KVCache, features: jax.Array | None, src: jax.Array,
               dst: jax.Array) -> tuple[KVCache, jax.Array | None]:
    """Every layer's K/V (and an EAGLE feature cache's rows) copied from slots `src` to
    slots `dst` of one data shard's pool, all read before any is written; a `dst` out of
    the pool copies nothing. After a tree step (speculative/drafts.py): the accepted
    nodes' into the slots of their positions."""
    def move(x):  # [heads, pages, page_size, ...]
        flat = x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])
        return flat.at[:, dst].set(flat[:, src], mode="drop").reshape(x.shape)

    kv_caches = [tuple(move(x) for x in layer) for layer in kv_caches]
    if features is not None:
        features = features.at[dst].set(features[src], mode="drop")
    return kv_caches, features
