"""Which images' embeddings are where in the encoder's device buffer (`[num_slots,
hidden]`, encoder.py): each image holds `ceil(tokens / PAGE)` pages of rows, keyed by its
content hash, so an image repeated (in one prompt or across requests) is encoded once.

A sequence holds its images (`acquire`) from its admission until its prompt has been
computed past them, then lets go (`release`); an image nobody holds stays cached, least
recently used evicted first when rows are needed. The scheduler admits a waiting sequence
only if its images fit (`can_acquire`); the engine encodes the images newly given rows
before the step that first reads them (`take_uploads`). Plain Python, no JAX.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxserve.engine.multimodal.inputs import ImageInput
from jaxserve.engine.request import Sequence

PAGE = 16  # rows per page of the buffer


@dataclasses.dataclass(eq=False)
class _Entry:
    pages: list[int]
    slots: np.ndarray  # each token's row
    holders: int = 0


class EncoderCache:
    def __init__(self, num_slots: int):
        self.num_pages = self.pages_for(num_slots)
        self.num_slots = self.num_pages * PAGE
        self._free = list(range(self.num_pages))
        self._entries: dict[bytes, _Entry] = {}
        self._idle: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._uploads: list[tuple[ImageInput, np.ndarray]] = []
        self._holding: dict[Sequence, list[bytes]] = {}
        self.num_encoded = 0  # images given rows and encoded
        self.num_hits = 0  # images a sequence found encoded (or being encoded)

    @staticmethod
    def pages_for(num_tokens: int) -> int:
        return -(-num_tokens // PAGE)

    def fits(self, images: list[ImageInput]) -> bool:
        """Whether the buffer could hold these images at once (a request's own check)."""
        unique = {image.hash: image for image in images}
        return sum(self.pages_for(i.num_tokens) for i in unique.values()) <= self.num_pages

    def can_acquire(self, seq: Sequence) -> bool:
        """Whether `seq`'s images (all of them: its cached prefix is not known yet; none
        that its K/V prefilled elsewhere hold) have rows or can get them, evicting images
        nobody holds."""
        missing = {s.image.hash: s.image for s in seq.images
                   if s.end > seq.num_prefilled_tokens and s.image.hash not in self._entries}
        pages = sum(self.pages_for(i.num_tokens) for i in missing.values())
        idle = sum(len(self._entries[h].pages) for h in self._idle)
        return pages <= len(self._free) + idle

    def acquire(self, seq: Sequence) -> None:
        """Hold `seq`'s images past its computed tokens (after `can_acquire`), giving rows
        to those without; sets each span's `slots`."""
        held = self._holding.setdefault(seq, [])
        for span in seq.images:
            if span.end <= seq.num_computed_tokens:
                continue
            image = span.image
            entry = self._entries.get(image.hash)
            if entry is None:
                entry = self._entries[image.hash] = self._allocate(image.num_tokens)
                self._uploads.append((image, entry.slots))
                self.num_encoded += 1
            else:
                self.num_hits += 1
            if entry.holders == 0:
                self._idle.pop(image.hash, None)
            entry.holders += 1
            held.append(image.hash)
            span.slots = entry.slots

    def release(self, seq: Sequence) -> None:
        """Let go of `seq`'s images (none held: nothing happens)."""
        held = self._holding.pop(seq, None)
        if held is None:
            return
        for h in held:
            entry = self._entries[h]
            entry.holders -= 1
            if entry.holders == 0:
                self._idle[h] = None
        for span in seq.images:
            span.slots = None

    def take_uploads(self) -> list[tuple[ImageInput, np.ndarray]]:
        """The images given rows since the last call, with their rows, to encode."""
        uploads, self._uploads = self._uploads, []
        return uploads

    def forget_idle(self) -> None:
        """Drop every image nobody holds (their rows' contents were lost)."""
        for h in self._idle:
            self._free += self._entries.pop(h).pages
        self._idle.clear()

    @property
    def num_used_slots(self) -> int:
        return (self.num_pages - len(self._free)) * PAGE

    def _allocate(self, num_tokens: int) -> _Entry:
        need = self.pages_for(num_tokens)
        while len(self._free) < need:
            h, _ = self._idle.popitem(last=False)
            self._free += self._entries.pop(h).pages
        pages, self._free = self._free[:need], self._free[need:]
        rows = (np.asarray(pages, np.int32)[:, None] * PAGE
                + np.arange(PAGE, dtype=np.int32)).reshape(-1)[:num_tokens]
        return _Entry(pages, rows)
