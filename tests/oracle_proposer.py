"""Proposers for tests of speculative decoding's verification: they know each prompt's
continuation (the target's own tokens, from a run without speculation) and propose it,
as a chain or along one branch of a tree, so drafts are accepted unless told to spoil
some."""

from __future__ import annotations

import random

from jaxserve.engine.speculative import drafts as trees
from jaxserve.engine.speculative.drafts import Drafts
from jaxserve.engine.speculative.proposers import Proposer, TokenProposer


class OracleProposer(TokenProposer):
    """Proposes the next tokens of `runs` ([(prompt, continuation)]); every `spoil`-th
    proposal (0: none) has its last draft changed, so the step rejects it."""

    def __init__(self, runs: list[tuple[list[int], list[int]]], vocab: int, spoil: int = 0):
        self.runs, self.vocab, self.spoil = runs, vocab, spoil
        self.calls = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for prompt, out in self.runs:
            if tokens[:len(prompt)] == prompt:
                done = len(tokens) - len(prompt)
                assert tokens[len(prompt):] == out[:done], "the output left the known run"
                drafts = list(out[done:done + k])
                self.calls += 1
                if self.spoil and drafts and self.calls % self.spoil == 0:
                    drafts[-1] = (drafts[-1] + 1) % self.vocab
                return drafts
        raise AssertionError(f"no known run starts like {tokens[:8]}")


class OracleTreeProposer(Proposer):
    """Proposes trees of the configured shape (`paths` of ranks, as
    SpeculativeConfig.speculative_token_tree keeps them) in which the known continuation
    lies along a random deepest branch and every other node is a wrong token: verified
    rightly, each step accepts that branch to its end, mostly through nodes out of their
    positions' slots. Every `spoil`-th tree (0: none) has its branch's last node wrong."""

    def __init__(self, runs: list[tuple[list[int], list[int]]], vocab: int,
                 paths: tuple[tuple[int, ...], ...], seed: int = 0, spoil: int = 0):
        self.runs, self.vocab, self.paths, self.spoil = runs, vocab, paths, spoil
        self.rng = random.Random(seed)
        self.calls = self.out_of_place = 0

    def propose_batch(self, entries, scheduler, pending=None):
        return [self._tree(seq.token_ids, k) for seq, k in entries]

    def _tree(self, tokens: list[int], k: int) -> Drafts:
        for prompt, out in self.runs:
            if tokens[:len(prompt)] == prompt:
                done = len(tokens) - len(prompt)
                assert tokens[len(prompt):] == out[:done], "the output left the known run"
                # The engine keeps a tree's first room - 1 nodes (room: tokens still to
                # come), so the branch is picked among the deepest paths that survive.
                paths = [p for p in self.paths if len(p) <= k][:len(out) - done - 1]
                depth = max(map(len, paths))
                branch = self.rng.choice([p for p in paths if len(p) == depth])
                self.calls += 1
                self.out_of_place += any(branch[:i + 1] != paths[i] for i in range(depth))
                spoil = self.spoil and self.calls % self.spoil == 0
                drafts = []
                for p in paths:
                    truth = out[done + len(p) - 1]
                    right = p == branch[:len(p)] and not (spoil and p == branch)
                    drafts.append(truth if right else (truth + 1 + p[-1]) % self.vocab)
                return Drafts(drafts, trees.paths_parents(paths))
        raise AssertionError(f"no known run starts like {tokens[:8]}")
