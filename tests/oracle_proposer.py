"""A proposer for tests of speculative decoding's verification: it knows each prompt's
continuation (the target's own tokens, from a run without speculation) and proposes it,
so drafts are accepted unless it is told to spoil some."""

from __future__ import annotations

from jaxserve.engine.proposers import TokenProposer


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
