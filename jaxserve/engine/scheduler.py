"""Continuous batching: which sequences run each step, how many tokens each.

vLLM v1 style: there is no separate prefill and decode phase. Every sequence simply has
`num_tokens - num_computed_tokens` tokens left to compute (the whole prompt when it is
admitted, one token per step while it decodes) and each step hands out a budget of
`max_num_batched_tokens` tokens: running sequences first, in order, so decodes are never
starved by new prompts; then waiting sequences, whose prompts are cut into chunks that fit
what is left of the budget (chunked prefill). When KV pages run out, a running sequence is
preempted by recompute: its pages are freed and it goes back to the waiting queue with all
its tokens (prompt and outputs so far) to compute again, prefix cache permitting.

Plain Python over plain data, tested without JAX.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Any

from jaxserve.engine.kv_cache import PageAllocator
from jaxserve.engine.request import Sequence, SequenceStatus

POLICIES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    num_pages: int
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # or "priority": lower Sequence.priority first, then arrival

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size", "num_pages"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        # Otherwise a sequence near max_model_len could never get all its pages, even
        # alone, and would be preempted and readmitted forever.
        if self.num_pages * self.page_size < self.max_model_len:
            raise ValueError(
                f"KV pool of {self.num_pages} pages x {self.page_size} tokens cannot hold "
                f"one sequence of max_model_len={self.max_model_len} tokens"
            )


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # = seq.num_computed_tokens when scheduled: first position of this chunk
    num_new_tokens: int  # tokens seq.token_ids[start:start + num_new_tokens] computed this step


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # running seqs (in running order), then newly admitted ones
    preempted: list[Sequence]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue, the running list and the page allocator."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.allocator = PageAllocator(config.num_pages, config.page_size, config.enable_prefix_caching)
        # Kept sorted by `_order_key`. For fcfs that is arrival order, and a preempted seq
        # (which arrived before every waiting one) lands at the front.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.num_preemptions = 0  # total, for status and tests

    # ------------------------------------------------------------------ queries

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    # ---------------------------------------------------------------- lifecycle

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Its arrival number breaks ties between equal priorities."""
        if seq.request_id in self._requests:
            raise ValueError(f"request {seq.request_id!r} is already scheduled")
        if not 0 < seq.num_tokens <= self.config.max_model_len:
            raise ValueError(
                f"request {seq.request_id!r} has {seq.num_tokens} tokens, "
                f"need 1..max_model_len={self.config.max_model_len}"
            )
        seq.arrival = next(self._arrivals)
        seq.status = SequenceStatus.WAITING
        self._requests[seq.request_id] = seq
        self._enqueue(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a waiting or running request; None if the id is unknown (or done)."""
        seq = self._requests.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished, free its pages and forget it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self._requests.get(seq.request_id) is seq:
            del self._requests[seq.request_id]

    # --------------------------------------------------------------- scheduling

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within the token budget; see the module docstring."""
        out = SchedulerOutput(scheduled=[], preempted=[], num_batched_tokens=0)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # A step that had to preempt is short of pages: admitting new work now would only
        # get it preempted next (vLLM does the same). This also keeps the seqs preempted
        # in this step from being readmitted in it.
        if not out.preempted:
            budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        return out

    def on_step_done(self, out: SchedulerOutput) -> list[Sequence]:
        """Record the step's progress; return the seqs whose sampled token is real.

        Those are the seqs now fully computed: the engine appends their sampled token and
        checks stop conditions. Seqs still mid-prompt (a partial chunk) are not returned,
        nor seqs finished or aborted since `schedule`.
        """
        done: list[Sequence] = []
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = s.start + s.num_new_tokens
            self.allocator.commit(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                done.append(seq)
        return done

    # ---------------------------------------------------------------- internals

    def _order_key(self, seq: Sequence) -> Any:
        if self.config.policy == "priority":
            return (seq.priority, seq.arrival)
        return seq.arrival

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self._order_key)

    def _num_to_compute(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute this step: what is left, capped by the budget."""
        assert seq.num_tokens <= self.config.max_model_len, (
            f"{seq.request_id}: {seq.num_tokens} tokens > max_model_len; the engine must stop it"
        )
        return min(seq.num_tokens - seq.num_computed_tokens, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule running seqs in order, preempting when pages run out. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._num_to_compute(seq, budget)
            if n <= 0:  # engine has not appended its token yet: nothing to do for it
                i += 1
                continue
            scheduled = True
            while not self.allocator.allocate_more(seq, seq.num_computed_tokens + n):
                victim = self._pick_victim()
                j = self.running.index(victim)
                budget += self._preempt(victim, out)
                if victim is seq:
                    scheduled = False
                    break
                if j < i:  # (priority policy) a seq already scheduled this step
                    i -= 1
            if not scheduled:
                break
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting seqs in order while budget, seat and pages last. Returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_cached = self.allocator.lookup_prefix(seq)
            n = min(seq.num_tokens - num_cached, budget)
            if not self.allocator.allocate_prompt(seq, n):
                break  # head of line waits for pages; running seqs are not preempted for it
            assert seq.num_computed_tokens == num_cached
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        return budget

    def _pick_victim(self) -> Sequence:
        """fcfs: the latest admitted running seq; priority: the worst (priority, arrival)."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival))
        return self.running[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Free `seq`'s pages and requeue it for full recompute.

        Returns the tokens given back to the budget: non-zero only when `seq` had already
        been scheduled in this step (possible under the priority policy).
        """
        self.running.remove(seq)
        refund = 0
        for k, s in enumerate(out.scheduled):
            if s.seq is seq:
                refund = out.scheduled.pop(k).num_new_tokens
                break
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        out.preempted.append(seq)
        return refund
