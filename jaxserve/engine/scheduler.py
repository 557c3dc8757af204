"""Continuous batching: which sequences run each step, how many tokens each.

vLLM v1 style: there is no separate prefill and decode phase. Every sequence simply has
`num_tokens - num_computed_tokens` tokens left to compute (the whole prompt when it is
admitted, one token per step while it decodes) and each step hands out a budget of
`max_num_batched_tokens` tokens: running sequences first, in order, so decodes are never
starved by new prompts; then waiting sequences, whose prompts are cut into chunks that fit
what is left of the budget (chunked prefill). When KV pages run out, a running sequence is
preempted by recompute: its pages are freed and it goes back to the waiting queue with all
its tokens (prompt and outputs so far) to compute again, prefix cache permitting.

Speculative decoding: `schedule` may be given guessed next tokens for decoding sequences
(speculative/drafts.py). They are scheduled after a sequence's last token as extra query
tokens, within the budget (cut to what fits), in its `ScheduledSeq`; the step verifies
them, and `rollback` then puts the sequence back to its accepted tokens. Drafts not
scheduled in the step they were proposed for are dropped.

Under data parallelism the devices form `data_shards` groups, each with its own KV page
pool, its share of the sequence seats and of the token budget. A sequence is placed in one
shard when admitted (the one with the longest cached prefix, then the most free pages)
and stays there until it finishes or is preempted; preemption picks victims in the same
shard.

Plain Python over plain data, tested without JAX.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.request import Sequence, SequenceStatus
from jaxserve.engine.speculative.drafts import NO_DRAFTS, Drafts

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.lora import LoraManager
    from jaxserve.engine.multimodal.encoder_cache import EncoderCache

POLICIES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    num_pages: int  # per data shard
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # or "priority": lower Sequence.priority first, then arrival
    data_shards: int = 1

    @classmethod
    def of_engine(cls, config: EngineConfig, max_model_len: int, num_pages: int,
                  data_shards: int) -> SchedulerConfig:
        return cls(max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   max_model_len=max_model_len, page_size=config.page_size,
                   num_pages=num_pages, enable_prefix_caching=config.enable_prefix_caching,
                   policy=config.scheduling_policy, data_shards=data_shards)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size",
                     "num_pages", "data_shards"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) % self.data_shards:
                raise ValueError(f"{name} ({getattr(self, name)}) must divide evenly over "
                                 f"the {self.data_shards} data-parallel shards")
        # Otherwise a sequence near max_model_len could never get all its pages, even
        # alone, and would be preempted and readmitted forever.
        if self.num_pages * self.page_size < self.max_model_len:
            raise ValueError(
                f"KV pool of {self.num_pages} pages x {self.page_size} tokens cannot hold "
                f"one sequence of max_model_len={self.max_model_len} tokens"
            )


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # = seq.num_computed_tokens when scheduled: first position of this chunk
    num_new_tokens: int  # tokens seq.token_ids[start:start + num_new_tokens] computed this step
    # The chunk ends at the seq's last token, so the step's sample for it is its next token
    # (a partial prompt chunk's sample is discarded).
    samples: bool = False
    # Decode steps run in one program (Scheduler.schedule's `steps`): the seq decodes one
    # token, then each step's sample, and emits a token per step.
    steps: int = 1
    # Guessed tokens scheduled after the seq's last token (the chunk's last len(drafts)
    # tokens): the step samples a row for each and one more, rows `row...row + len(drafts)`.
    drafts: Drafts = NO_DRAFTS
    row: int = -1  # its (first) row in the step's sampled outputs (BatchBuilder.build sets it)
    token: int = -1  # its chunk's first token in the step's batch (likewise)

    @property
    def width(self) -> int:
        """The most tokens the step emits for the seq (the engine appends as many
        PLACEHOLDERs to its outputs when it dispatches the step)."""
        return self.steps + len(self.drafts.tokens)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # running seqs (in running order), then newly admitted ones
    preempted: list[Sequence]
    num_batched_tokens: int
    # Waiting seqs that cannot run, with why (their LoRA adapter could not be read again),
    # now finished with reason "error".
    failed: list[tuple[Sequence, str]] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue, the running list and the page allocator."""

    def __init__(self, config: SchedulerConfig, adapters: LoraManager | None = None,
                 images: EncoderCache | None = None):
        self.config = config
        # LoRA adapters' device slots (engine/lora.py): a step holds at most max_loras.
        self.adapters = adapters
        # The image embeddings' rows (multimodal/encoder_cache.py): a seq is admitted
        # with rows for its images.
        self.images = images
        self.allocators = [PageAllocator(config.num_pages, config.page_size,
                                         config.enable_prefix_caching)
                           for _ in range(config.data_shards)]
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
    def prefills_next(self) -> bool:
        """Whether the next schedule is likely to compute prompt tokens: a running
        sequence has prompt left to compute (chunked prefill), or a request waits while a
        seat is free (pages may still keep it out)."""
        return (any(seq.num_computed_tokens < seq.num_tokens - 1 for seq in self.running)
                or bool(self.waiting) and len(self.running) < self.config.max_num_seqs)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    @property
    def allocator(self) -> PageAllocator:
        """The page allocator (one data shard only; see `allocators`)."""
        assert len(self.allocators) == 1, "several data shards: use allocators"
        return self.allocators[0]

    @property
    def num_pages(self) -> int:
        return sum(a.num_pages for a in self.allocators)

    @property
    def num_used_pages(self) -> int:
        return sum(a.num_used_pages for a in self.allocators)

    @property
    def prefix_queries(self) -> int:
        return sum(a.prefix_queries for a in self.allocators)

    @property
    def prefix_hits(self) -> int:
        return sum(a.prefix_hits for a in self.allocators)

    @property
    def host_hits(self) -> int:
        return sum(a.host_hits for a in self.allocators)

    # ---------------------------------------------------------------- lifecycle

    def add(self, seq: Sequence) -> None:
        """Queue a new request (its id new, its tokens within max_model_len: the engine
        checks both). Its arrival number breaks ties between equal priorities."""
        assert seq.request_id not in self._requests, seq.request_id
        assert 0 < seq.num_tokens <= self.config.max_model_len, seq.num_tokens
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
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self._requests.get(seq.request_id) is seq:
            del self._requests[seq.request_id]

    # --------------------------------------------------------------- scheduling

    def schedule(self, steps: int = 1, drafts: Mapping[Sequence, Drafts] | None = None
                 ) -> SchedulerOutput:
        """Pick this step's work within the token budget (see the module docstring), with
        each running seq's `drafts` (if any) after its last token, as far as they fit.

        The picked tokens count as computed from here on (`num_computed_tokens` advances),
        as the step computing them is dispatched next: the schedule after it already
        builds on them, whether or not the host has seen this step's outputs yet.

        `steps` > 1 (the caller has checked that every running seq decodes, without
        drafts, and has room for that many more tokens): the step is that many decode
        steps in one program (programs.decode_steps). Each running seq gets pages for all
        of them and counts `steps` tokens computed; no waiting seq is admitted.
        """
        out = SchedulerOutput(scheduled=[], preempted=[], num_batched_tokens=0)
        shards = self.config.data_shards
        budgets = [self.config.max_num_batched_tokens // shards] * shards
        self._schedule_running(out, budgets, steps, drafts or {})
        admitted = len(out.scheduled)
        # A step that had to preempt is short of pages: admitting new work now would only
        # get it preempted next (vLLM does the same). This also keeps the seqs preempted
        # in this step from being readmitted in it.
        if not out.preempted and steps == 1:
            self._schedule_waiting(out, budgets)
        out.num_batched_tokens = self.config.max_num_batched_tokens - sum(budgets)
        for s in out.scheduled[admitted:]:  # (the running seqs' are set as scheduled)
            s.samples = s.start + s.num_new_tokens == s.seq.num_tokens
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
        return out

    def rollback(self, seq: Sequence, accepted: list[int] | None = None
                 ) -> list[tuple[int, int]]:
        """After a step verified `seq`'s drafts and its accepted tokens were appended: the
        tokens before its last one have K/V (the rejected drafts' slots are stale, to be
        overwritten), and the pages past its tokens go back to the pool. A tree's
        `accepted` nodes (speculative/drafts.py) have theirs in their nodes' slots: returns
        the (src, dst) slots of those outside the slots of their positions, for the caller
        to move there (ModelRunner.move) before any step reads them."""
        seq.num_computed_tokens = seq.num_tokens - 1
        accepted = accepted or []
        base, size = seq.num_tokens - 1 - len(accepted), self.config.page_size
        slot = lambda p: seq.page_ids[p // size] * size + p % size  # noqa: E731
        moves = [(slot(base + j), slot(base + i)) for i, j in enumerate(accepted) if i != j]
        self.allocators[seq.data_shard].truncate(seq, seq.num_tokens)
        return moves

    def cache_pages(self, out: SchedulerOutput) -> None:
        """Offer the prefix cache every page of the scheduled seqs now full of known
        tokens: call it once the tokens before each chunk are known on the host (with
        async scheduling, after the previous step's samples are in). Seqs finished or
        aborted since `schedule` are skipped."""
        if not self.config.enable_prefix_caching:
            return
        for s in out.scheduled:
            if s.seq.status is SequenceStatus.RUNNING:
                self.allocators[s.seq.data_shard].commit(s.seq)

    # ---------------------------------------------------------------- internals

    def _order_key(self, seq: Sequence) -> Any:
        if self.config.policy == "priority":
            return (seq.priority, seq.arrival)
        return seq.arrival

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self._order_key)

    def _schedule_running(self, out: SchedulerOutput, budgets: list[int], steps: int,
                          drafts: Mapping[Sequence, Drafts]) -> None:
        """Schedule running seqs in order (with their drafts), preempting (in the same
        data shard) when pages run out. Takes the tokens from `budgets`, one per data
        shard. With `steps` > 1 each seq's pages reach as far as that many decode steps
        write.

        A seq gets what is left of its tokens (and drafts), capped by the budget; none
        once the steps in flight bring its last output (a step for it would be thrown
        away, and with async scheduling the next request's first step would wait for
        it). One loop, the same few lines for every running seq each step: a decoding
        seq's usual case (one token, room in its pages) costs ~1.4 us on a 2-core Zen 3."""
        i, page_size, max_len = 0, self.config.page_size, self.config.max_model_len
        running, scheduled = self.running, out.scheduled
        while i < len(running):
            seq = running[i]
            data_shard, start = seq.data_shard, seq.num_computed_tokens
            outputs = seq.output_token_ids
            num_tokens = len(seq.prompt_token_ids) + len(outputs)
            assert num_tokens <= max_len, (
                f"{seq.request_id}: {num_tokens} tokens > max_model_len; the engine must stop it")
            limit = seq.max_output_tokens
            guesses = drafts.get(seq) if drafts else None
            n = 0
            if limit is None or len(outputs) < limit:
                ahead = len(guesses) if guesses is not None else 0
                n = min(num_tokens + ahead - start, budgets[data_shard])
                if seq.whole_images:
                    n = seq.chunk(start, n)
            if n <= 0:  # the data shard's budget is spent (or an image does not fit it)
                i += 1
                continue
            need = start + n + steps - 1
            if need > len(seq.page_ids) * page_size:  # (most steps: within its pages)
                allocator, gone = self.allocators[data_shard], False
                while not gone and not allocator.allocate_more(seq, need):
                    victim = self._pick_victim(data_shard)
                    j = running.index(victim)
                    budgets[data_shard] += self._preempt(victim, out)
                    gone = victim is seq  # (then i is already the next seq's)
                    if j < i:  # (priority policy) a seq already scheduled this step
                        i -= 1
                if gone:
                    continue
            end = start + n
            # Its drafts that fit after its own tokens; it samples if the chunk ends there.
            cut = NO_DRAFTS if guesses is None else guesses.cut(end - num_tokens)
            scheduled.append(ScheduledSeq(seq, start, n, end == num_tokens + len(cut.tokens),
                                          steps, cut))
            seq.num_computed_tokens = end + steps - 1
            budgets[data_shard] -= n
            i += 1

    def _schedule_waiting(self, out: SchedulerOutput, budgets: list[int]) -> None:
        """Admit waiting seqs in order while budget, seats and pages last."""
        if not self.waiting:
            return
        shards = self.config.data_shards
        seats = [self.config.max_num_seqs // shards] * shards
        if shards == 1:
            seats[0] -= len(self.running)
        else:
            for seq in self.running:
                seats[seq.data_shard] -= 1
        while self.waiting:
            seq = self.waiting[0]
            if self.adapters is not None:
                if not self.adapters.can_acquire(seq):
                    break  # every adapter slot is in use by running seqs
                try:
                    self.adapters.ready(seq)
                except (OSError, ValueError) as e:  # this request fails, no other
                    out.failed.append((seq, f"LoRA adapter {seq.lora.lora_name!r} could not "
                                            f"be read again: {type(e).__name__}: {e}"))
                    self.finish(seq, "error")
                    continue
            if seq.images and not self.images.can_acquire(seq):
                break  # the image rows are held by running seqs' prompts
            data_shard = self._place(seq, budgets, seats)
            if data_shard is None:
                break  # head of line waits for pages; running seqs are not preempted for it
            if self.adapters is not None:
                self.adapters.acquire(seq)
            if seq.images:  # those past its cached prefix
                self.images.acquire(seq)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_at is None:
                seq.first_scheduled_at = time.monotonic()
            self.running.append(seq)
            n = seq.chunk(seq.num_computed_tokens,
                          min(seq.num_tokens - seq.num_computed_tokens, budgets[data_shard]))
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budgets[data_shard] -= n
            seats[data_shard] -= 1

    def _place(self, seq: Sequence, budgets: list[int], seats: list[int]) -> int | None:
        """Give a waiting seq pages in the data shard with budget and a seat that caches
        the longest prefix of it, then has the most free pages; None if none can."""
        cached = {d: self.allocators[d].lookup_prefix(seq)
                  for d in range(len(self.allocators)) if budgets[d] > 0 and seats[d] > 0}
        order = sorted(cached, key=lambda d: (-cached[d], -self.allocators[d].num_free_pages, d))
        for d in order:
            # Tokens whose K/V came with the seq (prefilled elsewhere) count as computed.
            start = max(cached[d], seq.num_prefilled_tokens)
            n = seq.chunk(start, min(seq.num_tokens - start, budgets[d]))
            if n > 0 and self.allocators[d].allocate_prompt(seq, start - cached[d] + n):
                assert seq.num_computed_tokens == cached[d]
                seq.num_computed_tokens = start
                seq.data_shard = d
                for other in self.allocators:
                    if other is not self.allocators[d]:
                        other.forget(seq)
                return d
        return None

    def _pick_victim(self, data_shard: int) -> Sequence:
        """fcfs: the latest admitted running seq of the data shard; priority: its worst
        (priority, arrival)."""
        candidates = [s for s in self.running if s.data_shard == data_shard]
        if self.config.policy == "priority":
            return max(candidates, key=lambda s: (s.priority, s.arrival))
        return candidates[-1]

    def _release(self, seq: Sequence) -> None:
        """Free `seq`'s pages in its shard and forget its lookups in the others (and its
        adapter's slot, its images' rows)."""
        if self.adapters is not None:
            self.adapters.release(seq)
        if seq.images:
            self.images.release(seq)
        for d, alloc in enumerate(self.allocators):
            if d == seq.data_shard:
                alloc.free(seq)
            else:
                alloc.forget(seq)

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
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        out.preempted.append(seq)
        return refund
