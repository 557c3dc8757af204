"""The rounds of a proposer with a model of its own (draft_model.py, eagle.py), on the
device: round 1 feeds each sequence's new tokens, then each later round one token per
sequence, the guess of the round before at the next position."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.engine.sampler import SamplingArrays, draw_drafts, first_argmax
from jaxserve.engine.slots import position_slots
from jaxserve.models.transformer import AttentionMetadata


def round_guesses(logits: jax.Array, sampling: SamplingArrays | None, j: int | jax.Array,
                  probs: jax.Array | None, max_num_seqs: int, to_target=lambda ids: ids,
                  sorts: bool | None = None) -> tuple[jax.Array, jax.Array | None]:
    """A proposer's round j + 1 (`j` 0-based) over its `logits` `[S, V']`: each row's
    guess as a target token id (`to_target` maps a draft vocabulary's), and `probs` (the
    target's `draft_probs`; None: every guess greedy) with the guesses' distributions
    (sampler.draw_drafts, spread over the target's vocabulary) at rows
    max_num_seqs x j + r. `sorts`: draw_drafts'."""
    if probs is None:
        return to_target(first_argmax(logits)), None
    vocab = probs.shape[1]
    columns = None if logits.shape[1] == vocab else to_target(jnp.arange(logits.shape[1]))
    ids, q = draw_drafts(logits, sampling, j, columns, vocab, sorts)
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
