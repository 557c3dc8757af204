"""Speculative decoding's proposers: each guesses a sequence's next tokens, for the step
to verify (speculator.py). N-gram's and Medusa's are here; a draft model's is in
draft_model.py, EAGLE's in eagle.py."""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jaxserve.engine.batch import BatchBuilder, BucketKey, StepBatch
from jaxserve.engine.request import Sequence
from jaxserve.engine.sampler import asks_sort
from jaxserve.engine.scheduler import ScheduledSeq, Scheduler
from jaxserve.engine.speculative import drafts as trees
from jaxserve.engine.speculative.drafts import NO_DRAFTS, Drafts
from jaxserve.engine.speculative.state import state_of

if TYPE_CHECKING:
    import jax

    from jaxserve.engine.runner import ModelRunner


class Proposer(abc.ABC):
    """Guesses the next tokens of the sequences about to step."""

    def warmup(self, progress: bool = True) -> None:
        """Compile whatever programs it runs (a proposer with a model of its own)."""

    def recover(self) -> None:
        """After a failed step: remake any device state of its own the step consumed."""

    # Whether a sequence's K/V of the accepted drafts stay valid in the proposer's own
    # cache (a draft model's: it computed them from the same tokens); else only those
    # before the step's first emitted token (EAGLE's pairs after it hold its own features).
    keeps_accepted = False

    @abc.abstractmethod
    def propose_batch(self, entries: list[tuple[Sequence, int]], scheduler: Scheduler,
                      pending: dict[Sequence, tuple[int, int]] | None = None
                      ) -> list[Drafts]:
        """Drafts for each (sequence, at most k: a tree's depth) of the coming step.
        `pending`: the rows of the seqs whose newest tokens a step in flight emits (a
        proposer that reads them on the device needs it)."""


class DeviceProposer(Proposer):
    """A proposer with a program of its own (draft_model.py, eagle.py), compiled for each
    bucket of its `builder` without history, whose guesses the `target` runner's next
    step reads on the device."""

    def __init__(self, builder: BatchBuilder, target: ModelRunner):
        self.builder, self.target = builder, target
        self._ready: set[BucketKey] = set()  # buckets compiled
        self.warmed_up = False

    def buckets(self) -> list[BucketKey]:
        return [b for b in self.builder.all_buckets() if not b.history]

    def sorts(self) -> tuple[bool | None, ...]:
        """The programs' kinds, by how their guesses' draws settle top-k and top-p
        (sampler.draw_drafts' `sorts`): on the device (None); or, where the target's
        programs are branch-free and guesses may be drawn, by the host: without (False)
        and with (True, for a batch where a row asks for them: `sorts_for`)."""
        if self.target.branch_free and self.target.draft_probs is not None:
            return (False, True)
        return (None,)

    def sorts_for(self, inputs: StepBatch) -> bool | None:
        """The kind of program (`sorts`) a batch's `program_inputs` run."""
        if self.sorts() == (None,):
            return None
        return asks_sort(inputs.sampling)

    def warmup(self, progress: bool = True) -> None:
        """Compile the programs for every bucket (an all-padding batch writes nothing)."""
        for key in self.buckets():
            for sorts in self.sorts():
                self._run(self.program_inputs(self.builder.empty(key)), key,
                          np.zeros(key.seqs, np.int32), sorts)
                self._ready.add((key, sorts))
        self.warmed_up = True

    def run(self, batch: StepBatch, key: BucketKey, limits: np.ndarray) -> None:
        """Start the program on a batch of `builder`; its guesses are left where the
        target's next step reads them (the target runner's carry). On several hosts
        process 0 first has the others run it too (broadcast.py: every process joins the
        program's collectives). Counts a bucket compiled after warm-up."""
        inputs = self.program_inputs(batch)
        sorts = self.sorts_for(inputs)
        if (key, sorts) not in self._ready:
            if self.warmed_up:
                self.target.compiles_after_warmup += 1
            self._ready.add((key, sorts))
        if self.target.broadcaster is not None:
            self.target.broadcaster.send_proposal(inputs, key, limits)
        self.target.carry = self._run(inputs, key, limits, sorts)

    @abc.abstractmethod
    def _run(self, inputs: StepBatch, key: BucketKey, limits: np.ndarray,
             sorts: bool | None) -> jax.Array:
        """Start the program of kind `sorts` on `program_inputs`; returns the target's
        carry with its guesses written in."""

    def program_inputs(self, batch: StepBatch) -> StepBatch:
        """The batch as the program takes it: no history, and the sampling arrays (not
        the grammar's mask) when it may draw guesses (the target has `draft_probs`)."""
        sampling = None
        if self.target.draft_probs is not None and batch.sampling is not None:
            sampling = dataclasses.replace(batch.sampling, grammar_mask=None)
        return dataclasses.replace(batch, sampling=sampling, history=None)


def first_round(entries: list[tuple[Sequence, int]], scheduler: Scheduler, budget: int,
                lag: int, ahead: Callable[[int], int] = lambda k: k - 1
                ) -> tuple[list[tuple[int, ScheduledSeq]], dict[int, int]]:
    """Round 1 of a proposer with a model of its own (draft_model.py, eagle.py): for each
    (sequence, k), its inputs from its proposer's computed tokens (SeqSpeculation: at
    most its newest token) up
    to `num_tokens - lag`, within its data shard's share of the token `budget` and the
    pages it holds. Returns (entry index, its chunk) for those with inputs, and the drafts
    each caught-up sequence gets: k where it also holds pages for its newest token and
    the `ahead(k)` positions after (its later rounds' slots), within max_model_len (no
    pages, no drafts). Moves the computed tokens past the chunks."""
    shards = len(scheduler.allocators)
    budgets = [budget // shards] * shards
    first, want = [], {}
    for i, (seq, k) in enumerate(entries):
        state = state_of(seq)
        start = min(state.computed, seq.num_tokens - 1)
        end = seq.num_tokens - lag
        n = min(end - start, budgets[seq.data_shard])
        allocator = scheduler.allocators[seq.data_shard]
        # The newest token may have no page yet (the target's next step takes it).
        if n <= 0 or not allocator.allocate_more(seq, start + n):
            continue
        budgets[seq.data_shard] -= n
        total = seq.num_tokens + ahead(k)
        if (start + n == end and total <= scheduler.config.max_model_len
                and allocator.allocate_more(seq, total)):
            want[i] = k
        first.append((i, ScheduledSeq(seq, start, n)))
        state.computed = start + n
    return first, want


class TokenProposer(Proposer):
    """A proposer that guesses each sequence on its own, from its tokens alone."""

    @abc.abstractmethod
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` guessed next tokens of `tokens`."""

    def propose_batch(self, entries: list[tuple[Sequence, int]], scheduler: Scheduler,
                      pending: dict[Sequence, tuple[int, int]] | None = None
                      ) -> list[Drafts]:
        return [Drafts(self.propose(seq.token_ids, k)) for seq, k in entries]


class MedusaProposer(Proposer):
    """Medusa: the heads' guesses, computed by the target's last step at the row of the
    sequence's newest token (SpeculativeDecoding.commit keeps them in its state): each
    head's top guess as a chain, or with `tree` (SpeculativeConfig.speculative_token_tree,
    paths of ranks) the tree of those guesses, cut to depth k."""

    def __init__(self, tree: tuple[tuple[int, ...], ...] | None = None):
        self.tree = tree
        self._cuts = trees.cuts(tree) if tree else {}

    def propose_batch(self, entries: list[tuple[Sequence, int]], scheduler: Scheduler,
                      pending: dict[Sequence, tuple[int, int]] | None = None
                      ) -> list[Drafts]:
        out: list[Drafts] = []
        for seq, k in entries:
            made = state_of(seq).guesses
            if not made or made[0] != seq.num_tokens:
                out.append(NO_DRAFTS)
                continue
            guesses = made[1]  # [head][rank]
            if self.tree is None:
                out.append(Drafts([g[0] for g in guesses[:k]]))
                continue
            nodes, parents = self._cuts[min(k, len(self._cuts))]
            paths = [self.tree[j] for j in nodes]
            out.append(Drafts([guesses[len(p) - 1][p[-1]] for p in paths], parents))
        return out


class NgramProposer(TokenProposer):
    """Prompt lookup (vLLM's "ngram" method): find the sequence's last n tokens earlier in
    its tokens (prompt and output), for n from `max_n` down to `min_n`, and propose the
    tokens that followed their latest earlier occurrence with k tokens after it (else the
    latest: a match just behind the end has only a few). No model: it pays off where the
    output repeats its context (editing code, quoting, extraction)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` guessed next tokens of `tokens` ([] when no n-gram recurs)."""
        n_tokens = len(tokens)
        if k < 1 or n_tokens <= self.min_n:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so each has a token after it.
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                full = hits[hits + n + k <= n_tokens]
                start = int(full[-1] if full.size else hits[-1]) + n
                return ids[start:start + k].tolist()
        return []
