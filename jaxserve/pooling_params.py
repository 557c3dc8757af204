"""What an embedding request asks (vLLM's PoolingParams), and its pooled vector finished.

A request with pooling runs its prompt like any other and returns, instead of text, its
tokens' final hidden states (after the last norm) pooled as the checkpoint says
(loading/pooling_config.py): by default its last prompt token's, how decoder-only
embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) are read; or the mean over the
prompt, or its first token's."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sampling_params import SamplingParams

# What an embedding request runs as: its prompt computed, then one greedy token, discarded.
EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, speculative=False)


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the first this many entries (Matryoshka models only), before
    normalizing. `normalize`: scale to unit L2 norm (None: as the model's
    sentence-transformers modules say, and True without them)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def check(self, hidden_size: int, matryoshka: tuple[int, ...] | bool) -> None:
        """ValueError unless the model can answer these (`matryoshka`: the sizes its
        config.json names, True for any, False for none)."""
        d = self.dimensions
        if d is None:
            return
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= hidden_size:
            raise ValueError(f"dimensions: must be an integer in [1, {hidden_size}] (the "
                             f"model's hidden size), got {d!r}")
        if matryoshka is False:
            raise ValueError("dimensions: this model was not trained for Matryoshka "
                             "representations (its config.json sets neither is_matryoshka "
                             "nor matryoshka_dimensions): a shortened embedding would be "
                             "poor; leave dimensions out")
        if matryoshka is not True and d not in matryoshka:
            raise ValueError(f"dimensions: this model supports {sorted(matryoshka)}, got {d}")


def finish_embedding(hidden: np.ndarray, params: PoolingParams,
                     normalize_by_default: bool) -> np.ndarray:
    """The embedding a request asked for from its pooled hidden state (float32 `[hidden]`):
    shortened to `dimensions`, then L2-normalized (torch's F.normalize, eps 1e-12)."""
    x = np.asarray(hidden, np.float32)[:params.dimensions]
    normalize = normalize_by_default if params.normalize is None else params.normalize
    if normalize:
        x = x / max(float(np.linalg.norm(x)), 1e-12)
    return x
