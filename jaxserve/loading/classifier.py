"""A checkpoint's classification head: what `classify`, `/score` and `/rerank` apply to a
prompt's last final hidden state (after the last norm), as vLLM reads one.

- A sequence classifier (`*ForSequenceClassification`: reward models, converted rerankers,
  text classifiers): its `score.weight` `[num_labels, hidden]`. It has no LM head, so it
  generates nothing (the one token a pooling request computes and discards comes from
  its embedding's table).
- A causal LM with config.json's `classifier_from_token` (vLLM's `--hf-overrides`, how
  Qwen3-Reranker and bge-reranker-v2-gemma are served): rows of its LM head. `method`
  "from_2_way_softmax" (tokens [false, true], one label: softmax's "true" probability
  is the sigmoid of the difference of the rows' logits) or "no_post_processing" (a label
  per token).

The activation is transformers' loss's (problem_type), else sentence-transformers' (its
activation_fn), else a sigmoid for one label and a softmax for several."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxserve.loading.safetensors import checkpoint_tensors

ACTIVATIONS = ("softmax", "sigmoid", "identity")
METHODS = ("from_2_way_softmax", "no_post_processing")
# sentence-transformers' activation_fn (torch.nn.modules' classes) -> ours.
_TORCH_ACTIVATIONS = {"Sigmoid": "classify", "Softmax": "classify", "Identity": "identity"}


@dataclasses.dataclass(frozen=True)
class Classifier:
    weight: np.ndarray  # float32 [num_labels, hidden]
    activation: str  # one of ACTIVATIONS
    labels: tuple[str | None, ...]  # config.json's id2label, by index (None: unnamed)
    generates: bool  # whether the model also has its LM head (False: a sequence classifier)
    # A query/document pair is tokenized as a text pair (the tokenizer's pair template)
    # rather than as one concatenated text (config.json's use_sep_token, vLLM's rule).
    use_sep_token: bool
    # --pooler-config's (pooling_config.with_pooler_config): whether the activation is
    # applied when a request does not say, and the logits' calibration before it.
    activates: bool = True
    logit_mean: float = 0.0
    logit_sigma: float = 1.0

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def classify(self, hidden: np.ndarray, use_activation: bool | None = None) -> np.ndarray:
        """float32 `[num_labels]`: the head on a pooled hidden state (calibrated), then its
        activation unless `use_activation` is False (or None and `activates` is)."""
        logits = self.weight @ np.asarray(hidden, np.float32)
        if (self.logit_mean, self.logit_sigma) != (0.0, 1.0):
            logits = ((logits - self.logit_mean) / self.logit_sigma).astype(np.float32)
        activates = self.activates if use_activation is None else use_activation
        if not activates or self.activation == "identity":
            return logits
        if self.activation == "sigmoid":
            return 1 / (1 + np.exp(-logits))
        e = np.exp(logits - logits.max())
        return e / e.sum()


def is_sequence_classifier(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def read_classifier(model_dir: str | Path | None, hf: dict, tokenizer) -> Classifier | None:
    """The classification head of the checkpoint at `model_dir` whose config.json is `hf`
    (overrides applied), None when it has none. `tokenizer` reads `classifier_from_token`.
    ValueError for a head that cannot be read."""
    architecture = (hf.get("architectures") or [""])[0]
    tokens = hf.get("classifier_from_token")
    if model_dir is None or not Path(model_dir).is_dir() or not (
            tokens or is_sequence_classifier(architecture)):
        return None
    labels = hf.get("id2label") or {}
    if tokens:
        method = hf.get("method") or ("from_2_way_softmax" if hf.get("is_original_qwen3_reranker")
                                      else None)
        if method not in METHODS:
            raise ValueError(f"classifier_from_token: config.json's method must be one of "
                             f"{METHODS}, got {method!r}")
        if method == "from_2_way_softmax" and len(tokens) != 2:
            raise ValueError("classifier_from_token: from_2_way_softmax takes two tokens "
                             f"[false, true], got {tokens}")
        ids = [tokenizer.token_to_id(t) if tokenizer is not None else None for t in tokens]
        if None in ids:
            raise ValueError(f"classifier_from_token: {tokens[ids.index(None)]!r} is not a "
                             "token of this model's tokenizer")
        rows = _head_rows(model_dir, hf, ids)
        weight = rows[1:] - rows[:1] if method == "from_2_way_softmax" else rows
        generates, sep = True, bool(hf.get("use_sep_token", False))
        labels = {} if method == "from_2_way_softmax" else labels
    else:
        weight = _score_weight(model_dir)
        generates, sep = False, bool(hf.get("use_sep_token", True))
    n = weight.shape[0]
    names = tuple(labels.get(str(i), labels.get(i)) for i in range(n))
    return Classifier(np.ascontiguousarray(weight, np.float32), _activation(hf, n), names,
                      generates, sep)


def _activation(hf: dict, num_labels: int) -> str:
    problem = hf.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem != "single_label_classification":
        name = ((hf.get("sentence_transformers") or {}).get("activation_fn")
                or hf.get("sbert_ce_default_activation_function"))
        if name:
            kind = _TORCH_ACTIVATIONS.get(name.rsplit(".", 1)[-1])
            if kind is None or not name.startswith("torch.nn.modules."):
                raise ValueError(f"config.json's activation function {name!r}: jaxserve "
                                 f"applies torch.nn's {', '.join(_TORCH_ACTIVATIONS)}")
            if kind == "identity":
                return "identity"
    return "sigmoid" if num_labels < 2 else "softmax"


def _score_weight(model_dir: str | Path) -> np.ndarray:
    tensors = dict(checkpoint_tensors(model_dir))  # memory-mapped: nothing read but these
    if "score.bias" in tensors:
        raise ValueError("a sequence classifier's score.bias is not supported")
    if "score.weight" not in tensors:
        raise ValueError(f"checkpoint {model_dir} is a sequence classifier (config.json's "
                         "architectures) without score.weight")
    return _float("score.weight", tensors["score.weight"])


def _head_rows(model_dir: str | Path, hf: dict, ids: list[int]) -> np.ndarray:
    """Rows `ids` of the LM head (the embedding's table when they are tied)."""
    tensors = dict(checkpoint_tensors(model_dir))
    name = "lm_head.weight" if "lm_head.weight" in tensors or not hf.get(
        "tie_word_embeddings") else "model.embed_tokens.weight"
    if name not in tensors:
        raise ValueError(f"classifier_from_token: checkpoint {model_dir} has no {name}")
    return _float(name, tensors[name][ids])


def _float(name: str, x: np.ndarray) -> np.ndarray:
    if x.dtype.kind not in "fV" or x.ndim != 2:
        raise ValueError(f"{name}: a classification head is read from a float [rows, hidden] "
                         f"tensor, got {x.dtype} {x.shape}")
    return np.asarray(x, np.float32)

