"""Host-side KV page allocator with prefix caching.

The device holds a fixed pool of KV pages `[num_pages, page_size, ...]` per layer; this
module only decides which page ids each `Sequence` owns. It is plain Python (no JAX) so
the scheduler can be tested on its own.

Every page is in exactly one of three states:

* free:      refcount 0, no content hash; handed out first.
* evictable: refcount 0, but its content is registered in the prefix cache, so a later
             prompt with the same prefix can reuse it. Kept in LRU order and recycled
             (losing its hash) only when no free page is left.
* used:      refcount > 0, owned by one or more sequences (shared prefix pages).

A page's content hash chains the hashes of all pages before it, so one hash identifies the
whole prefix up to the end of that page: two pages with the same hash hold the same K/V.
Only pages full of computed tokens are ever registered.

With a host tier (`host`: host_kv_cache.HostKVCache, or anything with `in` and `add`,
such as a set), a cached page recycled for new content is added to the host and listed
in `offloads` for the engine to copy out first, and a prompt's prefix may go on past the
device's cached pages into pages the host holds (or is about to: recycled earlier in the
same schedule): those get new pages, registered at once and listed in `loads` for the
engine to copy in before the step that reads them. The engine takes both lists after
every `schedule` (copies out first: a page may be both).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib

from jaxserve.engine.request import Sequence

PageHash = bytes
HOST = None  # in a found prefix: a page the host tier holds

# The parent of a sequence's first page is its `cache_root` (b"" without an adapter or a
# cache salt).


def hash_page(parent: PageHash, tokens: list[int], extra: bytes = b"") -> PageHash:
    """Content hash of one full page given the hash of the page before it (`extra`: what
    else its K/V depend on: the images among its tokens, Sequence.image_key).

    A cryptographic digest rather than Python's `hash()`: tuple hashes of ints are cheap to
    collide on purpose, and a collision here would let one request read another's K/V.
    """
    data = array.array("q", tokens).tobytes()
    return hashlib.blake2b(parent + data + extra, digest_size=16).digest()


def salted_root(root: bytes, salt: str) -> bytes:
    """The cache root of a request with a cache salt (vLLM's `cache_salt`): its pages'
    hashes chain from it, so only requests of the same salt (and adapter) share them."""
    return hashlib.blake2b(root + b"salt\0" + salt.encode(), digest_size=16).digest()


@dataclasses.dataclass
class _SeqState:
    """Per-sequence prefix-cache bookkeeping, so that `commit` is O(new pages)."""

    # Hashes of the first len(hashes) full pages of the sequence's tokens. Tokens of a
    # full page never change (outputs are only appended), so they are computed once.
    hashes: list[PageHash] = dataclasses.field(default_factory=list)
    # Pages [0, num_committed) have been offered to the prefix cache (registered, or
    # skipped because an identical page was already cached).
    num_committed: int = 0


class PageAllocator:
    """Hands out KV page ids, ref-counts shared prefix pages, evicts LRU cached pages."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 host=None):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"need num_pages > 0 and page_size > 0, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching

        self._refcount: list[int] = [0] * num_pages
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        # Cached pages with refcount 0; first = least recently used = evicted first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._hash_to_page: dict[PageHash, int] = {}
        self._page_to_hash: dict[int, PageHash] = {}
        # Keyed by the Sequence object itself (identity-hashed), which also keeps the key
        # alive: no confusion between two requests that reuse an id.
        self._seqs: dict[Sequence, _SeqState] = {}
        # The host tier, and the copies out and in it waits for (module doc).
        self.host = host if enable_prefix_caching else None
        self.offloads: list[tuple[int, PageHash]] = []
        self.loads: list[tuple[int, PageHash]] = []

        # Stats for the server, counted once per successful `allocate_prompt`.
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache
        self.host_hits = 0  # of those, found in the host tier

    # ----------------------------------------------------------------- counters

    @property
    def num_free_pages(self) -> int:
        """Pages obtainable now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages owned by at least one sequence."""
        return self.num_pages - self.num_free_pages

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache (used or evictable)."""
        return len(self._hash_to_page)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def refcount(self, page_id: int) -> int:
        return self._refcount[page_id]

    def pages_for(self, num_tokens: int) -> int:
        """Number of pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    # --------------------------------------------------------------- allocation

    def lookup_prefix(self, seq: Sequence) -> int:
        """Number of leading tokens of `seq` that `allocate_prompt` would find cached.

        Side-effect free for the cache (no refs, no LRU touch, no stats), so the scheduler
        can size the prompt chunk before allocating. At least one token is always left to
        compute, because the step must produce logits for the last token. Pages the host
        tier holds count.
        """
        return len(self._find_cached_pages(seq)) * self.page_size

    def allocate_prompt(self, seq: Sequence, num_tokens: int) -> bool:
        """Admit a waiting sequence: reuse cached prefix pages, then cover `num_tokens` more.

        Sets `seq.num_computed_tokens = seq.num_cached_tokens = hit tokens` and makes
        `seq.page_ids` cover `hit + num_tokens` tokens (hit pages the host tier holds get
        new pages, listed in `loads`). Returns False, with `seq` and the allocator
        untouched, if that many pages cannot be had.
        """
        assert not seq.page_ids and seq.num_computed_tokens == 0, "sequence already has pages"
        found = self._find_cached_pages(seq)
        hit_pages = [p for p in found if p is not HOST]
        num_hit_tokens = len(found) * self.page_size
        num_new_pages = self.pages_for(num_hit_tokens + num_tokens) - len(hit_pages)
        # Hit pages that sit in the evictable set stop being obtainable once we take them.
        num_hit_evictable = sum(1 for p in hit_pages if self._refcount[p] == 0)
        if num_new_pages > self.num_free_pages - num_hit_evictable:
            return False

        for page in hit_pages:  # take refs first, so the new pages cannot evict them
            self._ref(page)
        num_host = len(found) - len(hit_pages)
        if num_host:
            hashes = self._page_hashes(seq, len(found))
            for j, page in enumerate(found):
                if page is HOST:
                    found[j] = page = self._take_page()
                    self._hash_to_page[hashes[j]], self._page_to_hash[page] = page, hashes[j]
                    self.loads.append((page, hashes[j]))
        seq.page_ids = found + [self._take_page() for _ in range(num_new_pages - num_host)]
        seq.num_computed_tokens = seq.num_cached_tokens = num_hit_tokens
        if self.enable_prefix_caching:
            self._state(seq).num_committed = len(found)
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_hit_tokens
            self.host_hits += num_host * self.page_size
        return True

    def allocate_more(self, seq: Sequence, total_tokens: int) -> bool:
        """Grow `seq.page_ids` to cover `total_tokens`; False (nothing taken) if short."""
        num_new_pages = self.pages_for(total_tokens) - len(seq.page_ids)
        if num_new_pages <= 0:
            return True
        if num_new_pages > self.num_free_pages:
            return False
        seq.page_ids.extend(self._take_page() for _ in range(num_new_pages))
        return True

    def truncate(self, seq: Sequence, total_tokens: int) -> None:
        """Give back `seq`'s pages past the first `total_tokens` tokens (after speculative
        decoding's rejected drafts: pages never full of computed tokens, so uncached)."""
        keep = self.pages_for(total_tokens)
        for page in reversed(seq.page_ids[keep:]):
            assert page not in self._page_to_hash, "truncating a cached page"
            self._unref(page)
        seq.page_ids = seq.page_ids[:keep]  # a new list: see Sequence.page_ids

    def commit(self, seq: Sequence) -> None:
        """Register in the prefix cache every page of `seq` newly full of computed tokens.

        Called after each step. A page whose content is already cached under another id is
        left unregistered: it is returned to the free list when `seq` frees it.
        """
        if not self.enable_prefix_caching:
            return
        state = self._state(seq)
        if seq.num_computed_tokens // self.page_size <= state.num_committed:
            return  # no page newly full (most steps: a page fills every page_size tokens)
        computed = min(seq.num_computed_tokens, seq.num_known_tokens)  # no PLACEHOLDER hashed
        num_full = min(computed // self.page_size, len(seq.page_ids))
        if num_full <= state.num_committed:
            return
        hashes = self._page_hashes(seq, num_full)
        for j in range(state.num_committed, num_full):
            page = seq.page_ids[j]
            if hashes[j] not in self._hash_to_page and page not in self._page_to_hash:
                self._hash_to_page[hashes[j]] = page
                self._page_to_hash[page] = hashes[j]
        state.num_committed = num_full

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s refs and clear `seq.page_ids` (the seq's counters are left alone).

        Pages are released tail first, so that under LRU the end of a prefix is evicted
        before its beginning (the beginning is the part other prompts are likeliest to
        share, and a tail page is useless once a page before it is gone).
        """
        for page in reversed(seq.page_ids):
            self._unref(page)
        seq.page_ids = []
        self._seqs.pop(seq, None)

    def forget(self, seq: Sequence) -> None:
        """Drop the prefix-cache bookkeeping of a sequence that holds no pages here (one
        looked up in this pool but placed in another)."""
        self._seqs.pop(seq, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached page that no sequence holds (e.g. after a weight update)."""
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._unregister(page)
            self._free.append(page)

    # ----------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Assert the three page states partition the pool and the maps agree (for tests)."""
        free, evictable = set(self._free), set(self._evictable)
        used = {p for p in range(self.num_pages) if self._refcount[p] > 0}
        assert len(free) == len(self._free), "page twice in the free list"
        assert all(r >= 0 for r in self._refcount), "negative refcount"
        assert not (free & evictable) and not (free & used) and not (evictable & used)
        assert free | evictable | used == set(range(self.num_pages)), "leaked page"
        assert all(p not in self._page_to_hash for p in free), "free page with a hash"
        assert all(p in self._page_to_hash for p in evictable), "evictable page without hash"
        assert {p: h for h, p in self._hash_to_page.items()} == self._page_to_hash

    # ---------------------------------------------------------------- internals

    def _state(self, seq: Sequence) -> _SeqState:
        state = self._seqs.get(seq)
        if state is None:
            state = self._seqs[seq] = _SeqState()
        return state

    def _page_hashes(self, seq: Sequence, num_pages: int) -> list[PageHash]:
        """Hashes of the first `num_pages` full pages of `seq`, computed once and kept."""
        hashes = self._state(seq).hashes
        ps = self.page_size
        while len(hashes) < num_pages:
            j = len(hashes)
            parent = hashes[-1] if hashes else seq.cache_root
            extra = seq.image_key(j * ps, (j + 1) * ps) if seq.images else b""
            hashes.append(hash_page(parent, seq.tokens(j * ps, (j + 1) * ps), extra))
        return hashes

    def _find_cached_pages(self, seq: Sequence) -> list[int | None]:
        """Page ids of the longest cached run of full pages at the start of `seq`, HOST
        for one the host tier holds (none for a seq that scores its prompt or pools all
        of it: every prompt token is computed)."""
        if not self.enable_prefix_caching or seq.scores_prompt or seq.whole_prompt:
            return []
        max_pages = (seq.num_tokens - 1) // self.page_size
        pages: list[int | None] = []
        # Hash lazily: a miss on page j makes hashing pages after j pointless.
        for j in range(max_pages):
            page_hash = self._page_hashes(seq, j + 1)[j]
            page = self._hash_to_page.get(page_hash)
            if page is None and (self.host is None or page_hash not in self.host):
                break
            pages.append(page)
        return pages

    def _take_page(self) -> int:
        """A page for new content, refcount 1: a free one, else evict the LRU cached one."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            page_hash = self._unregister(page)
            if self.host is not None and page_hash not in self.host:
                self.host.add(page_hash)
                self.offloads.append((page, page_hash))
        self._refcount[page] = 1
        return page

    def _ref(self, page: int) -> None:
        if self._refcount[page] == 0:
            del self._evictable[page]
        self._refcount[page] += 1

    def _unref(self, page: int) -> None:
        assert self._refcount[page] > 0, f"page {page} freed more often than taken"
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            if page in self._page_to_hash:
                self._evictable[page] = None  # newest = last evicted
            else:
                self._free.append(page)

    def _unregister(self, page: int) -> PageHash:
        page_hash = self._page_to_hash.pop(page)
        del self._hash_to_page[page_hash]
        return page_hash
