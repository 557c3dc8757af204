"""Drafts: a sequence's guessed next tokens for the coming step, as a chain or a tree.

A speculating sequence feeds the step its last token and its drafts as extra query
tokens; the step samples a row at each (speculator.py). A chain's drafts follow each
other. A tree's nodes (Medusa's and EAGLE's candidate trees) are listed parents first;
`parents[j]` is node j's parent (-1: the root, the sequence's last token). The step lays
them out after the root in that order, each in a KV slot of its own (node j at position
`num_tokens + j`), with rope position `num_tokens - 1 + depth(j)` and an attention mask
that shows it only its ancestors and itself (`masks`); a chain is the tree whose node j
has parent j - 1.

The configured trees list paths of ranks (vLLM's `speculative_token_tree`: `(0, 1)` is
the second most likely token of the second head after the first head's most likely).
They are kept in depth-first order with the ranks ascending, so that the path of every
head's top guess comes first: when it is the path accepted, its nodes already sit in
the slots of their positions. Any other accepted path's nodes outside them have their
K/V moved there after the step (Scheduler.rollback, ModelRunner.move).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.engine.request import PLACEHOLDER


@dataclasses.dataclass(frozen=True)
class Drafts:
    """One sequence's drafts for a step: a chain, or a tree (`parents`). A proposer whose
    guesses stay on the device gives PLACEHOLDERs, and where each lies in the carry
    (`device_index`, CarryLayout.guess); the engine reads them back with the step's
    samples (their ids fill the PLACEHOLDERs in place). `NO_DRAFTS` is the empty one
    every sequence without drafts shares."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    parents: list[int] | None = None  # a tree's; None: a chain
    device_index: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def on_device(self) -> bool:
        """Whether the ids are still on the device (PLACEHOLDERs)."""
        return self.tokens[:1] == [PLACEHOLDER]

    @property
    def tree(self) -> list[int]:
        """Each node's parent (a chain's too)."""
        return self.parents if self.parents is not None else chain(len(self.tokens))

    def cut(self, n: int) -> Drafts:
        """The first `n` (a tree's first n nodes are a tree: parents come first)."""
        if n <= 0:
            return NO_DRAFTS
        return Drafts(self.tokens[:n], None if self.parents is None else self.parents[:n],
                      None if self.device_index is None else self.device_index[:n])


NO_DRAFTS = Drafts()


def chain(n: int) -> list[int]:
    """The parents of a chain of `n` drafts."""
    return list(range(-1, n - 1))


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (1: a child of the root)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def masks(parents: list[int]) -> np.ndarray:
    """int32 `[n]`: node j's bit mask of the nodes it sees (its ancestors and itself; bit
    i is node i), the kernels' `tree_mask`."""
    bits: list[int] = []
    for j, p in enumerate(parents):
        bits.append((bits[p] if p >= 0 else 0) | 1 << j)
    return np.asarray(bits, np.uint32).view(np.int32)


def path(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (none for the root, -1)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def accepted_path(tokens: list[int], parents: list[int], samples) -> list[int]:
    """The nodes the step's samples accept, from the root down: while the sample at the
    deepest accepted node (`samples[0]` the root's, `samples[1 + j]` node j's) is one of
    its children's token, that child. The tokens emitted are the accepted nodes' and
    the sample after the last."""
    accepted, node = [], -1
    while True:
        sample = int(samples[node + 1])
        child = next((j for j, p in enumerate(parents) if p == node and tokens[j] == sample),
                     None)
        if child is None:
            return accepted
        accepted.append(child)
        node = child


def paths_parents(paths: tuple[tuple[int, ...], ...]) -> list[int]:
    """The parents of a configured tree's nodes (`paths` in depth-first order, each
    path's parent before it)."""
    index = {p: j for j, p in enumerate(paths)}
    return [index.get(p[:-1], -1) for p in paths]


def cuts(paths: tuple[tuple[int, ...], ...]) -> dict[int, tuple[list[int], list[int]]]:
    """A configured tree cut to each depth k (1 to its depth): its nodes of depth <= k
    (their indices, in order: parents stay before children) and their parents among
    them."""
    out = {}
    for k in range(1, max(map(len, paths)) + 1):
        nodes = [j for j, p in enumerate(paths) if len(p) <= k]
        out[k] = (nodes, paths_parents(tuple(paths[j] for j in nodes)))
    return out
