"""A second tier of the prefix cache in host memory (`kv_offloading_size`; vLLM's KV
offloading, SGLang's hierarchical cache).

When the device's prefix cache recycles a cached page for new content (page_allocator.py:
an evictable page taken because no free one is left), the engine first copies the page
out here, under its content hash. A later prompt whose prefix runs past the device's
cached pages into pages held here gets new device pages with that K/V copied back in,
instead of computing those tokens again: the prefix cache reaches as far as host memory
does (a preempted request's pages come back the same way).

The store is one preallocated array per cache entry (K, V, their scales when quantized):
`[layers, kv_heads, capacity, page_size(, head_dim)]`, as kv_transfer.PageMover reads
pages out (each KV head once), in slots handed out and recycled least recently used
first. A copy out is started as the page is evicted (a read of the cache dispatched
before the step that overwrites the page: the device runs in order) and lands in its
slot at a later step of the engine once it is done (`land`, which does not wait for
one under way); until then its hash is pending, and loading it, or recycling its slot,
waits for the copy. The engine moves pages between here and the device
(Engine._move_host_pages).
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
from typing import Any

import jax
import numpy as np

PageHash = bytes


@dataclasses.dataclass
class _Copy:
    """A copy out under way: arrays `[layers, kv_heads, pages, ...]` per cache entry, page
    `index[i]` going to `slots[i]` (under `hashes[i]`)."""

    entries: tuple[Any, ...]
    index: list[int]
    slots: list[int]
    hashes: list[PageHash]


class HostKVCache:
    """Pages of K/V by content hash in host memory, least recently used recycled first.

    `shapes[e]`, `dtypes[e]`: cache entry e's page as PageMover reads one, without the
    page axis: `(layers, kv_heads, page_size(, head_dim))`."""

    def __init__(self, capacity: int, shapes: list[tuple[int, ...]], dtypes: list[Any]):
        if capacity < 1:
            raise ValueError("the host KV cache needs room for at least one page")
        self.capacity = capacity
        self._pool = [_huge_page_array((s[0], s[1], capacity, *s[2:]), d)
                      for s, d in zip(shapes, dtypes)]
        self._slots: collections.OrderedDict[PageHash, int] = collections.OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._copies: list[_Copy] = []
        self._pending: set[PageHash] = set()
        # Hashes of pages recycled by the schedule being made, whose copy out the engine
        # starts after it (`add`): a prompt may find them already.
        self._incoming: set[PageHash] = set()
        self.pages_stored = 0  # pages copied out, since start
        self.pages_loaded = 0  # pages copied back to the device, since start

    @staticmethod
    def page_bytes(shapes: list[tuple[int, ...]], dtypes: list[Any]) -> int:
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes))

    @property
    def num_pages(self) -> int:
        """Pages held (pending copies included)."""
        return len(self._slots)

    @property
    def pending_bytes(self) -> int:
        """Bytes of the copies under way (on an accelerator, device memory they hold)."""
        return sum(x.nbytes for copy in self._copies for x in copy.entries)

    def __contains__(self, page_hash: PageHash) -> bool:
        return page_hash in self._slots or page_hash in self._incoming

    def add(self, page_hash: PageHash) -> None:
        """A page the schedule being made recycles: held from now on (its copy out is
        `store`d after the schedule; a prompt that finds it before gets it from that
        copy: Engine._move_host_pages)."""
        self._incoming.add(page_hash)

    def store(self, hashes: list[PageHash], entries: tuple[Any, ...]) -> None:
        """Keep the pages `entries[e][:, :, j]` under `hashes[j]` (device arrays whose copy
        to the host has started, or numpy arrays), least recently used first; a hash
        already held is only marked recently used. The least recently used pages give up
        their slots when none is free (a pending one first lands)."""
        self._incoming.difference_update(hashes)
        copy = _Copy(entries, [], [], [])
        first = max(0, len(hashes) - self.capacity)  # (the rest would give way at once)
        for j in range(first, len(hashes)):
            h = hashes[j]
            if h in self._slots:
                self._slots.move_to_end(h)
                continue
            if not self._free:
                self._recycle()
            self._slots[h] = slot = self._free.pop()
            self._pending.add(h)
            copy.index.append(j)
            copy.slots.append(slot)
            copy.hashes.append(h)
        if copy.slots:
            self._copies.append(copy)
            self.pages_stored += len(copy.slots)

    def land(self, wait: bool = True) -> None:
        """Put the started copies in their slots: every one (waiting for those still under
        way), or with `wait` False those whose arrays are ready."""
        under_way = []
        for copy in self._copies:
            if not wait and not all(_is_ready(x) for x in copy.entries):
                under_way.append(copy)
                continue
            n, first = len(copy.index), copy.index[0]
            pages = (slice(first, first + n) if copy.index == list(range(first, first + n))
                     else copy.index)
            for pool, x in zip(self._pool, copy.entries):
                pool[:, :, copy.slots] = jax.device_get(x)[:, :, pages]
            self._pending.difference_update(copy.hashes)
        self._copies = under_way

    def take(self, hashes: list[PageHash]) -> list[np.ndarray]:
        """The pages under `hashes` (each held), as `[layers, kv_heads, len(hashes), ...]`
        per cache entry, marked recently used."""
        if self._pending.intersection(hashes):
            self.land()
        slots = []
        for h in hashes:
            self._slots.move_to_end(h)
            slots.append(self._slots[h])
        self.pages_loaded += len(hashes)
        return [pool[:, :, slots] for pool in self._pool]

    def clear(self) -> None:
        """Forget every page (the weights changed, or the device's cache was lost)."""
        self._copies, self._pending, self._incoming = [], set(), set()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._slots.clear()

    def _recycle(self) -> None:
        h, slot = self._slots.popitem(last=False)
        if h in self._pending:  # its copy would land in a slot given to another
            self.land()
        self._free.append(slot)


def _is_ready(x) -> bool:
    return x.is_ready() if isinstance(x, jax.Array) else True


def _huge_page_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array of anonymous memory the OS commits page by page as it is first written,
    on 2 MiB pages where the kernel has them (madvise): a first write of a page of KV
    then faults once per 2 MiB instead of once per 4 KiB (~350 MB/s on the 2-core VM with
    4 KiB pages, which made the first copies into the store cost 30x later ones)."""
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    memory = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, dtype, count=int(np.prod(shape))).reshape(shape)
