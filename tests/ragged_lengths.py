"""The sequence lengths of a random ragged attention batch, shared by the kernel tests."""

from __future__ import annotations


def draw_lengths(rng, kind: str, num_seqs: int, max_tokens: int) -> tuple[list[int], list[int]]:
    """(kv_lens, q_lens): decode is one new token per sequence, prefill a whole prompt, a
    chunk continues an earlier context; "mixed" takes the three in turn."""
    kv_lens, q_lens = [], []
    for s in range(num_seqs):
        kv = int(rng.integers(1, max_tokens + 1))
        phase = kind if kind != "mixed" else ("decode", "prefill", "chunk")[s % 3]
        q = {"decode": 1, "prefill": kv, "chunk": int(rng.integers(1, kv + 1))}[phase]
        kv_lens.append(kv)
        q_lens.append(q)
    return kv_lens, q_lens


def draw_trees(rng, kv_lens: list[int], q_lens: list[int], max_nodes: int = 32
               ) -> tuple[list[int], list[int], list[list[int]]]:
    """Speculative trees over a batch's new tokens: (tree_start per sequence, tree_mask
    per token, each tree's parent list). Most sequences with two or more new tokens make
    their last n of them (2..min(q, max_nodes)) a random tree, each node's parent drawn
    from the nodes before it (node 0, the root, has none); the others have no tree
    (tree_start = kv_len). A node's mask has the bits of itself and its ancestors."""
    starts, masks, parents = [], [], []
    for kv, q in zip(kv_lens, q_lens):
        mask, parent = [0] * q, []
        if q >= 2 and rng.random() < 0.8:
            n = int(rng.integers(2, min(q, max_nodes) + 1))
            parent = [-1] + [int(rng.integers(0, j)) for j in range(1, n)]
            for j in range(n):
                bits, node = 0, j
                while node >= 0:
                    bits, node = bits | 1 << node, parent[node]
                mask[q - n + j] = bits - (1 << 32 if bits >= 1 << 31 else 0)  # as int32
        starts.append(kv - len(parent) if parent else kv)
        masks += mask
        parents.append(parent)
    return starts, masks, parents


def draw_images(rng, kv_lens: list[int], q_lens: list[int]) -> list[int]:
    """Images among a batch's new tokens, each whole in its step as the engine schedules
    them: image_end per token (the position of its image's last token; -1 outside
    images). Most sequences with three or more new tokens hold one or two images of 2 to
    16 tokens, which may start at the first new token or end at the last."""
    ends = []
    for kv, q in zip(kv_lens, q_lens):
        end = [-1] * q
        if q >= 3 and rng.random() < 0.8:
            cuts = sorted(rng.choice(q + 1, size=4, replace=False).tolist())
            for a, b in (cuts[:2], cuts[2:])[:int(rng.integers(1, 3))]:
                b = min(b, a + 16)
                if b - a >= 2:
                    end[a:b] = [kv - q + b - 1] * (b - a)
        ends += end
    return ends
