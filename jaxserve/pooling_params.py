"""What a pooling request asks (vLLM's PoolingParams), and its pooled vector finished.

A request with pooling runs its prompt like any other and returns, instead of text, its
tokens' final hidden states (after the last norm) pooled: for an embedding (task
"embed") as the checkpoint says (loading/pooling_config.py): by default its last prompt
token's, how decoder-only embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) are
read; or the mean over the prompt, or its first token's. For a classification (task
"classify") its last token's, through the checkpoint's classification head
(loading/classifier.py)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sampling_params import SamplingParams

# What a pooling request runs as: its prompt computed, then one greedy token, discarded.
EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, speculative=False)
TASKS = ("embed", "classify")


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """`task`: "embed" (an embedding) or "classify" (the classification head's output).
    Embeddings: `dimensions`: keep the first this many entries (Matryoshka models only),
    before normalizing. `normalize`: scale to unit L2 norm (None: as the model's
    sentence-transformers modules say, and True without them). Classifications:
    `use_activation` False returns the head's raw logits (None, True: its softmax or
    sigmoid, as the checkpoint says); for an embedding it stands for `normalize` (vLLM
    0.32's name)."""

    dimensions: int | None = None
    normalize: bool | None = None
    task: str = "embed"
    use_activation: bool | None = None

    def check(self, hidden_size: int, matryoshka: tuple[int, ...] | bool,
              has_classifier: bool = False) -> None:
        """ValueError unless the model can answer these (`matryoshka`: the sizes its
        config.json names, True for any, False for none; `has_classifier`: whether it has
        a classification head)."""
        if self.task not in TASKS:
            raise ValueError(f"task: must be one of {TASKS}, got {self.task!r}")
        if self.task == "classify":
            if self.dimensions is not None or self.normalize is not None:
                raise ValueError("dimensions and normalize are an embedding's; a "
                                 "classification takes use_activation")
            if not has_classifier:
                raise ValueError(
                    "model: this model has no classification head to classify with (a "
                    "*ForSequenceClassification checkpoint has one, and a causal LM is given "
                    "one from its LM head's rows by config.json's classifier_from_token and "
                    "method, e.g. with --hf-overrides)")
            return
        if None not in (self.normalize, self.use_activation) and \
                self.normalize != self.use_activation:
            raise ValueError("normalize and use_activation disagree (for an embedding they "
                             "are one setting)")
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
    normalize = next((n for n in (params.normalize, params.use_activation) if n is not None),
                     normalize_by_default)
    if normalize:
        x = x / max(float(np.linalg.norm(x)), 1e-12)
    return x
