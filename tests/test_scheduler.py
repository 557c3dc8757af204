"""Scheduler: token budget, chunked prefill, preemption, prefix hits, policies. No JAX.

`Sim` stands in for the engine: schedule (which advances the scheduled seqs) -> fake
device step -> cache_pages -> append a token to the seqs whose sample is real -> finish at
a target length. The fake device keeps a page pool
of token ids and checks, every step, that each scheduled seq's pages hold exactly its
tokens before `start` (so a wrong prefix hit, or a shared page being overwritten, fails),
and that only pages owned by a single seq are ever written.
"""

from __future__ import annotations

import random

import pytest

from jaxserve.engine.request import Sequence, SequenceStatus
from jaxserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def fake_token(tokens: list[int]) -> int:
    """A deterministic 'model': identical token histories give identical outputs."""
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 7


def expected_outputs(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_token(tokens))
    return tokens[len(prompt) :]


def config(**kw) -> SchedulerConfig:
    base = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, page_size=4, num_pages=64
    )
    base.update(kw)
    return SchedulerConfig(**base)


def prefix_keys(tokens: list[int]) -> list[tuple[int, int]]:
    """What a real K/V entry depends on: its position and every token up to it."""
    keys, h = [], 0
    for pos, tok in enumerate(tokens):
        h = hash((h, tok))
        keys.append((pos, h))
    return keys


class FakeDevice:
    """The KV pools (one per data shard) as one prefix key per slot, to check what
    attention would read."""

    def __init__(self, data_shards: int, num_pages: int, page_size: int):
        self.page_size = page_size
        self.kv: list[list[list[tuple[int, int] | None]]] = [
            [[None] * page_size for _ in range(num_pages)] for _ in range(data_shards)]

    def step(self, sched: Scheduler, out: SchedulerOutput) -> None:
        ps = self.page_size
        for s in out.scheduled:
            keys = prefix_keys(s.seq.token_ids)
            pool, alloc = self.kv[s.seq.data_shard], sched.allocators[s.seq.data_shard]
            for pos in range(s.start):  # the context this chunk attends to
                page = s.seq.page_ids[pos // ps]
                assert pool[page][pos % ps] == keys[pos], (s.seq.request_id, pos)
            for pos in range(s.start, s.start + s.num_new_tokens):
                page = s.seq.page_ids[pos // ps]
                assert alloc.refcount(page) == 1, "writing into a shared page"
                pool[page][pos % ps] = keys[pos]


class Sim:
    """A tiny engine loop that checks the scheduler's invariants every step."""

    def __init__(self, sched: Scheduler, check_kv: bool = True):
        self.sched = sched
        self.cfg = sched.config
        self.device = (FakeDevice(self.cfg.data_shards, self.cfg.num_pages, self.cfg.page_size)
                       if check_kv else None)
        self.targets: dict[str, int] = {}  # request_id -> number of outputs wanted
        self.seqs: list[Sequence] = []
        self.outputs: list[SchedulerOutput] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0) -> Sequence:
        seq = Sequence(request_id=rid, prompt_token_ids=list(prompt), priority=priority)
        self.targets[rid] = max_tokens
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        sched, cfg = self.sched, self.cfg
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        computed_before = {id(s): s.num_computed_tokens for s in running_before}
        out = sched.schedule()
        self.check_output(out, running_before, waiting_before, computed_before)
        if self.device is not None:
            self.device.step(sched, out)
        sched.cache_pages(out)
        for seq in [s.seq for s in out.scheduled if s.samples]:
            assert seq.num_computed_tokens == seq.num_tokens
            seq.output_token_ids.append(fake_token(seq.token_ids))
            if len(seq.output_token_ids) >= self.targets[seq.request_id] or seq.num_tokens >= cfg.max_model_len:
                sched.finish(seq, "length")
        self.check_pages()
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished:
                return
            self.step()
        raise AssertionError("scheduler did not drain (livelock?)")

    def check_output(self, out, running_before, waiting_before, computed_before) -> None:
        sched, cfg = self.sched, self.cfg
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        assert len(out.scheduled) <= cfg.max_num_seqs
        for d in range(cfg.data_shards):  # each data shard within its share
            assert sum(s.num_new_tokens for s in out.scheduled
                       if s.seq.data_shard == d) <= cfg.max_num_batched_tokens // cfg.data_shards
            assert sum(s.data_shard == d for s in sched.running) <= cfg.max_num_seqs // cfg.data_shards
        ids = [id(s.seq) for s in out.scheduled]
        assert len(ids) == len(set(ids)), "a seq scheduled twice in one step"
        for s in out.scheduled:
            seq = s.seq
            assert s.num_new_tokens >= 1
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            assert s.start + s.num_new_tokens == seq.num_computed_tokens  # counted at once
            assert s.samples == (seq.num_computed_tokens == seq.num_tokens)
            assert s.start + s.num_new_tokens <= seq.num_tokens <= cfg.max_model_len
            assert len(seq.page_ids) * cfg.page_size >= s.start + s.num_new_tokens
            if id(seq) in computed_before:  # a running seq continues where it was
                assert s.start == computed_before[id(seq)]
        # Running seqs first, in running order; then admissions, in waiting order.
        before = {id(s) for s in running_before}
        kinds = [id(s.seq) in before for s in out.scheduled]
        assert kinds == sorted(kinds, reverse=True), "a prefill was scheduled before a decode"
        old = [s.seq for s in out.scheduled if id(s.seq) in before]
        assert old == [s for s in running_before if any(s is o for o in old)]
        new = [s.seq for s in out.scheduled if id(s.seq) not in before]
        assert new == waiting_before[: len(new)], "admissions out of waiting order"
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq in sched.waiting
            assert seq.page_ids == [] and seq.num_computed_tokens == 0
            assert all(s.seq is not seq for s in out.scheduled)
        if out.preempted:
            assert not new, "admitted new work in a step that had to preempt"

    def check_pages(self) -> None:
        sched = self.sched
        for seq in sched.waiting:
            assert seq.page_ids == [] and seq.status is SequenceStatus.WAITING
        for d, alloc in enumerate(sched.allocators):
            alloc.check_invariants()
            running = [s for s in sched.running if s.data_shard == d]
            for page in range(alloc.num_pages):
                assert alloc.refcount(page) == sum(s.page_ids.count(page) for s in running)
            assert alloc.num_used_pages == len({p for s in running for p in s.page_ids})

    def assert_drained(self) -> None:
        assert not self.sched.has_unfinished
        assert self.sched.num_used_pages == 0
        for alloc in self.sched.allocators:
            assert alloc.num_free_pages == alloc.num_pages
            assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))
            assert not alloc._seqs, "bookkeeping kept for a finished sequence"
            alloc.check_invariants()
        for seq in self.seqs:
            assert seq.is_finished and seq.page_ids == []
            if seq.finish_reason == "length":
                want = min(self.targets[seq.request_id], self.cfg.max_model_len - seq.num_prompt_tokens)
                want = max(want, 1)
                assert seq.output_token_ids == expected_outputs(seq.prompt_token_ids, want), seq.request_id
            else:
                assert seq.finish_reason == "abort"


# ------------------------------------------------------------------ random runs


@pytest.mark.parametrize(
    "seed, policy, caching, num_pages, data_shards",
    [
        (0, "fcfs", True, 24, 1),
        (1, "fcfs", False, 24, 1),
        (2, "priority", True, 24, 1),
        (3, "priority", False, 20, 1),
        (4, "fcfs", True, 64, 1),
        (5, "fcfs", True, 20, 2),
        (6, "priority", True, 16, 2),
    ],
)
def test_random_run_respects_budget_and_leaks_nothing(seed, policy, caching, num_pages,
                                                      data_shards):
    rng = random.Random(seed)
    cfg = config(
        max_num_seqs=6 * data_shards,
        max_num_batched_tokens=16 * data_shards,
        max_model_len=48,
        num_pages=num_pages,
        enable_prefix_caching=caching,
        policy=policy,
        data_shards=data_shards,
    )
    sim = Sim(Scheduler(cfg))
    prefixes = [[rng.randrange(7) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    num_requests, added, aborted = 60, 0, 0
    for step in range(20_000):
        if added < num_requests:
            for _ in range(min(rng.choice([0, 0, 1, 2]), num_requests - added)):
                prompt = rng.choice(prefixes)[: rng.randrange(1, 21)]
                prompt = prompt + [rng.randrange(7) for _ in range(rng.randrange(0, 25))]
                sim.add(f"r{added}", prompt, max_tokens=rng.randrange(1, 20), priority=rng.randrange(3))
                added += 1
        if rng.random() < 0.03 and sim.sched.has_unfinished:
            live = list(sim.sched.waiting) + list(sim.sched.running)
            victim = rng.choice(live)
            assert sim.sched.abort(victim.request_id) is victim
            assert victim.status is SequenceStatus.FINISHED and victim.finish_reason == "abort"
            assert victim.page_ids == []
            aborted += 1
            sim.check_pages()
        if added == num_requests and not sim.sched.has_unfinished:
            break
        sim.step()
    else:
        raise AssertionError("did not drain")
    sim.assert_drained()
    assert aborted > 0
    assert max(o.num_batched_tokens for o in sim.outputs) == cfg.max_num_batched_tokens
    preemptions = sum(s.num_preemptions for s in sim.seqs)
    if num_pages <= 24:
        assert preemptions > 0, "the pool was meant to be too small"
    hits = [a.prefix_hits for a in sim.sched.allocators]
    assert all(hits) if caching else not any(hits)
    # Every data shard ran requests.
    assert {s.data_shard for s in sim.seqs} == set(range(data_shards))


def test_random_run_with_abort_between_schedule_and_cache_pages():
    """A seq aborted while its step runs (after `schedule`, before `cache_pages`) keeps no
    page: cache_pages skips it instead of registering pages it no longer holds."""
    rng = random.Random(7)
    sched = Scheduler(config(max_num_batched_tokens=12, num_pages=16, max_model_len=40))
    sim = Sim(sched, check_kv=False)
    for i in range(20):
        sim.add(f"r{i}", [rng.randrange(5) for _ in range(rng.randrange(1, 30))], max_tokens=8)
    while sched.has_unfinished:
        out = sched.schedule()
        victim = None
        if out.scheduled and rng.random() < 0.3:
            victim = rng.choice(out.scheduled).seq
            sched.abort(victim.request_id)
            assert victim.page_ids == [] and victim.is_finished
        cached = sched.allocator.num_cached_pages
        sched.cache_pages(out)
        if victim is not None and len(out.scheduled) == 1:
            assert sched.allocator.num_cached_pages == cached  # nothing of the victim's
        done = [s.seq for s in out.scheduled if s.samples and s.seq is not victim]
        for seq in done:
            seq.output_token_ids.append(0)
            if len(seq.output_token_ids) >= 8 or seq.num_tokens >= 40:
                sched.finish(seq, "length")
        sim.check_pages()
    assert sched.allocator.num_used_pages == 0
    assert sched.allocator.num_free_pages == sched.allocator.num_pages


# --------------------------------------------------------------- budget & order


def test_decodes_are_scheduled_before_new_prefills():
    sched = Scheduler(config(max_num_batched_tokens=10))
    sim = Sim(sched)
    a = sim.add("a", [1, 2, 3], max_tokens=10)
    b = sim.add("b", [4, 5], max_tokens=10)
    out = sim.step()
    assert [(s.seq, s.start, s.num_new_tokens) for s in out.scheduled] == [(a, 0, 3), (b, 0, 2)]
    c = sim.add("c", list(range(30)), max_tokens=10)
    out = sim.step()
    assert [(s.seq, s.start, s.num_new_tokens) for s in out.scheduled] == [(a, 3, 1), (b, 2, 1), (c, 0, 8)]
    out = sim.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1), (c, 8)]


def test_long_prompt_is_split_into_budget_sized_chunks():
    sched = Scheduler(config(max_num_batched_tokens=32, max_model_len=128, num_pages=40))
    seq = Sequence("long", list(range(100)))
    sched.add(seq)
    chunks = []
    while True:
        out = sched.schedule()
        assert out.num_batched_tokens <= 32
        (s,) = out.scheduled
        chunks.append((s.start, s.num_new_tokens))
        sched.cache_pages(out)
        done = [s.seq for s in out.scheduled if s.samples]
        if seq.num_computed_tokens < 100:
            assert done == []  # a partial chunk samples nothing real
        else:
            assert done == [seq]
            break
    assert chunks == [(0, 32), (32, 32), (64, 32), (96, 4)]
    assert len(seq.page_ids) == 25


def test_budget_is_shared_between_a_chunk_and_other_prompts():
    sched = Scheduler(config(max_num_batched_tokens=16, num_pages=40, max_model_len=64))
    sim = Sim(sched)
    a = sim.add("a", list(range(20)))
    b = sim.add("b", [7, 7, 7])
    out = sim.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 16)]
    out = sim.step()  # a finishes its prompt (4), b is admitted with the rest
    assert [(s.seq, s.start, s.num_new_tokens) for s in out.scheduled] == [(a, 16, 4), (b, 0, 3)]


def test_max_num_seqs_is_respected():
    sched = Scheduler(config(max_num_seqs=2))
    sim = Sim(sched)
    seqs = [sim.add(f"r{i}", [i, i + 1], max_tokens=3) for i in range(5)]
    out = sim.step()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 3
    while sched.has_unfinished:
        out = sim.step()
        assert sched.num_running <= 2
    sim.assert_drained()


def test_priority_policy_orders_admissions():
    sched = Scheduler(config(max_num_seqs=1, policy="priority"))
    sim = Sim(sched)
    low = sim.add("low", [1, 2], max_tokens=1, priority=5)
    mid1 = sim.add("mid1", [3], max_tokens=1, priority=1)
    high = sim.add("high", [4], max_tokens=1, priority=0)
    mid2 = sim.add("mid2", [5], max_tokens=1, priority=1)
    order = []
    while sched.has_unfinished:
        out = sim.step()
        order += [s.seq for s in out.scheduled if s.start == 0]
    assert order == [high, mid1, mid2, low]


def test_fcfs_ignores_priority():
    sched = Scheduler(config(max_num_seqs=1))
    sim = Sim(sched)
    a = sim.add("a", [1], max_tokens=1, priority=5)
    b = sim.add("b", [2], max_tokens=1, priority=0)
    order = []
    while sched.has_unfinished:
        order += [s.seq for s in sim.step().scheduled]
    assert order == [a, b]
    assert (a.arrival, b.arrival) == (0, 1)


# ------------------------------------------------------------------ preemption


def test_fcfs_preempts_the_latest_and_readmits_it_first_with_full_recompute():
    # 6 pages of 4 tokens; three 7-token prompts take 2 pages each. The third step needs
    # a third page for everyone: the latest seq is preempted.
    sched = Scheduler(config(num_pages=6, max_model_len=24, enable_prefix_caching=False))
    sim = Sim(sched)
    a = sim.add("a", list(range(7)), max_tokens=4)
    b = sim.add("b", list(range(10, 17)), max_tokens=4)
    c = sim.add("c", list(range(20, 27)), max_tokens=4)
    sim.step()
    sim.step()
    assert sched.allocator.num_free_pages == 0
    out = sim.step()
    assert out.preempted == [c]
    assert [s.seq for s in out.scheduled] == [a, b]
    assert c.num_preemptions == 1 and c.num_computed_tokens == 0 and c.page_ids == []
    assert c.status is SequenceStatus.WAITING and sched.waiting[0] is c
    assert len(c.output_token_ids) == 2  # its outputs so far are kept, to be recomputed

    d = sim.add("d", list(range(30, 33)), max_tokens=1)
    assert list(sched.waiting) == [c, d]
    readmit = None
    while readmit is None:
        out = sim.step()
        starts = {s.seq.request_id: s for s in out.scheduled if s.seq in (c, d)}
        if starts:
            assert "c" in starts, "d admitted before the preempted c"
            readmit = starts["c"]
    assert readmit.start == 0
    assert readmit.num_new_tokens == 7 + 2  # prompt + outputs, all recomputed
    sim.run()
    sim.assert_drained()
    assert c.output_token_ids == expected_outputs(c.prompt_token_ids, 4)


def test_preempted_seq_gets_prefix_hits_on_readmission():
    # As above with one spare page: b takes the tail page c released, c's head page stays
    # cached, so c's recompute starts after it.
    sched = Scheduler(config(num_pages=7, max_model_len=28))
    sim = Sim(sched)
    sim.add("a", list(range(7)), max_tokens=4)
    b = sim.add("b", list(range(10, 17)), max_tokens=4)
    c = sim.add("c", list(range(20, 27)), max_tokens=6)
    sim.step()
    sim.step()
    out = sim.step()
    assert out.preempted == [c]
    assert sched.allocator.lookup_prefix(c) == 4
    readmit = None
    while readmit is None:
        readmit = next((s for s in sim.step().scheduled if s.seq is c), None)
    assert (readmit.start, readmit.num_new_tokens) == (4, 9 - 4)
    assert c.num_cached_tokens == 4
    sim.run()
    sim.assert_drained()
    assert c.output_token_ids == expected_outputs(c.prompt_token_ids, 6)


def _two_seqs_race_for_the_last_page(policy: str):
    """a (priority 5) admitted a step before b (priority 0); at step 5 both need a new page
    and a, scheduled first, took the last free one."""
    sched = Scheduler(config(num_pages=5, max_model_len=20, policy=policy, enable_prefix_caching=False))
    sim = Sim(sched)
    a = sim.add("a", [1, 2, 3, 4, 5, 6], max_tokens=20, priority=5)
    sim.step()
    b = sim.add("b", [7, 8, 9, 10, 11, 12], max_tokens=20, priority=0)
    for _ in range(3):
        out = sim.step()
        assert not out.preempted
    assert sched.running == [a, b] and sched.allocator.num_free_pages == 0
    return sim, a, b


def test_fcfs_victim_is_the_last_running_even_if_it_is_the_seq_itself():
    sim, a, b = _two_seqs_race_for_the_last_page("fcfs")
    out = sim.step()
    assert out.preempted == [b]
    assert [s.seq for s in out.scheduled] == [a]
    assert out.num_batched_tokens == 1


def test_priority_victim_is_the_worst_priority_even_if_already_scheduled():
    sim, a, b = _two_seqs_race_for_the_last_page("priority")
    out = sim.step()
    assert out.preempted == [a]
    assert [s.seq for s in out.scheduled] == [b]  # a's slot was taken back
    assert out.num_batched_tokens == 1  # and its token given back to the budget
    assert a.num_preemptions == 1 and a.page_ids == [] and a.num_computed_tokens == 0
    sim.run()
    sim.assert_drained()


def test_priority_preempted_seq_is_requeued_by_priority():
    sim, a, b = _two_seqs_race_for_the_last_page("priority")
    sched = sim.sched
    better = Sequence("better", [1], priority=1)
    worse = Sequence("worse", [1], priority=9)
    sched.add(better)
    sched.add(worse)
    sim.targets.update(better=1, worse=1)
    sim.seqs += [better, worse]
    out = sim.step()
    assert out.preempted == [a]
    assert list(sched.waiting) == [better, a, worse]


def test_no_admission_in_a_step_that_preempted():
    sched = Scheduler(config(num_pages=6, max_model_len=24, enable_prefix_caching=False))
    sim = Sim(sched)
    for rid, base in (("a", 0), ("b", 10), ("c", 20)):
        sim.add(rid, list(range(base, base + 7)), max_tokens=8)
    sim.step()
    sim.step()
    sim.add("d", [99], max_tokens=1)
    out = sim.step()
    assert out.preempted and all(s.seq.request_id != "d" for s in out.scheduled)


def test_waiting_seqs_do_not_preempt_running_ones():
    sched = Scheduler(config(num_pages=4, max_model_len=16, enable_prefix_caching=False))
    sim = Sim(sched)
    a = sim.add("a", list(range(12)), max_tokens=2)  # 3 pages, grows to 4
    sim.step()
    b = sim.add("b", list(range(50, 60)), max_tokens=1)  # needs 3 pages: must wait
    out = sim.step()
    assert [s.seq for s in out.scheduled] == [a] and not out.preempted
    assert b.status is SequenceStatus.WAITING
    sim.run()
    sim.assert_drained()


# ----------------------------------------------------------------- prefix cache


def test_prefix_hit_accounting_through_the_scheduler():
    sched = Scheduler(config(page_size=4, num_pages=16))
    sim = Sim(sched)
    shared = list(range(10))  # 2 full pages + half a page
    sim.add("a", shared + [50], max_tokens=1)
    sim.run()
    b = sim.add("b", shared + [60, 61], max_tokens=1)
    out = sim.step()
    (s,) = out.scheduled
    assert (s.seq, s.start, s.num_new_tokens) == (b, 8, 12 - 8)
    assert b.num_cached_tokens == 8
    sim.run()
    # A prompt made only of cached full pages still computes its last page's tokens.
    c = sim.add("c", list(range(8)), max_tokens=1)
    out = sim.step()
    assert (out.scheduled[0].start, out.scheduled[0].num_new_tokens) == (4, 4)
    sim.run()
    sim.assert_drained()
    assert sched.allocator.prefix_hits == 8 + 4
    assert sched.allocator.prefix_queries == 11 + 12 + 8


def test_prefix_hits_disappear_after_eviction_under_pressure():
    sched = Scheduler(config(page_size=4, num_pages=6, max_model_len=24))
    sim = Sim(sched)
    sim.add("a", list(range(9)), max_tokens=1)
    sim.run()
    assert sched.allocator.num_evictable_pages == 2
    sim.add("big", list(range(100, 123)), max_tokens=1)  # 24 tokens: every page
    sim.run()
    b = sim.add("b", list(range(9)), max_tokens=1)
    out = sim.step()
    assert out.scheduled[0].seq is b and out.scheduled[0].start == 0
    sim.run()
    sim.assert_drained()


def test_abort_and_finish():
    sched = Scheduler(config(max_num_seqs=1))
    a = Sequence("a", [1, 2, 3])
    b = Sequence("b", [4, 5])
    sched.add(a)
    sched.add(b)
    sched.cache_pages(sched.schedule())
    assert a.page_ids and not b.page_ids
    assert sched.abort("nope") is None
    assert sched.abort("b") is b
    assert b.status is SequenceStatus.FINISHED and b.finish_reason == "abort"
    assert sched.abort("b") is None  # already gone
    assert sched.abort("a") is a
    assert a.page_ids == [] and a.finish_reason == "abort"
    assert not sched.has_unfinished and sched.allocator.num_used_pages == 0
    c = Sequence("c", [1])
    sched.add(c)
    sched.schedule()
    sched.finish(c, "stop")
    assert c.is_finished and c.finish_reason == "stop" and sched.num_running == 0
    assert sched.allocator.num_used_pages == 0


def test_add_refuses_what_the_engine_must_have_checked():
    """The engine validates requests (Engine.add_request); the scheduler only guards its
    own invariants: a new id, 1..max_model_len tokens."""
    sched = Scheduler(config(max_model_len=8))
    with pytest.raises(AssertionError):
        sched.add(Sequence("long", list(range(9))))
    with pytest.raises(AssertionError):
        sched.add(Sequence("empty", []))
    sched.add(Sequence("x", [1]))
    with pytest.raises(AssertionError):
        sched.add(Sequence("x", [2]))


@pytest.mark.parametrize(
    "kw",
    [dict(policy="lifo"), dict(num_pages=3, page_size=4, max_model_len=13), dict(max_num_batched_tokens=0)],
)
def test_config_validates(kw):
    with pytest.raises(ValueError):
        config(**kw)


def test_empty_schedule():
    sched = Scheduler(config())
    out = sched.schedule()
    assert out.is_empty and out.num_batched_tokens == 0 and out.preempted == []


# ------------------------------------------------------------ data parallelism


def test_data_shards_split_budget_and_seats():
    """Two data shards: each has half the seats and half the token budget, so a lone long
    prompt gets 8 tokens a step, and new requests fill the emptier shard."""
    sched = Scheduler(config(max_num_seqs=4, max_num_batched_tokens=16, data_shards=2))
    sim = Sim(sched)
    long = sim.add("long", list(range(1, 31)), max_tokens=2)
    out = sim.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(long, 8)]
    others = [sim.add(f"r{i}", [i + 1] * 3, max_tokens=2) for i in range(4)]
    out = sim.step()
    # Shard 0 holds `long` (8 more tokens); shard 1 takes two 3-token prompts (6 of its
    # 8 tokens, both its seats); shard 0's second seat has no budget left.
    assert [s.seq.data_shard for s in out.scheduled] == [0, 1, 1]
    assert [s.seq for s in out.scheduled] == [long, others[0], others[1]]
    sim.run()
    sim.assert_drained()


def test_data_shard_placement_follows_cached_prefix():
    """A prompt whose prefix is cached in one shard goes there, though the other shard
    has more free pages; a prompt with no cached prefix goes to the freer shard."""
    sched = Scheduler(config(max_num_seqs=4, data_shards=2, num_pages=32))
    sim = Sim(sched)
    shared = [5, 6, 7, 1, 2, 3, 4, 5, 6]  # two full pages of 4, then one token
    first = sim.add("first", shared, max_tokens=10)
    sim.step()
    sim.step()
    assert first.data_shard == 0 and sched.allocators[0].num_free_pages < 32
    second = sim.add("second", shared[:8] + [9], max_tokens=1)
    other = sim.add("other", [3, 3, 3, 3, 3], max_tokens=1)
    sim.step()
    assert (second.data_shard, second.num_cached_tokens) == (0, 8)
    assert other.data_shard == 1
    sim.run()
    sim.assert_drained()


def test_preemption_stays_in_the_data_shard():
    """Pages run out in shard 0 (two growing sequences in 8 pages): its latest sequence is
    preempted; shard 1's lone sequence, with room to spare, is untouched."""
    sched = Scheduler(config(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32,
                             num_pages=8, data_shards=2))
    sim = Sim(sched)
    r0, r1, r2 = (sim.add(f"r{i}", [i + 1] * 12, max_tokens=20) for i in range(3))
    sim.step()
    assert (r0.data_shard, r1.data_shard, r2.data_shard) == (0, 1, 0)
    preempted = []
    while not preempted:
        preempted = sim.step().preempted
    assert preempted == [r2]
    sim.run()
    assert r1.num_preemptions == 0 and r0.num_preemptions == 0
    sim.assert_drained()


def test_rollback_after_a_tree_moves_the_accepted_nodes_into_their_positions():
    """A tree of 6 nodes after 7 tokens sat at positions 7..12 (node j at 7 + j); nodes 1
    and 3 accepted (then a bonus token) belong at positions 7 and 8."""
    sched = Scheduler(config(max_num_batched_tokens=16))
    seq = Sequence("a", [1, 2, 3, 4, 5, 6])
    sched.add(seq)
    sched.schedule()
    seq.output_token_ids.append(7)
    assert sched.allocator.allocate_more(seq, 7 + 6)
    pages = list(seq.page_ids)
    assert len(pages) == 4
    seq.output_token_ids += [8, 9, 10]  # nodes 1 and 3, and the bonus token
    slot = lambda p: pages[p // 4] * 4 + p % 4  # noqa: E731
    assert sched.rollback(seq, [1, 3]) == [(slot(8), slot(7)), (slot(10), slot(8))]
    assert seq.num_computed_tokens == 9 and seq.page_ids == pages[:3]
    assert sched.allocator.num_used_pages == 3
    # The top guesses' path sits in place already; a chain moves nothing.
    seq.output_token_ids.append(11)
    assert sched.rollback(seq, [0]) == [] and seq.num_computed_tokens == 10
    assert sched.rollback(seq) == []


def test_prefilled_seq_is_admitted_with_its_prompt_computed():
    """A seq whose prompt's K/V came from a prefill engine (Sequence.prefilled) gets pages
    for its prompt and first token and computes only that token; one whose prompt's first
    pages this pool caches keeps them (a hit), the rest arrive."""
    class Moved:  # what the scheduler reads of engine/kv_transfer.py's KVPages
        num_tokens = 10

    sched = Scheduler(config(page_size=4))
    plain = Sequence("plain", list(range(1, 11)), max_output_tokens=4)
    sched.add(plain)
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(0, 10)]
    plain.output_token_ids.append(5)
    sched.cache_pages(out)
    moved = Sequence("moved", list(range(1, 11)), output_token_ids=[5], max_output_tokens=4)
    moved.prefilled = Moved()
    sched.add(moved)
    out = sched.schedule()
    by_id = {s.seq.request_id: s for s in out.scheduled}
    assert (by_id["moved"].start, by_id["moved"].num_new_tokens) == (10, 1)
    assert len(moved.page_ids) == 3 and moved.num_computed_tokens == 11
    assert moved.num_cached_tokens == 8  # the first 2 pages: plain's, from the prefix cache
    assert moved.page_ids[:2] == plain.page_ids[:2] and by_id["moved"].samples
