"""A sequence's speculative decoding state: one object on the sequence, read and written
only by the speculative package (the engine and the scheduler never look inside)."""

from __future__ import annotations

import dataclasses

from jaxserve.engine.request import Sequence


@dataclasses.dataclass
class SeqSpeculation:
    # The sequence's num_preemptions when this was made: a preempted sequence recomputes
    # everything, so its state starts over (`state_of`).
    preemptions: int
    # Leading tokens whose K/V the proposer's own cache holds (draft_model.py, eagle.py).
    computed: int = 0
    # Medusa heads' guesses after the sequence's token number `[0]`: (num_tokens, each
    # head's top tokens).
    guesses: tuple[int, list[list[int]]] | None = None


def state_of(seq: Sequence) -> SeqSpeculation:
    """`seq`'s state, made afresh the first time and after each preemption."""
    state = seq.speculation
    if state is None or state.preemptions != seq.num_preemptions:
        state = seq.speculation = SeqSpeculation(seq.num_preemptions)
    return state
