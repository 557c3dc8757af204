"""Speculative decoding behind one interface. `Speculator` is what the engine calls, at
fixed points of a step (docs/engine.md), and its default: it never speculates.
`SpeculativeDecoding` is a method's: its proposer (proposers.py, draft_model.py,
eagle.py), the policy, the host's side of verification, and the counters.

A speculating sequence feeds the step its last token and k drafts (guessed next tokens)
as k + 1 query tokens; the step samples a row at each, row j with the sequence's own
sampling parameters, seed and output index (its output number len(outputs) + j), from
the target model's logits given the tokens before it. While the drafts equal the samples
the context each row saw is the true one, so the tokens emitted are the samples up to and
including the first that differs from its draft (all k + 1 when none does: the last is the
bonus token). A tree of drafts (Medusa's or EAGLE's, drafts.py) has a row per node, the
node's own output index len(outputs) + its depth: the tokens emitted follow the path of
samples down the tree (drafts.accepted_path), the same rule along one branch.

For proposers that guess one token for sure (n-gram here), this is exactly rejection
sampling: a draft d is kept with probability p(d), and when it is not, the token comes
from p without d, renormalised, which is the residual max(0, p - q) / (1 - p(d)) of a
point-mass draft distribution q. So the output follows the target's distribution (its
temperature, top-k/top-p/min-p, bias and penalties included: the rows apply them as an
ordinary step does), and a seeded request gets the very tokens it gets without
speculation: output j is drawn with the same key from the same distribution.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from collections.abc import Callable

from jaxserve.config import SpeculativeConfig
from jaxserve.engine.batch import StepBatch
from jaxserve.engine.request import Request, Sequence, SequenceStatus
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from jaxserve.engine.speculative.drafts import Drafts, accepted_path, depths
from jaxserve.engine.speculative.proposers import NgramProposer, Proposer
from jaxserve.engine.speculative.state import state_of
from jaxserve.engine.speculative.stats import SpeculationStats


class Speculator:
    """The engine's seam for speculative decoding, and its default: no speculation, every
    method a no-op. Engine.step calls them in this order: `begin_step`, then
    `collects_first` (for the step in flight), `propose`, `dispatching` and `dispatched`
    around the runner's dispatch, `holds_back` (for the new step); collecting a step,
    `read_back`, `accepted_rows` (for each sequence that verified drafts), `commit` (for
    each that goes on) and `collected`."""

    stats: SpeculationStats | None = None

    def warmup(self, progress: bool = True) -> None:
        """Compile the proposer's programs."""

    def recover(self) -> None:
        """After a failed step: drop what it left and remake the proposer's device state."""

    def begin_step(self) -> None:
        """Before a step: decide whether it speculates."""

    def collects_first(self, prev) -> bool:
        """Whether the step in flight (`prev`: its record, from `dispatching`) must be
        collected before the next one is scheduled: its tokens are needed on the host to
        propose, or to know where the sequences it verified stand."""
        return False

    def propose(self, pending: dict[Sequence, tuple[int, int]] | None
                ) -> dict[Sequence, Drafts]:
        """Each running request's drafts for the coming step (`pending`: the step in
        flight's first row and drafts of each seq whose newest tokens it emits)."""
        return {}

    def dispatching(self, schedule: SchedulerOutput, batch: StepBatch):
        """Before the runner starts the step: what the step's speculation must remember
        until it is collected (returned; None when nothing)."""
        return None

    def dispatched(self, record, overlapped: bool) -> None:
        """After the runner started the step (`overlapped`: the one before is in flight)."""

    def holds_back(self, record) -> bool:
        """Whether a dispatched step (its record) must be collected before `Engine.step`
        returns."""
        return False

    def read_back(self, record) -> None:
        """Once the step before it is collected: bring the drafts it verified that were
        still on the device to the host (their ids fill the PLACEHOLDERs)."""

    def accepted_rows(self, s: ScheduledSeq, token_ids: np.ndarray) -> list[int]:
        """The rows of the step's outputs whose samples `s` emits: its first, and one
        after each draft accepted."""
        raise AssertionError("no drafts without speculative decoding")

    def commit(self, s: ScheduledSeq, out_index: int, rows: list[int],
               later: ScheduledSeq | None, record) -> None:
        """After `s` emitted the samples of `rows` into its PLACEHOLDERs from `out_index`
        and goes on (`later`: its seq in the step dispatched after, in flight)."""

    def collected(self) -> None:
        """After every sequence of a step is committed."""


@dataclasses.dataclass
class StepSpeculation:
    """What a dispatched step's speculation keeps until it is collected."""

    schedule: SchedulerOutput
    # The carry the step read drafts still on the device from (until they are read back).
    carry: jax.Array | None = None
    # Medusa heads' guesses at each sampled row `[R, heads, top]`, if the step made them.
    guesses: jax.Array | np.ndarray | None = None
    propose: bool = False

    @functools.cached_property
    def verifies(self) -> bool:
        return any(s.drafts for s in self.schedule.scheduled)

    def host_guesses(self) -> np.ndarray | None:
        if isinstance(self.guesses, jax.Array):
            self.guesses = np.asarray(self.guesses.addressable_data(0))
        return self.guesses


class SpeculativeDecoding(Speculator):
    """A speculative method over the engine's `target` runner and `scheduler`: `proposer`
    (n-gram's by default) guesses, the target's steps verify. `running` gives the running
    sequences' requests (Engine.running_requests)."""

    def __init__(self, config: SpeculativeConfig, target: ModelRunner, scheduler: Scheduler,
                 max_model_len: int, running: Callable[[], list[Request]],
                 proposer: Proposer | None = None):
        self.config = config
        self.target, self.scheduler, self.max_model_len = target, scheduler, max_model_len
        self.running = running
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min,
                                                  config.prompt_lookup_max)
        k = config.num_speculative_tokens
        self.stats = SpeculationStats(config.method, proposed=[0] * k, accepted=[0] * k)
        self.active = False  # this step may speculate (`begin_step`)
        # This step's verifications may run async (a draft model's chains: the carry keeps
        # their acceptance on the device and the next step moves back by it; Engine.step).
        self.overlap = False
        self._moves: list[tuple[int, int, int]] = []  # K/V to move: (data shard, src, dst)

    def warmup(self, progress: bool = True) -> None:
        self.proposer.warmup(progress)

    def recover(self) -> None:
        self._moves = []
        self.proposer.recover()

    def begin_step(self) -> None:
        """The policy: no speculation while the step is compute-bound, that is while more
        than `disable_by_batch_size` sequences run, or while it computes prompt tokens (a
        prompt's chunk makes a step compute-bound whatever the batch, and guessed tokens,
        and a proposer's catch-up over new sequences, only add to it); with no limit
        (None) every step may. Verifications run async where the layout allows it and no
        running request samples from its tokens on the host."""
        limit = self.config.disable_by_batch_size
        self.active = self.stats.active = limit is None or (
            self.scheduler.num_running <= limit and not self.scheduler.prefills_next)
        self.overlap = self.target.builder.layout.overlap and not any(
            req.samples_from_host for req in self.running())

    def collects_first(self, prev: StepSpeculation) -> bool:
        return (self.active and not self.overlap) or self.holds_back(prev)

    def holds_back(self, record: StepSpeculation) -> bool:
        return not self.overlap and record.verifies

    def propose(self, pending: dict[Sequence, tuple[int, int]] | None
                ) -> dict[Sequence, Drafts]:
        """Drafts for each decoding sequence, cut to the room it has left (drafts beyond
        room - 1 could never be emitted, nor a tree's nodes past room - 1 have a slot
        within max_model_len: its first room - 1 nodes are a tree too). Sequences with a
        grammar or token filters do not speculate (their drafts would need the grammar
        advanced through them, or the bad words matched against them), nor those whose
        request says not to."""
        if not self.active:
            return {}
        entries = []
        for req in self.running():
            seq = req.seq
            if (req.masks_tokens or not seq.params.speculative
                    or seq.num_tokens - seq.num_computed_tokens != 1):
                continue
            room = min(req.max_tokens - len(seq.output_token_ids),
                       self.max_model_len - seq.num_tokens)
            k = min(self.config.num_speculative_tokens, room - 1)
            if k > 0:
                entries.append((seq, k, room))
        proposals = self.proposer.propose_batch([(seq, k) for seq, k, _ in entries],
                                                self.scheduler, pending)
        return {seq: drafts.cut(room - 1)
                for (seq, _, room), drafts in zip(entries, proposals) if drafts}

    def dispatching(self, schedule: SchedulerOutput, batch: StepBatch) -> StepSpeculation:
        record = StepSpeculation(schedule, propose=self.active and self.target.medusa is not None)
        batch.propose = np.asarray(record.propose)
        if any(s.drafts.on_device for s in schedule.scheduled):
            record.carry = self.target.carry  # the step's dispatch replaces it
        return record

    def dispatched(self, record: StepSpeculation, overlapped: bool) -> None:
        if record.propose:
            record.guesses = self.target.guesses
        if record.verifies:
            self.stats.steps += 1
            self.stats.async_steps += overlapped

    def read_back(self, record: StepSpeculation) -> None:
        if record.carry is None:
            return
        ids = np.asarray(record.carry.addressable_data(0))
        for s in record.schedule.scheduled:
            if s.drafts.on_device:
                s.drafts.tokens[:] = ids[s.drafts.device_index].tolist()
        record.carry = None

    def accepted_rows(self, s: ScheduledSeq, token_ids: np.ndarray) -> list[int]:
        tree = s.drafts.tree
        accepted = accepted_path(s.drafts.tokens, tree, token_ids[s.row:])
        self.stats.record(max(depths(tree)), len(accepted))
        return [s.row] + [s.row + 1 + j for j in accepted]

    def commit(self, s: ScheduledSeq, out_index: int, rows: list[int],
               later: ScheduledSeq | None, record: StepSpeculation) -> None:
        """Drop the PLACEHOLDERs `rows` leave (the drafts rejected) and put the seq's
        counts where its emitted tokens leave them. The proposer's K/V stay valid up to
        the first emitted token, or with a draft model (`keeps_accepted`) up to the token
        before the last (its next round feeds those two, as an overlapping step does).
        With `later` (the seq's next step, in flight, scheduled as if every draft were
        kept) the seq's computed tokens and the proposer's move back by the dropped ones;
        else the rejected drafts' K/V slots are given up (Scheduler.rollback; a tree's
        accepted nodes move into place, `collected`). Medusa's guesses at the last row
        are kept for the next step."""
        seq, emitted = s.seq, len(rows)
        dropped = s.width - emitted
        del seq.output_token_ids[out_index + emitted:out_index + s.width]
        state = state_of(seq)
        start = seq.num_prompt_tokens + out_index  # the first emitted token's position
        guesses = record.host_guesses()
        if guesses is not None:  # they follow the last token: (tokens up to it, guesses)
            state.guesses = (start + emitted, guesses[rows[-1]].tolist())
        if seq.status is not SequenceStatus.RUNNING:  # preempted meanwhile: recomputed later
            return
        keep = start + emitted - 2 if self.proposer.keeps_accepted else start
        if later is None:
            state.computed = min(state.computed, keep)
            if s.drafts:
                accepted = [r - s.row - 1 for r in rows[1:]]
                self._moves += [(seq.data_shard, *m)
                                for m in self.scheduler.rollback(seq, accepted)]
            return
        if state.computed >= start + s.width:  # a later round fed the last two
            state.computed -= dropped
        else:
            state.computed = min(state.computed, keep)
        if dropped:
            seq.num_computed_tokens -= dropped
            self.scheduler.allocators[seq.data_shard].truncate(seq, seq.num_computed_tokens)

    def collected(self) -> None:
        """A tree's accepted nodes' K/V into the slots of their positions."""
        if self._moves:
            self.target.move(*self.target.moves(self._moves))
            self._moves = []
