"""Speculative decoding's counters, as the servers report them (GetServerStatus, the
spec_decode_* metrics)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpeculationStats:
    """Counters since start: per draft position j (0-based), the sequences-steps that
    proposed a j-th draft and those that accepted it (for a tree, depth j + 1: its tree
    reached it, its accepted path did)."""

    method: str
    proposed: list[int]
    accepted: list[int]
    steps: int = 0  # steps that verified drafts
    # Of those, dispatched while the step before them was still in flight (Engine.step).
    async_steps: int = 0
    active: bool = True  # whether the last step was allowed to speculate (the policy)

    @property
    def num_speculative_tokens(self) -> int:
        return len(self.proposed)

    @property
    def num_proposed(self) -> int:
        return sum(self.proposed)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        for j in range(num_drafts):
            self.proposed[j] += 1
            self.accepted[j] += j < num_accepted

    def snapshot(self) -> SpeculationStats:
        """A copy that later steps leave alone (for another thread to read)."""
        return dataclasses.replace(self, proposed=list(self.proposed),
                                   accepted=list(self.accepted))
