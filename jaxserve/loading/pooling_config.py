"""How a checkpoint pools its hidden states into an embedding: its sentence-transformers
modules (modules.json, 1_Pooling/config.json) and config.json's Matryoshka sizes, with
the server's --pooler-config (vLLM's) over them.

Without those files a decoder model is read as vLLM reads one as an embedding model: its
last token, normalized. Pooling the last token, the first (CLS) or the mean of all is
served; other modes, and modules after the pooling other than Normalize, are refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxserve.loading.classifier import Classifier

# sentence-transformers' Pooling config flags and what they pool.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
          "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
          "pooling_mode_weightedmean_tokens": "weightedmean"}
_ST = "sentence_transformers.models."
POOLED = ("last", "mean", "cls")  # the pooling modes served


@dataclasses.dataclass(frozen=True)
class ModelPooling:
    kind: str = "last"  # one of POOLED: the last prompt token's, the mean, or the first's
    normalize: bool = True  # embeddings L2-normalized unless a request says otherwise
    # The Matryoshka sizes config.json names (True: any, False: none; PoolingParams.check).
    matryoshka: tuple[int, ...] | bool = False
    # Why this checkpoint's embeddings cannot be made (None: they can).
    unsupported: str | None = None
    dimensions: int | None = None  # a request's `dimensions` when it gives none


# vLLM's --pooler-config keys served: pooling_type (or seq_pooling_type) LAST / MEAN / CLS,
# use_activation (embeddings: normalized; classifications: the head's activation),
# dimensions (the embeddings' default), logit_mean / logit_sigma (a classification's logits
# as (logit - mean) / sigma before the activation: Platt scaling).
POOLER_KEYS = ("pooling_type", "seq_pooling_type", "use_activation", "dimensions",
               "logit_mean", "logit_sigma")


def with_pooler_config(pooling: ModelPooling, classifier: Classifier | None,
                       config: dict | None) -> tuple[ModelPooling, Classifier | None]:
    """The checkpoint's pooling and classification head with a --pooler-config over them;
    ValueError for keys or values not served."""
    config = dict(config or {})
    unknown = sorted(set(config) - set(POOLER_KEYS))
    if unknown:
        raise ValueError(f"pooler_config: {unknown} not served; known: {list(POOLER_KEYS)}")
    kind = config.get("seq_pooling_type") or config.get("pooling_type")
    if kind is not None:
        if str(kind).lower() not in POOLED:
            raise ValueError(f"pooler_config: pooling_type must be one of "
                             f"{[k.upper() for k in POOLED]}, got {kind!r}")
        pooling = dataclasses.replace(pooling, kind=str(kind).lower())
    activation = config.get("use_activation")
    if activation is not None:
        pooling = dataclasses.replace(pooling, normalize=bool(activation))
    if config.get("dimensions") is not None:
        pooling = dataclasses.replace(pooling, dimensions=config["dimensions"])
    if classifier is not None:
        mean, sigma = config.get("logit_mean"), config.get("logit_sigma")
        if sigma is not None and not sigma:
            raise ValueError("pooler_config: logit_sigma must not be 0")
        classifier = dataclasses.replace(
            classifier, activates=classifier.activates if activation is None else bool(
                activation),
            logit_mean=classifier.logit_mean if mean is None else float(mean),
            logit_sigma=classifier.logit_sigma if sigma is None else float(sigma))
    return pooling, classifier


def read_pooling(model_dir: str | Path | None, hf: dict | None = None) -> ModelPooling:
    """The pooling of the checkpoint at `model_dir` (a directory; anything else, such as a
    GGUF file or None, pools as a plain decoder model); `hf`: its config.json as served
    (with --hf-overrides; None: the file's)."""
    path = Path(model_dir) if model_dir is not None else None
    if path is None or not path.is_dir():
        return ModelPooling()
    if hf is None:
        hf = read_hf_config(path)
    matryoshka: tuple[int, ...] | bool = False
    if hf.get("matryoshka_dimensions"):
        matryoshka = tuple(int(d) for d in hf["matryoshka_dimensions"])
    elif hf.get("is_matryoshka"):
        matryoshka = True
    modules = path / "modules.json"
    if not modules.is_file():
        return ModelPooling(matryoshka=matryoshka)
    kind, normalize, unsupported = "last", False, None
    for module in json.loads(modules.read_text()):
        name = module.get("type", "").removeprefix(_ST)
        if name == "Normalize":
            normalize = True
        elif name == "Pooling":
            kind = _pooling_mode(path / module.get("path", "") / "config.json")
            if kind not in POOLED:
                unsupported = (f"the checkpoint pools by {kind} (its sentence-transformers "
                               f"Pooling module); jaxserve pools by {', '.join(POOLED)}")
        elif name != "Transformer":
            unsupported = (f"the checkpoint's sentence-transformers module {name!r} is not "
                           "run by jaxserve (it runs the model, its pooling and Normalize)")
    return ModelPooling(kind if unsupported is None else "last", normalize, matryoshka,
                        unsupported)


def read_hf_config(model_dir: str | Path | None) -> dict:
    """config.json of a checkpoint directory ({} for anything else)."""
    path = Path(model_dir) / "config.json" if model_dir is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def _pooling_mode(config: Path) -> str:
    if not config.is_file():
        return "mean"  # sentence-transformers' Pooling default
    flags = json.loads(config.read_text())
    on = [mode for key, mode in _MODES.items() if flags.get(key)]
    return on[0] if len(on) == 1 else "+".join(on) or "mean"
