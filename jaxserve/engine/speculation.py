"""Speculative decoding: who guesses ahead, how the step's samples accept the guesses,
and the counters.

A speculating sequence feeds the step its last token and k drafts (guessed next tokens)
as k + 1 query tokens; the step samples a row at each, row j with the sequence's own
sampling parameters, seed and output index (its output number len(outputs) + j), from
the target model's logits given the tokens before it. While the drafts equal the samples
the context each row saw is the true one, so the tokens emitted are the samples up to and
including the first that differs from its draft (all k + 1 when none does: the last is the
bonus token). A tree of drafts (Medusa's or EAGLE's, engine/token_tree.py) has a row per
node, the node's own output index len(outputs) + its depth: the tokens emitted follow the
path of samples down the tree (token_tree.accepted_path), the same rule along one branch.

For proposers that guess one token for sure (n-gram here), this is exactly rejection
sampling: a draft d is kept with probability p(d), and when it is not, the token comes
from p without d, renormalised, which is the residual max(0, p - q) / (1 - p(d)) of a
point-mass draft distribution q. So the output follows the target's distribution (its
temperature, top-k/top-p/min-p, bias and penalties included: the rows apply them as an
ordinary step does), and a seeded request gets the very tokens it gets without
speculation: output j is drawn with the same key from the same distribution.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config import SpeculativeConfig
from jaxserve.engine.proposers import NgramProposer
from jaxserve.engine.request import Sequence
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.token_tree import DraftTree


@dataclasses.dataclass
class SpeculationStats:
    """Counters since start: per draft position j (0-based), the sequences-steps that
    proposed a j-th draft and those that accepted it (for a tree, depth j + 1: its tree
    reached it, its accepted path did)."""

    proposed: list[int]
    accepted: list[int]
    steps: int = 0  # steps that verified drafts
    # Of those, dispatched while the step before them was still in flight (engine.step).
    async_steps: int = 0
    active: bool = True  # whether the last step was allowed to speculate (the policy)

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


class Speculator:
    """The engine's speculative decoding: the proposer, the policy and the counters.
    `proposer`: the method's (a draft model's, Medusa's, EAGLE's); n-gram's by default."""

    def __init__(self, config: SpeculativeConfig, proposer=None):
        self.config = config
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min,
                                                  config.prompt_lookup_max)
        k = config.num_speculative_tokens
        self.stats = SpeculationStats(proposed=[0] * k, accepted=[0] * k)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def allowed(self, num_running: int, prefills: bool = False) -> bool:
        """Whether a step with `num_running` sequences running speculates: not when it is
        compute-bound, that is when more than `disable_by_batch_size` sequences run, or
        when it computes prompt tokens (`prefills`): a prompt's chunk makes a step
        compute-bound whatever the batch, and guessed tokens (and a proposer's catch-up
        over the new sequences) only add to it. With no limit (None) every step may."""
        limit = self.config.disable_by_batch_size
        self.stats.active = limit is None or (num_running <= limit and not prefills)
        return self.stats.active

    def propose(self, entries: list[tuple[Sequence, int]], scheduler: Scheduler,
                pending: dict[Sequence, tuple[int, int]] | None = None) -> None:
        """Set the drafts of each (sequence, `room`: how many more tokens it may take; drafts
        beyond room - 1 could never be emitted, nor a tree's nodes past room - 1 have a
        slot within max_model_len: its first room - 1 nodes are a tree too). `pending`:
        the step in flight's rows of the seqs whose newest tokens it emits
        (BatchBuilder.build)."""
        entries = [(seq, min(self.num_speculative_tokens, room - 1), room)
                   for seq, room in entries]
        entries = [entry for entry in entries if entry[1] > 0]
        proposals = self.proposer.propose_batch([(seq, k) for seq, k, _ in entries], scheduler,
                                                pending)
        for (seq, _, room), drafts in zip(entries, proposals):
            if isinstance(drafts, DraftTree):
                seq.draft_token_ids = drafts.tokens[:room - 1]
                seq.draft_parents = drafts.parents[:room - 1]
            else:
                seq.draft_token_ids = drafts
