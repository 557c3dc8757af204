"""Speculative decoding's proposers: each guesses a sequence's next tokens, for the step
to verify (engine/speculation.py)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Prompt lookup (vLLM's "ngram" method): find the sequence's last n tokens earlier in
    its tokens (prompt and output), for n from `max_n` down to `min_n`, and propose the
    tokens that followed their latest earlier occurrence. No model: it pays off where the
    output repeats its context (editing code, quoting, extraction)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` guessed next tokens of `tokens` ([] when no n-gram recurs)."""
        n_tokens = len(tokens)
        if k < 1 or n_tokens <= self.min_n:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so each has a token after it.
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start:start + k].tolist()
        return []
