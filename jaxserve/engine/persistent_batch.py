"""The step inputs that persist across steps: a seat for each sequence the batches lay out,
holding its page-table row and its sampling parameters, written when it takes the seat and
when its pages or parameters change, not every step (vLLM V1's `InputBatch` plays this
part). `BatchBuilder.build` gathers a step's rows from the seats with whole-array numpy.

A seat is kept while its sequence runs. A sequence that finished (or was preempted, or
was never run by a scheduler) gives its seat up when the seats run out and it is not in
the batch being built; a preempted sequence coming back finds its pages rewritten (its
page list is a new one: `Sequence.page_ids`).
"""

from __future__ import annotations

import numpy as np

from jaxserve.engine.request import Sequence, SequenceStatus
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams

# Per seat: name, dtype, trailing shape, value of a seat without a sequence.
_PARAM_COLUMNS = (
    ("temperature", np.float32, (), 0.0),
    ("top_k", np.int32, (), 0),
    ("top_p", np.float32, (), 1.0),
    ("min_p", np.float32, (), 0.0),
    ("presence_penalty", np.float32, (), 0.0),
    ("frequency_penalty", np.float32, (), 0.0),
    ("repetition_penalty", np.float32, (), 1.0),
    ("seed", np.uint32, (), 0),
    ("logprobs", np.bool_, (), False),
    ("bias_ids", np.int32, (MAX_LOGIT_BIAS,), -1),
    ("bias_values", np.float32, (MAX_LOGIT_BIAS,), 0.0),
    ("banned_ids", np.int32, (MAX_STOP_TOKEN_IDS,), -1),  # banned until min_tokens
    ("min_tokens", np.int32, (), 0),
    ("penalties", np.bool_, (), False),  # SamplingParams.uses_penalties
)
# The columns copied into SamplingArrays as they are.
SAMPLING_COLUMNS = tuple(name for name, *_ in _PARAM_COLUMNS[:11])
_EMPTY = {name: empty for name, _, _, empty in _PARAM_COLUMNS}


class PersistentBatch:
    """Seats for up to `capacity` sequences (it grows when every seat holds one still
    running or in the batch at hand): `page_table[seat]` (the seat's page ids, zeros
    after them) and a column per sampling parameter (`_PARAM_COLUMNS`)."""

    def __init__(self, capacity: int, pages_per_seq: int, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = tuple(eos_token_ids)
        self.pages_per_seq = pages_per_seq
        self._seat: dict[Sequence, int] = {}
        self._holder: list[Sequence | None] = []
        self._free: list[int] = []
        self._pages: list[list[int] | None] = []  # the page list each row was written from
        self._num_pages: list[int] = []  # how much of it
        self._params: list[SamplingParams | None] = []
        # The columns each seat holds a value other than a seat without a sequence in,
        # and how many seats do so per column: a batch copies only those columns.
        self._set: list[frozenset[str]] = []
        self._num_set: dict[str, int] = dict.fromkeys(_EMPTY, 0)
        self.page_table = np.zeros((0, pages_per_seq), np.int32)
        for name, dtype, shape, _ in _PARAM_COLUMNS:
            setattr(self, name, np.zeros((0, *shape), dtype))
        self._grow(max(capacity, 1))

    @property
    def capacity(self) -> int:
        return len(self._holder)

    def seats(self, seqs: list[Sequence]) -> np.ndarray:
        """Each sequence's seat (taking one for a sequence new to the table), its page row
        and parameters brought up to date."""
        out = []
        for seq in seqs:
            seat = self._seat.get(seq)
            if seat is None:
                seat = self._take(seq, seqs)
            pages = seq.page_ids
            if pages is not self._pages[seat]:
                row = self.page_table[seat]
                row[:] = 0
                row[:len(pages)] = pages
                self._pages[seat], self._num_pages[seat] = pages, len(pages)
            elif len(pages) != self._num_pages[seat]:  # grown in place
                self.page_table[seat, self._num_pages[seat]:len(pages)] = \
                    pages[self._num_pages[seat]:]
                self._num_pages[seat] = len(pages)
            if seq.params is not self._params[seat]:
                self._write_params(seat, seq.params)
            out.append(seat)
        return np.array(out, np.int32)

    def any_penalties(self, seats: np.ndarray) -> bool:
        """Whether a sequence of `seats` uses penalties."""
        return self._num_set["penalties"] > 0 and bool(self.penalties[seats].any())

    def sampling_columns(self, seats: np.ndarray):
        """(name, values of `seats`) of each SamplingArrays column some seat sets (the
        others hold a seat without a sequence's values everywhere)."""
        for name in SAMPLING_COLUMNS:
            if self._num_set[name]:
                yield name, getattr(self, name)[seats]

    def _take(self, seq: Sequence, batch: list[Sequence]) -> int:
        if not self._free:
            self._release_idle(batch)
        if not self._free:
            self._grow(2 * self.capacity)
        seat = self._free.pop()
        self._seat[seq], self._holder[seat] = seat, seq
        self._pages[seat] = self._params[seat] = None
        return seat

    def _release_idle(self, batch: list[Sequence]) -> None:
        """Free the seats of sequences not running and not in `batch`."""
        keep = set(batch)
        for seat, seq in enumerate(self._holder):
            if seq is not None and seq.status is not SequenceStatus.RUNNING and seq not in keep:
                del self._seat[seq]
                self._holder[seat] = self._pages[seat] = self._params[seat] = None
                self._count(seat, frozenset())
                self._free.append(seat)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        extra = capacity - old
        self.page_table = np.concatenate(
            [self.page_table, np.zeros((extra, self.pages_per_seq), np.int32)])
        for name, dtype, shape, empty in _PARAM_COLUMNS:
            setattr(self, name, np.concatenate(
                [getattr(self, name), np.full((extra, *shape), empty, dtype)]))
        self._holder += [None] * extra
        self._pages += [None] * extra
        self._num_pages += [0] * extra
        self._params += [None] * extra
        self._set += [frozenset()] * extra
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free

    def _write_params(self, seat: int, p: SamplingParams) -> None:
        """Write `p` into the seat's columns: a list is a row of a 2-D column, padded with
        its empty value. The columns set are told by the values themselves (comparing the
        written rows in numpy cost ~75 us a request)."""
        self._params[seat] = p
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
        values = {
            "temperature": p.temperature, "top_k": max(p.top_k, 0), "top_p": p.top_p,
            "min_p": p.min_p, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty, "seed": p.seed,
            "logprobs": p.logprobs is not None, "bias_ids": list(p.logit_bias),
            "bias_values": list(p.logit_bias.values()),
            "banned_ids": banned[:MAX_STOP_TOKEN_IDS], "min_tokens": p.min_tokens,
            "penalties": p.uses_penalties}
        columns_set = set()
        for name, value in values.items():
            column, empty = getattr(self, name), _EMPTY[name]
            if isinstance(value, list):
                column[seat] = empty
                column[seat, :len(value)] = value
                is_set = any(v != empty for v in value)
            else:
                column[seat] = value
                is_set = value != empty
            if is_set:
                columns_set.add(name)
        self._count(seat, frozenset(columns_set))

    def _count(self, seat: int, columns: frozenset[str]) -> None:
        for name in self._set[seat]:
            self._num_set[name] -= 1
        for name in columns:
            self._num_set[name] += 1
        self._set[seat] = columns
