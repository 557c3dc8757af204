"""The draft-model proposer: a smaller checkpoint with the target's vocabulary guesses each
sequence's next k tokens, one round of its own forward pass at a time: greedily, or for
a request that samples (SpeculativeConfig.sampled_drafts) drawn from the draft's own
distribution, which the program leaves on the device for the target's step to keep or
reject each guess by (sampler.draw_drafts, sampler.verify_drafts).

The draft has its own KV cache, of the target's page count and page size, indexed by the
target's page tables: a sequence's draft K/V live in the same page ids as its target K/V,
so the target's page allocator (and its rules: prefix sharing, preemption, freeing) serves
both and no second table is kept. The sequence's `SeqSpeculation.computed` counts the
leading tokens whose draft K/V are valid.

One program per step (`rounds`): round 1 feeds the draft every token from there to the
sequence's newest (its whole prompt the first time, chunked by the token budget; then
the tokens the last step accepted) and guesses from the last; rounds 2..k, a loop on the
device, feed each sequence the round before's guess at the next position. The guesses
stay on the device, in the target's carry where its step reads its PLACEHOLDER tokens
(device.write_guesses): the host dispatches the verification behind the program
and reads the guesses back with its samples, one wait per step whatever k. A sequence
catching up over a long prompt gets no drafts until it has caught up.

Pages: rounds write K/V up to position num_tokens + k - 2, so each drafting sequence first
gets pages for num_tokens + max(k - 1, 1) tokens (no pages, no drafts; none even for its
newest token, no round 1 either); the target's step that verifies the drafts needs them
anyway, and Scheduler.rollback gives back what is unused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.engine.batch import BucketKey, CarryLayout, StepBatch
from jaxserve.engine.programs import on_param_leaves, sampled_rows
from jaxserve.engine.request import PLACEHOLDER, Sequence
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.speculative.device import resolve_pending, shift_sampling, write_guesses
from jaxserve.engine.speculative.drafts import NO_DRAFTS, Drafts
from jaxserve.engine.speculative.proposers import DeviceProposer, first_round
from jaxserve.engine.speculative.rounds import round_guesses, round_metadata
from jaxserve.engine.speculative.state import state_of


def rounds(graphdef: nnx.GraphDef, params: nnx.State, kv_caches, batch: StepBatch,
           limits: jax.Array, probs: jax.Array | None, carry: jax.Array, *, k: int,
           layout: CarryLayout, page_size: int, drop_slot: int, sorts: bool | None = None
           ) -> tuple[list, jax.Array, jax.Array | None]:
    """Round 1 of the draft model over `batch` (each sequence's new tokens, those still on
    the device read from the target's `carry`, laid out as `layout` says, and
    sequences moved back by the drafts their pending step rejected: resolve_pending),
    then k - 1 rounds of one token per sequence, each its guess of the round before at
    the next position. Returns the cache, the guesses `[k, S]` and `probs`
    (`round_guesses`); sequence i writes K/V in its first `limits[i]` later rounds only
    (the pages it holds). `sorts`: how the draws settle top-k and top-p
    (sampler.draw_drafts)."""
    model = nnx.merge(graphdef, params)
    input_ids, batch = resolve_pending(batch, carry, layout, page_size)
    sampling = (shift_sampling(batch.sampling, carry, layout)
                if batch.sampling is not None else None)
    meta = batch.attn
    d, s = meta.num_seqs.shape[0], meta.kv_lens.shape[0]
    rows = batch.num_rows[0] if d == 1 else None
    max_num_seqs = layout.max_num_seqs
    hidden, kv_caches = model(input_ids, batch.positions, kv_caches, meta)
    logits = model.logits(sampled_rows(hidden, batch.sample_index, d), rows=rows)
    ids, probs = round_guesses(logits, sampling, 0, probs, max_num_seqs, sorts=sorts)

    def round_(j, state):  # one token per sequence, the guess of the round before
        kv_caches, ids, out, probs = state
        pos, attn = round_metadata(meta, j, limits, page_size, drop_slot)
        hidden, kv_caches = model(ids, pos, kv_caches, attn)
        ids, probs = round_guesses(model.logits(hidden, rows=rows), sampling, j, probs,
                                   max_num_seqs, sorts=sorts)
        return kv_caches, ids, out.at[j].set(ids), probs

    out = jnp.zeros((k, s), jnp.int32).at[0].set(ids)
    kv_caches, _, out, probs = jax.lax.fori_loop(1, k, round_, (kv_caches, ids, out, probs))
    return kv_caches, out, probs


class DraftModel(DeviceProposer):
    """A proposer that runs a model of its own: `runner`
    the draft's (its parameters and KV cache; its step programs are not used), `target`
    the engine's (whose next step reads the guesses)."""

    keeps_accepted = True  # its K/V of the drafts the target kept are of those tokens

    def __init__(self, runner: ModelRunner, target: ModelRunner, max_num_batched_tokens: int,
                 k: int):
        assert runner.builder.draft_model
        super().__init__(runner.builder, target)
        self.runner = runner
        self.max_num_batched_tokens = max_num_batched_tokens
        layout = self.builder.layout
        replicated = runner.shard.sharding(())
        caches = jax.tree.map(lambda x: x.sharding, runner.kv_caches)

        def jitted(sorts: bool | None):
            program = functools.partial(
                rounds, k=k, layout=layout, page_size=self.builder.page_size,
                drop_slot=self.builder.num_pages * self.builder.page_size, sorts=sorts)

            def laid_out(*args):  # the guesses written into the target's carry
                kv, out, probs = program(*args)
                return kv, write_guesses(args[-1], out, layout), probs

            return jax.jit(
                on_param_leaves(runner.graphdef, runner.params, laid_out),
                donate_argnums=(1, 4),
                in_shardings=([x.sharding for x in jax.tree.leaves(runner.params)], caches,
                              replicated, replicated, replicated, replicated),
                out_shardings=(caches, replicated, replicated))

        self._rounds = {sorts: jitted(sorts) for sorts in self.sorts()}

    def recover(self) -> None:
        self.runner.recover()

    def propose_batch(self, entries: list[tuple[Sequence, int]], scheduler: Scheduler,
                      pending: dict[Sequence, tuple[int, int]] | None = None
                      ) -> list[Drafts]:
        """Drafts for each (sequence, at most k) of the coming step: as PLACEHOLDERs, the
        guesses left on the device where the target's next step reads them (their
        `device_index` in the target runner's carry)."""
        drafts = [NO_DRAFTS] * len(entries)
        # Rounds 2..k feed positions num_tokens.. (one at least: the verification takes
        # that page anyway).
        first, want = first_round(entries, scheduler, self.max_num_batched_tokens, lag=0,
                                  ahead=lambda k: max(k - 1, 1))
        if not first:
            return drafts
        out = SchedulerOutput([s for _, s in first], [], sum(s.num_new_tokens for _, s in first))
        batch, key = self.builder.build(out, pending)
        limits = np.zeros(key.seqs, np.int32)
        for i, sched in first:
            if i in want:  # its later rounds' K/V, of its guesses
                limits[sched.row] = want[i] - 1
                state_of(sched.seq).computed += want[i] - 1
        self.run(batch, key, limits)
        for i, sched in first:
            if i in want:
                drafts[i] = Drafts([PLACEHOLDER] * want[i], device_index=[
                    self.builder.layout.guess(j, sched.row) for j in range(want[i])])
        return drafts

    def _run(self, inputs: StepBatch, key: BucketKey, limits: np.ndarray,
             sorts: bool | None) -> jax.Array:
        runner = self.runner
        runner.kv_caches, out, self.target.draft_probs = self._rounds[sorts](
            runner.param_leaves, runner.kv_caches, inputs, limits, self.target.draft_probs,
            self.target.carry)
        return out
