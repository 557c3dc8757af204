"""A short fingerprint of a checkpoint's weights, cheap enough to take at every start.

Prefill/decode disaggregation hands K/V from one server to another; both must serve the
same weights (a fine-tune has its base's config and tensor shapes, so those alone cannot
tell them apart). Hashing gigabytes at start-up would cost seconds to minutes, so each
weights file gives its name, its size and `SAMPLES` slices of `SAMPLE_BYTES` spread evenly
over it (the first holds a safetensors or GGUF header: names, shapes and dtypes); a file
no larger than the samples is read whole. Two checkpoints of one model that differ in
their weights differ in every sampled slice.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLES = 16
SAMPLE_BYTES = 4096
# What holds the weights of each kind of checkpoint loading/source.py and
# loading/converted.py read: safetensors files, one GGUF file, an Orbax `params/` tree.
WEIGHT_GLOBS = ("*.safetensors", "params/**/*")


def weights_digest(model: str | Path) -> str:
    """The hex SHA-256 of `model`'s weights files sampled (module doc): a GGUF file, or a
    checkpoint directory's safetensors files and converted parameters."""
    model = Path(model)
    if model.is_file():
        files = [(model.name, model)]
    else:
        files = sorted({p.relative_to(model).as_posix(): p for pattern in WEIGHT_GLOBS
                        for p in model.glob(pattern) if p.is_file()}.items())
    if not files:
        raise ValueError(f"{model}: no weights files ({', '.join(WEIGHT_GLOBS)}) to "
                         "fingerprint")
    h = hashlib.sha256()
    for name, path in files:
        size = path.stat().st_size
        h.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= SAMPLES * SAMPLE_BYTES:
                h.update(f.read())
                continue
            for i in range(SAMPLES):
                f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()
