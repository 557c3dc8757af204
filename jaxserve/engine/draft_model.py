"""The draft-model proposer: a smaller checkpoint with the target's vocabulary guesses each
sequence's next k tokens, greedily, one round of its own step at a time.

The draft has its own KV cache, of the target's page count and page size, indexed by the
target's page tables: a sequence's draft K/V live in the same page ids as its target K/V,
so the target's page allocator (and its rules: prefix sharing, preemption, freeing) serves
both and no second table is kept. `Sequence.draft_computed_tokens` counts the leading
tokens whose draft K/V are valid. Round 1 feeds the draft every token from there to the
sequence's last (its whole prompt the first time, chunked by the token budget; then the
tokens the last step accepted) and samples its first guess; rounds 2..k run in one
program of their own (`chain`, a loop on the device that feeds each round's greedy tokens
to the next, advancing positions, slots and context lengths), its first input read from
round 1's samples on the device (a PLACEHOLDER, as async scheduling feeds a step). The
guesses stay on the device, laid out where the target's step reads its PLACEHOLDER tokens
(runner.guesses_as_prev_tokens): the host dispatches the verification behind the two
programs and reads the guesses back with its samples, one wait per step whatever k. A
sequence catching up over a long prompt gets no drafts until it has caught up.

Pages: rounds write K/V up to position num_tokens + k - 2, so each drafting sequence first
gets pages for num_tokens + max(k - 1, 1) tokens (no pages, no drafts; none even for its
newest token, no round 1 either); the target's step that verifies the drafts needs them
anyway, and Scheduler.rollback gives back what is unused.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.engine.batch import BatchBuilder, BucketKey, StepBatch
from jaxserve.engine.proposers import Proposer, first_round
from jaxserve.engine.request import PLACEHOLDER, Sequence
from jaxserve.engine.runner import (
    ModelRunner, guesses_as_prev_tokens, on_param_leaves, position_slots, sampled_rows)
from jaxserve.engine.sampler import first_argmax
from jaxserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from jaxserve.models.parallel import real_token_mask


def chain(graphdef: nnx.GraphDef, params: nnx.State, kv_caches, batch: StepBatch,
          prev_tokens: jax.Array, limits: jax.Array, *, rounds: int, page_size: int,
          drop_slot: int) -> tuple[list, jax.Array]:
    """`rounds` greedy steps of the draft model over one token per sequence: round j feeds
    each sequence's token at `batch.positions + j` (round 0's from `prev_tokens` where
    `batch.prev_index` says, as a step's PLACEHOLDER: round 1's guess; later ones the
    round before's guesses) and returns the guesses, round 1's first, `[rounds + 1, S]`.
    Sequence i writes K/V only in its first `limits[i]` rounds (the pages it holds); its
    later guesses are not used."""
    model = nnx.merge(graphdef, params)
    meta = batch.attn
    d, t, s = meta.num_seqs.shape[0], batch.input_ids.shape[0], meta.kv_lens.shape[0]
    local = jnp.minimum(jnp.arange(t // d), s // d - 1)
    seq = (jnp.arange(d)[:, None] * (s // d) + local[None, :]).reshape(-1)  # each token's
    real = real_token_mask(meta, t)
    ids = jnp.where(batch.prev_index >= 0, prev_tokens[jnp.maximum(batch.prev_index, 0)],
                    batch.input_ids)

    def round_(j, carry):
        kv, ids, out = carry
        pos = batch.positions + j
        slots = position_slots(meta.page_indices[seq], pos, page_size)
        writes = real & (j < limits[seq])
        attn = dataclasses.replace(
            meta, slot_mapping=jnp.where(writes, slots, drop_slot),
            kv_lens=jnp.where(meta.kv_lens > 0, meta.kv_lens + j, 0))
        hidden, kv = model(ids, pos, kv, attn)
        logits = model.logits(sampled_rows(hidden, batch.sample_index, d),
                              rows=batch.num_rows[0] if d == 1 else None)
        guesses = first_argmax(logits)
        return kv, guesses[seq], out.at[j + 1].set(guesses)  # after round 1's

    first = jnp.take_along_axis(ids.reshape(d, -1), batch.sample_index.reshape(d, -1), 1)
    out = jnp.zeros((rounds + 1, s), jnp.int32).at[0].set(first.reshape(-1))
    kv, _, out = jax.lax.fori_loop(0, rounds, round_, (kv_caches, ids, out))
    return kv, out


class DraftModel(Proposer):
    """A proposer that runs a model of its own (engine/speculation.py uses it): `runner`
    the draft's, `target` the engine's (whose next step reads the guesses)."""

    def __init__(self, runner: ModelRunner, target: ModelRunner, max_num_batched_tokens: int,
                 k: int):
        assert runner.builder.draft_model
        self.runner, self.target = runner, target
        self.builder: BatchBuilder = runner.builder
        self.max_num_batched_tokens = max_num_batched_tokens
        rounds = functools.partial(chain, rounds=k - 1, page_size=self.builder.page_size,
                                   drop_slot=self.builder.num_pages * self.builder.page_size)

        def laid_out(*args):  # the guesses as the target's prev_tokens
            kv, guesses = rounds(*args)
            return kv, guesses_as_prev_tokens(guesses, self.builder.max_num_seqs)

        replicated = runner.shard.sharding(())
        caches = jax.tree.map(lambda x: x.sharding, runner.kv_caches)
        self._chain = jax.jit(
            on_param_leaves(runner.graphdef, runner.params, laid_out), donate_argnums=(1,),
            in_shardings=([x.sharding for x in jax.tree.leaves(runner.params)], caches,
                          replicated, replicated, replicated),
            out_shardings=(caches, replicated))
        self._chains: set[BucketKey] = set()  # compiled

    def chain_buckets(self) -> list[BucketKey]:
        """The buckets rounds 2..k can use: one token per drafting sequence."""
        seqs = self.builder.max_num_seqs
        return [b for b in self.builder.all_buckets()
                if not b.history and b.tokens <= self.builder.bucket(seqs, False).tokens]

    def warmup(self, progress: bool = True) -> None:
        """Compile the draft's step programs, and the chain for every bucket it can use
        (its rounds write nothing)."""
        self.runner.warmup(progress)
        for key in self.chain_buckets():
            self._run_chain(self.builder.empty(key), key, np.zeros(key.seqs, np.int32))
        self._chains.update(self.chain_buckets())

    def recover(self) -> None:
        self.runner.recover()

    def propose_batch(self, entries: list[tuple[Sequence, int]], scheduler: Scheduler
                      ) -> list[list[int]]:
        """Drafts for each (sequence, at most k) of the coming step: as PLACEHOLDERs, the
        guesses left on the device where the target's next step reads them
        (`Sequence.draft_prev_index`, the target runner's `sampled`)."""
        drafts: list[list[int]] = [[] for _ in entries]
        # Rounds 2..k feed positions num_tokens.. (one at least: round 1's guess is read
        # there, and the verification takes that page anyway).
        first, want = first_round(entries, scheduler, self.max_num_batched_tokens, lag=0,
                                  ahead=lambda k: max(k - 1, 1))
        if not first:
            return drafts
        out = SchedulerOutput([s for _, s in first], [], sum(s.num_new_tokens for _, s in first))
        batch, key = self.builder.build(out)
        self.runner.dispatch(batch, key)
        if not want:
            return drafts
        rows = {s.seq: s.row for _, s in first}
        # Rounds 2..k, after round 1's guess; each sequence writes only as many as it
        # takes drafts.
        chained = [(i, ScheduledSeq(entries[i][0], entries[i][0].num_tokens, 1,
                                    drafts=[PLACEHOLDER])) for i in want]
        out = SchedulerOutput([s for _, s in chained], [], len(chained))
        batch, key = self.builder.build(out, rows)
        limits = np.zeros(key.seqs, np.int32)
        for i, sched in chained:
            limits[sched.row] = want[i] - 1
            sched.seq.draft_computed_tokens = sched.start + want[i] - 1
        self.target.sampled = self._run_chain(batch, key, limits)
        for i, sched in chained:
            sched.seq.draft_prev_index = [self.builder.max_num_seqs * (1 + j) + sched.row
                                          for j in range(want[i])]
            drafts[i] = [PLACEHOLDER] * want[i]
        return drafts

    def _run_chain(self, batch: StepBatch, key: BucketKey, limits: np.ndarray) -> jax.Array:
        """Start rounds 2..k; returns all the guesses laid out as the target's
        `prev_tokens`."""
        runner = self.runner
        if self._chains and key not in self._chains:  # warmed up, yet a new shape
            runner.compiles_after_warmup += 1
            self._chains.add(key)
        inputs = dataclasses.replace(batch, sampling=None, history=None)
        runner.kv_caches, out = self._chain(runner._param_leaves, runner.kv_caches, inputs,
                                            runner.sampled, limits)
        return out
