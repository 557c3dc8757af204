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
