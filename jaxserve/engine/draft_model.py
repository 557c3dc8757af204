"""The draft-model proposer: a smaller checkpoint with the target's vocabulary guesses each
sequence's next k tokens, greedily, one round of its own step at a time.

The draft has its own KV cache, of the target's page count and page size, indexed by the
target's page tables: a sequence's draft K/V live in the same page ids as its target K/V,
so the target's page allocator (and its rules: prefix sharing, preemption, freeing) serves
both and no second table is kept. `Sequence.draft_computed_tokens` counts the leading
tokens whose draft K/V are valid. Round 1 feeds the draft every token from there to the
sequence's last (its whole prompt the first time, chunked by the token budget; then the
tokens the last step accepted) and samples its first guess; rounds 2..k feed each guess
back, read on the device from the round before (a PLACEHOLDER input, as async scheduling
feeds a step), so the host dispatches all k rounds and waits once. A sequence catching up
over a long prompt gets no drafts until it has caught up.

Pages: rounds write K/V up to position num_tokens + k - 2, so each drafting sequence first
gets pages for num_tokens + k - 1 tokens (no pages, no drafts; none even for its newest
token, no round 1 either); the target's step that verifies the drafts needs them anyway,
and Scheduler.rollback gives back what is unused.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.engine.batch import BatchBuilder
from jaxserve.engine.proposers import Proposer
from jaxserve.engine.request import PLACEHOLDER, Sequence
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput


class DraftModel(Proposer):
    """A proposer that runs a model of its own (engine/speculation.py uses it)."""

    def __init__(self, runner: ModelRunner, max_num_batched_tokens: int):
        assert runner.builder.draft_model
        self.runner = runner
        self.builder: BatchBuilder = runner.builder
        self.max_num_batched_tokens = max_num_batched_tokens

    def propose_batch(self, entries: list[tuple[Sequence, int]], scheduler: Scheduler
                      ) -> list[list[int]]:
        """Drafts for each (sequence, at most k) of the coming step."""
        shards = self.builder.data_shards
        budgets = [self.max_num_batched_tokens // shards] * shards
        drafts: list[list[int]] = [[] for _ in entries]
        want = [0] * len(entries)  # drafts each sequence will get
        first = []  # round 1: (entry index, its chunk)
        for i, (seq, k) in enumerate(entries):
            start = min(seq.draft_computed_tokens, seq.num_tokens - 1)
            n = min(seq.num_tokens - start, budgets[seq.data_shard])
            allocator = scheduler.allocators[seq.data_shard]
            # The newest token may have no page yet (the target's next step takes it).
            if n <= 0 or not allocator.allocate_more(seq, start + n):
                continue
            budgets[seq.data_shard] -= n
            caught_up = start + n == seq.num_tokens
            if caught_up and allocator.allocate_more(seq, seq.num_tokens + k - 1):
                want[i] = k
            first.append((i, ScheduledSeq(seq, start, n)))
            seq.draft_computed_tokens = start + n
        if not first:
            return drafts
        rounds = [(first, self._dispatch([s for _, s in first], {}))]
        for j in range(1, max(want)):  # rounds 2..k: each feeds the guess before
            before = {s.seq: s.row for _, s in rounds[-1][0]}
            more = [(i, ScheduledSeq(entries[i][0], entries[i][0].num_tokens + j - 1, 1,
                                     drafts=[PLACEHOLDER]))
                    for i in range(len(entries)) if want[i] > j]
            rounds.append((more, self._dispatch([s for _, s in more], before)))
            for _, sched in more:
                sched.seq.draft_computed_tokens = sched.start + 1
        for scheduled, tokens in rounds:
            tokens = np.asarray(tokens.addressable_data(0))
            for i, sched in scheduled:
                if want[i]:
                    drafts[i].append(int(tokens[sched.row]))
        return drafts

    def _dispatch(self, scheduled: list[ScheduledSeq], pending_rows: dict[Sequence, int]
                  ) -> jax.Array:
        """Start one step of the draft over `scheduled`; its greedy tokens (on the device)
        are the guesses after each chunk (at each one's row)."""
        out = SchedulerOutput(scheduled, [], sum(s.num_new_tokens for s in scheduled))
        batch, key = self.builder.build(out, pending_rows)
        return self.runner.dispatch(batch, key).token_ids
