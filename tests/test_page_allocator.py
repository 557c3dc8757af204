"""PageAllocator: page accounting, prefix-cache hits, LRU eviction. No JAX."""

from __future__ import annotations

import random

import pytest

from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.request import Sequence

PS = 4  # page size used throughout


def make_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(tokens))


def compute_all(alloc: PageAllocator, seq: Sequence) -> None:
    """Pretend a step computed every token of `seq` (pages must already cover them)."""
    assert len(seq.page_ids) * alloc.page_size >= seq.num_tokens
    seq.num_computed_tokens = seq.num_tokens
    alloc.commit(seq)


def admit_and_compute(alloc: PageAllocator, seq: Sequence) -> None:
    assert alloc.allocate_prompt(seq, seq.num_tokens - alloc.lookup_prefix(seq))
    compute_all(alloc, seq)


# --------------------------------------------------------------------- accounting


def test_allocate_prompt_and_free_without_caching():
    alloc = PageAllocator(num_pages=8, page_size=PS, enable_prefix_caching=False)
    seq = make_seq("a", list(range(10)))
    assert alloc.allocate_prompt(seq, 10)
    assert len(seq.page_ids) == 3  # ceil(10 / 4)
    assert len(set(seq.page_ids)) == 3
    assert seq.num_computed_tokens == 0 and seq.num_cached_tokens == 0
    assert alloc.num_used_pages == 3 and alloc.num_free_pages == 5
    assert all(alloc.refcount(p) == 1 for p in seq.page_ids)
    alloc.free(seq)
    assert seq.page_ids == []
    assert alloc.num_used_pages == 0 and alloc.num_free_pages == 8
    alloc.check_invariants()


def test_allocate_prompt_covers_only_the_chunk():
    alloc = PageAllocator(num_pages=8, page_size=PS)
    seq = make_seq("a", list(range(20)))
    assert alloc.allocate_prompt(seq, 5)  # first chunk of a chunked prefill
    assert len(seq.page_ids) == 2
    assert alloc.allocate_more(seq, 5)  # already covered: no new page
    assert len(seq.page_ids) == 2
    assert alloc.allocate_more(seq, 9)
    assert len(seq.page_ids) == 3
    assert alloc.num_used_pages == 3


def test_allocate_more_fails_without_taking_anything():
    alloc = PageAllocator(num_pages=4, page_size=PS)
    seq = make_seq("a", list(range(8)))
    assert alloc.allocate_prompt(seq, 8)
    before = list(seq.page_ids)
    assert not alloc.allocate_more(seq, 8 + 3 * PS)  # needs 3 more, only 2 free
    assert seq.page_ids == before
    assert alloc.num_free_pages == 2
    assert alloc.allocate_more(seq, 8 + 2 * PS)  # exactly the 2 free ones
    assert alloc.num_free_pages == 0
    assert not alloc.allocate_more(seq, 8 + 2 * PS + 1)
    alloc.check_invariants()


def test_allocate_prompt_failure_leaves_everything_untouched():
    alloc = PageAllocator(num_pages=4, page_size=PS)
    a = make_seq("a", list(range(8)))
    admit_and_compute(alloc, a)  # pages 0,1 cached and held
    b = make_seq("b", list(range(8)) + list(range(100, 120)))  # hits 2 pages, needs 5 more
    refs = [alloc.refcount(p) for p in range(4)]
    queries, hits = alloc.prefix_queries, alloc.prefix_hits
    assert alloc.lookup_prefix(b) == 8
    assert not alloc.allocate_prompt(b, b.num_tokens - 8)
    assert b.page_ids == [] and b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert [alloc.refcount(p) for p in range(4)] == refs
    assert (alloc.prefix_queries, alloc.prefix_hits) == (queries, hits)
    assert alloc.num_free_pages == 2
    # A chunk that fits does work, hitting the cached prefix.
    assert alloc.allocate_prompt(b, 8)
    assert b.num_computed_tokens == 8 and b.page_ids[:2] == a.page_ids
    alloc.check_invariants()


def test_hit_on_evictable_pages_counts_them_as_no_longer_obtainable():
    """With 2 evictable hit pages and 2 free pages, a prompt needing 3 new pages must fail:
    naive accounting (4 obtainable >= 3) would evict one of its own hit pages."""
    alloc = PageAllocator(num_pages=4, page_size=PS)
    a = make_seq("a", list(range(8)))
    admit_and_compute(alloc, a)
    alloc.free(a)
    assert alloc.num_evictable_pages == 2 and alloc.num_free_pages == 4
    b = make_seq("b", list(range(8)) + list(range(50, 60)))  # 18 tokens = 5 pages
    assert alloc.lookup_prefix(b) == 8
    assert not alloc.allocate_prompt(b, 10)
    assert alloc.num_evictable_pages == 2 and alloc.num_cached_pages == 2
    assert alloc.allocate_prompt(b, 8)  # 2 hit + 2 new: fits
    assert alloc.num_free_pages == 0
    alloc.check_invariants()


# --------------------------------------------------------------------- prefix hits


def test_shared_two_full_pages_and_a_partial_one_hits_exactly_two_pages():
    alloc = PageAllocator(num_pages=16, page_size=PS)
    shared = list(range(10))  # 2 full pages + 2 tokens of the third
    a = make_seq("a", shared + [70, 71, 72])
    admit_and_compute(alloc, a)
    b = make_seq("b", shared + [80, 81, 82, 83, 84])
    assert alloc.lookup_prefix(b) == 8
    assert alloc.allocate_prompt(b, b.num_tokens - 8)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.page_ids[:2] == a.page_ids[:2]
    assert b.page_ids[2] != a.page_ids[2]  # the partial page is never shared
    assert len(b.page_ids) == 4  # covers 15 tokens
    assert [alloc.refcount(p) for p in a.page_ids[:2]] == [2, 2]
    assert alloc.refcount(a.page_ids[2]) == 1
    assert alloc.prefix_hits == 8 and alloc.prefix_queries == a.num_tokens + b.num_tokens
    alloc.check_invariants()


@pytest.mark.parametrize("length, expected_hit", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_whole_prompt_hit_leaves_at_least_one_token(length, expected_hit):
    alloc = PageAllocator(num_pages=16, page_size=PS)
    admit_and_compute(alloc, make_seq("a", list(range(length))))
    b = make_seq("b", list(range(length)))
    assert alloc.allocate_prompt(b, 1 if expected_hit < length else 0)
    assert b.num_computed_tokens == expected_hit
    assert b.num_tokens - b.num_computed_tokens >= 1


def test_hash_chains_the_prefix_not_just_the_page():
    alloc = PageAllocator(num_pages=16, page_size=PS)
    admit_and_compute(alloc, make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second page, different first page: no hit at all.
    assert alloc.lookup_prefix(make_seq("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == 0
    # Same first page, different second page: one page.
    assert alloc.lookup_prefix(make_seq("c", [1, 2, 3, 4, 5, 6, 7, 0, 9])) == 4
    assert alloc.lookup_prefix(make_seq("d", [1, 2, 3, 4, 5, 6, 7, 8, 0])) == 8
    # A cached page's content at another position (here: first) is no hit either.
    assert alloc.lookup_prefix(make_seq("e", [5, 6, 7, 8, 0])) == 0


def test_output_tokens_are_cached_too():
    alloc = PageAllocator(num_pages=16, page_size=PS)
    a = make_seq("a", [1, 2, 3, 4, 5, 6])
    admit_and_compute(alloc, a)
    assert alloc.num_cached_pages == 1
    a.output_token_ids += [7, 8, 9]  # decode: computed one by one
    for _ in range(3):
        assert alloc.allocate_more(a, a.num_computed_tokens + 1)
        a.num_computed_tokens += 1
        alloc.commit(a)
    assert alloc.num_cached_pages == 2
    b = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert alloc.lookup_prefix(b) == 8


def test_commit_registers_only_pages_full_of_computed_tokens():
    alloc = PageAllocator(num_pages=16, page_size=PS)
    a = make_seq("a", list(range(12)))
    assert alloc.allocate_prompt(a, 12)  # all 3 pages allocated, nothing computed
    alloc.commit(a)
    assert alloc.num_cached_pages == 0
    a.num_computed_tokens = 7  # page 0 full, page 1 not yet
    alloc.commit(a)
    assert alloc.num_cached_pages == 1
    assert alloc.lookup_prefix(make_seq("b", list(range(12)))) == 4
    a.num_computed_tokens = 12
    alloc.commit(a)
    assert alloc.num_cached_pages == 3
    assert alloc.lookup_prefix(make_seq("c", list(range(13)))) == 12


def test_duplicate_page_is_left_unregistered_and_freed_normally():
    alloc = PageAllocator(num_pages=8, page_size=PS)
    a, b = make_seq("a", list(range(9))), make_seq("b", list(range(9)))
    # Both admitted before either computed: no hit, two copies of the same pages.
    assert alloc.allocate_prompt(a, 9) and alloc.allocate_prompt(b, 9)
    assert set(a.page_ids).isdisjoint(b.page_ids)
    compute_all(alloc, a)
    compute_all(alloc, b)
    assert alloc.num_cached_pages == 2  # a's two full pages only
    a_pages = list(a.page_ids)
    alloc.free(b)
    assert alloc.num_evictable_pages == 0  # b's copies went back to the free list
    alloc.free(a)
    assert alloc.num_evictable_pages == 2
    c = make_seq("c", list(range(9)))
    assert alloc.lookup_prefix(c) == 8
    assert alloc.allocate_prompt(c, 1)
    assert c.page_ids[:2] == a_pages[:2]
    alloc.check_invariants()


def test_hits_survive_the_owner_finishing_then_lru_eviction_removes_them():
    alloc = PageAllocator(num_pages=6, page_size=PS)
    a = make_seq("a", list(range(9)))
    admit_and_compute(alloc, a)
    a_pages = list(a.page_ids)
    alloc.free(a)
    assert alloc.num_used_pages == 0 and alloc.num_free_pages == 6
    assert alloc.num_evictable_pages == 2

    # Still a hit after the owner is gone; the hit takes the pages out of the evictable set.
    b = make_seq("b", list(range(9)) + [99])
    assert alloc.allocate_prompt(b, 2)
    assert b.num_cached_tokens == 8 and b.page_ids[:2] == a_pages[:2]
    assert alloc.num_evictable_pages == 0 and alloc.num_used_pages == 3
    alloc.free(b)
    assert alloc.num_evictable_pages == 2

    # Pressure: plain free pages go first (the cache survives) ...
    fill = make_seq("fill", [500 + i for i in range(16)])
    assert alloc.allocate_prompt(fill, 16)  # takes the 4 free pages
    assert alloc.num_evictable_pages == 2
    assert alloc.lookup_prefix(make_seq("probe", list(range(9)))) == 8
    # ... then the least recently used cached page: the tail of the prefix first.
    assert alloc.allocate_more(fill, 20)
    assert alloc.num_evictable_pages == 1
    assert a_pages[1] in fill.page_ids
    assert alloc.lookup_prefix(make_seq("probe", list(range(9)))) == 4
    assert alloc.allocate_more(fill, 24)
    assert alloc.lookup_prefix(make_seq("probe", list(range(9)))) == 0
    assert alloc.num_cached_pages == 0
    alloc.free(fill)
    alloc.check_invariants()


def test_lru_order_follows_last_release_and_hits_refresh_recency():
    alloc = PageAllocator(num_pages=4, page_size=PS)
    a, c = make_seq("a", list(range(8))), make_seq("c", list(range(100, 108)))
    admit_and_compute(alloc, a)
    admit_and_compute(alloc, c)
    alloc.free(a)  # a's pages are now older than c's
    alloc.free(c)
    x = make_seq("x", list(range(200, 208)))
    assert alloc.allocate_prompt(x, 8)  # 2 pages: both of a's go, c's survive
    assert alloc.lookup_prefix(make_seq("pa", list(range(8)) + [1])) == 0
    assert alloc.lookup_prefix(make_seq("pc", list(range(100, 108)) + [1])) == 8
    alloc.free(x)  # never committed: plain free pages, taken before any cached one
    assert alloc.num_evictable_pages == 2

    # Re-using c's prefix makes it the most recently used: x's pages go first, then c's.
    admit_and_compute(alloc, x)
    alloc.free(x)  # evictable, oldest first: c, x
    pc = make_seq("pc", list(range(100, 108)) + [1])
    assert alloc.allocate_prompt(pc, 1)  # hit 2 pages + 1 new: evicts x's tail page
    assert alloc.num_cached_pages == 3
    assert alloc.lookup_prefix(make_seq("px", list(range(200, 208)) + [1])) == 4
    alloc.free(pc)  # evictable now: x's head, then c's (refreshed)
    y = make_seq("y", list(range(300, 308)))
    assert alloc.allocate_prompt(y, 8)  # pc's uncommitted page, then x's head page
    assert alloc.lookup_prefix(make_seq("px", list(range(200, 208)) + [1])) == 0
    assert alloc.lookup_prefix(make_seq("pc2", list(range(100, 108)) + [1])) == 8
    alloc.check_invariants()


def test_reset_prefix_cache_drops_only_unreferenced_pages():
    alloc = PageAllocator(num_pages=8, page_size=PS)
    a, b = make_seq("a", list(range(9))), make_seq("b", list(range(100, 109)))
    admit_and_compute(alloc, a)
    admit_and_compute(alloc, b)
    alloc.free(a)
    alloc.reset_prefix_cache()
    assert alloc.num_evictable_pages == 0 and alloc.num_free_pages == 5
    assert alloc.lookup_prefix(make_seq("pa", list(range(9)))) == 0
    assert alloc.lookup_prefix(make_seq("pb", list(range(100, 109)))) == 8  # b still holds it
    alloc.free(b)
    assert alloc.num_evictable_pages == 2
    alloc.check_invariants()


def test_disabled_prefix_caching_never_hits_or_caches():
    alloc = PageAllocator(num_pages=8, page_size=PS, enable_prefix_caching=False)
    a = make_seq("a", list(range(9)))
    admit_and_compute(alloc, a)
    assert alloc.num_cached_pages == 0
    alloc.free(a)
    assert alloc.num_evictable_pages == 0
    b = make_seq("b", list(range(9)))
    assert alloc.lookup_prefix(b) == 0
    assert alloc.allocate_prompt(b, 9)
    assert b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert alloc.prefix_queries == 0 and alloc.prefix_hits == 0


def test_preempted_sequence_rehits_its_own_pages():
    """free() then allocate_prompt() again (preemption by recompute) finds its own prefix."""
    alloc = PageAllocator(num_pages=8, page_size=PS)
    a = make_seq("a", list(range(10)))
    admit_and_compute(alloc, a)
    a.output_token_ids += [42, 43]
    alloc.free(a)
    a.num_computed_tokens = 0
    assert alloc.allocate_prompt(a, a.num_tokens - alloc.lookup_prefix(a))
    assert a.num_computed_tokens == 8 and len(a.page_ids) == 3


# ------------------------------------------------------------------ random stress


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("caching", [True, False])
def test_random_operations_keep_refcounts_exact(seed, caching):
    rng = random.Random(seed)
    alloc = PageAllocator(num_pages=12, page_size=PS, enable_prefix_caching=caching)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    live: list[Sequence] = []
    total_hits = 0
    for step in range(400):
        op = rng.random()
        if op < 0.35 or not live:  # admit
            tokens = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 10))]
            if not tokens:
                tokens = [1]
            seq = make_seq(f"s{step}", tokens)
            hit = alloc.lookup_prefix(seq)
            assert hit % PS == 0 and hit < seq.num_tokens
            n = rng.randrange(1, seq.num_tokens - hit + 1)
            free_before = alloc.num_free_pages
            if alloc.allocate_prompt(seq, n):
                assert seq.num_computed_tokens == hit
                total_hits += hit
                live.append(seq)
            else:
                assert seq.page_ids == [] and alloc.num_free_pages == free_before
        elif op < 0.75:  # compute a chunk, maybe decode a token
            seq = rng.choice(live)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(rng.randrange(5))
            n = rng.randrange(1, seq.num_tokens - seq.num_computed_tokens + 1)
            if alloc.allocate_more(seq, seq.num_computed_tokens + n):
                seq.num_computed_tokens += n
                alloc.commit(seq)
        else:  # finish
            seq = live.pop(rng.randrange(len(live)))
            alloc.free(seq)
            assert seq.page_ids == []
        alloc.check_invariants()
        for page in range(alloc.num_pages):
            assert alloc.refcount(page) == sum(s.page_ids.count(page) for s in live)
        assert alloc.num_used_pages == len({p for s in live for p in s.page_ids})
    for seq in live:
        alloc.free(seq)
    alloc.check_invariants()
    assert alloc.num_used_pages == 0 and alloc.num_free_pages == alloc.num_pages
    assert alloc.prefix_hits == total_hits
    if caching:
        assert total_hits > 0  # the run did exercise the cache
    else:
        assert total_hits == 0 and alloc.num_evictable_pages == 0
