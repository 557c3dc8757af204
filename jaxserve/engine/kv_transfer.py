"""A request's prompt K/V moved between engines: prefill on one, decode on another
(prefill/decode disaggregation; docs/disaggregation.md).

The prefill engine reads the pages that hold a request's prompt out of its KV cache into
one array per cache entry (K, V, and their scales when the cache is quantized), all
layers at once: `[layers, kv_heads, pages, page_size(, head_dim)]`, each KV head once
(a tensor-parallel cache that stores a head on several devices gives one copy). That is
the form that travels, as stored (int8 / fp8 pages with their float32 scales). The
decode engine places it on its own mesh (`KVPages.placed`), writes it into the pages it
gave the request (each head as many times as its own cache stores it) and decodes on.
Page counts are padded to a few buckets so that both programs compile at warm-up.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.models.parallel import KV_CACHE_AXES


@dataclasses.dataclass
class KVPages:
    """The K/V of a request's first `num_tokens` tokens: per cache entry an array
    `[layers, kv_heads, pages, page_size(, head_dim)]` (device arrays of either engine,
    or numpy arrays that came over a wire); pages past the tokens' are padding."""

    entries: tuple[Any, ...]
    num_tokens: int

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.entries)


@dataclasses.dataclass
class Prefilled:
    """What a decode engine is given of a request prefilled elsewhere: its prompt's K/V,
    the first token the prefill sampled, and what computed them, which the decode engine
    checks against the request it is given (None: not checked): the prefill engine's
    `model_digest`, the prompt's token ids as it expanded them, its images' hashes (hex)."""

    first_token: int
    kv: KVPages
    model: str | None = None
    lora: str | None = None  # the request's adapter (None: the base model; always checked)
    token_ids: list[int] | None = None
    images: list[str] | None = None


def model_digest(config, model_config, weights: str) -> str:
    """What an engine computes K/V and tokens with, as a short hex digest: `weights` (the
    checkpoint's fingerprint: loading/digest.py), the model's config as served (its rope
    for the context it serves), the weights' dtype and quantization."""
    served = {"model": dataclasses.asdict(model_config), "weights": weights,
              **{k: getattr(config, k) for k in (
                  "dtype", "quantization", "quant_group_size", "quant_zero_points",
                  "quant_act_order", "lm_head_quantization", "lm_head_group_size",
                  "lm_head_zero_points", "quant_overrides", "embed_from_lm_head")}}
    text = json.dumps(served, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def page_buckets(max_pages: int) -> list[int]:
    """The page counts the programs compile for: powers of two below `max_pages` (the
    most one sequence holds), then it."""
    out, n = [], 1
    while n < max_pages:
        out.append(n)
        n *= 2
    return out + [max_pages]


class PageMover:
    """Reads a request's pages out of an engine's KV cache (`read`) and writes moved ones
    into it (`write`). `cache_shardings` is the cache's (per layer, per entry), `replicas`
    the copies of each KV head it stores (sharding/rules.py: kv_head_replicas),
    `pool_pages` the pages of each data shard's pool."""

    def __init__(self, shard, cache_shardings, num_layers: int, replicas: int,
                 pool_pages: int, max_pages: int):
        self.replicas = replicas
        self.pool_pages = pool_pages
        self._drop = pool_pages * shard.data_shards  # past the last page: not written
        self.buckets = page_buckets(max_pages)
        self.num_layers = num_layers
        # Moved pages on this mesh: KV heads split as the cache splits them when each
        # device holds whole heads, else whole on every device (each takes its own).
        heads = shard.rules.spec(KV_CACHE_AXES)[0] if replicas == 1 else None
        self._placement = lambda ndim: NamedSharding(  # noqa: E731
            shard.mesh, PartitionSpec(None, heads, *[None] * (ndim - 2)))
        self._read = jax.jit(functools.partial(_read_pages, replicas=replicas))
        self._write = jax.jit(functools.partial(_write_pages, replicas=replicas),
                              donate_argnums=(0,), out_shardings=cache_shardings)

    def bucket(self, num_pages: int) -> int:
        """The smallest bucket that holds `num_pages` pages."""
        i = bisect.bisect_left(self.buckets, num_pages)
        if i == len(self.buckets):
            raise ValueError(f"{num_pages} pages: more than one sequence holds "
                             f"({self.buckets[-1]})")
        return self.buckets[i]

    def read(self, kv_caches, data_shard: int, page_ids: list[int], num_tokens: int
             ) -> KVPages:
        """Start reading pages `page_ids` of data shard `data_shard` (those holding the
        first `num_tokens` tokens); the steps dispatched before have written them, and
        those after may reuse them (the device runs in order)."""
        size = self.bucket(len(page_ids))
        idx = np.zeros(size, np.int32)
        idx[:len(page_ids)] = np.asarray(page_ids) + data_shard * self.pool_pages
        return KVPages(tuple(self._read(kv_caches, idx)), num_tokens)

    def placed(self, kv: KVPages) -> KVPages:
        """`kv` on this engine's mesh, laid out for `write` (a copy started, from another
        mesh or from the host; host arrays padded to a bucket's pages first)."""
        entries = kv.entries
        size = self.bucket(entries[0].shape[2])
        if isinstance(entries[0], np.ndarray) and entries[0].shape[2] != size:
            entries = [np.pad(x, [(0, 0), (0, 0), (0, size - x.shape[2])]
                              + [(0, 0)] * (x.ndim - 3)) for x in entries]
        return KVPages(tuple(jax.device_put(x, self._placement(x.ndim)) for x in entries),
                       kv.num_tokens)

    def write(self, kv_caches, kv: KVPages, data_shard: int, page_ids: list[int | None]):
        """The caches with page j of `kv` written into `page_ids[j]` of data shard
        `data_shard` (None: left alone, e.g. a page this engine's prefix cache had)."""
        size = kv.entries[0].shape[2]
        idx = np.full(size, self._drop, np.int32)
        for j, page in enumerate(page_ids):
            if page is not None:
                idx[j] = page + data_shard * self.pool_pages
        return self._write(kv_caches, idx, kv.entries)

    def page_layout(self, abstract_kv) -> list[tuple[tuple[int, ...], Any]]:
        """One page as `read` gives it, per cache entry: its shape without the page axis,
        `(layers, kv_heads, page_size(, head_dim))`, and its dtype."""
        return [((self.num_layers, c.shape[0] // self.replicas, *c.shape[2:]),
                 jnp.dtype(c.dtype)) for c in abstract_kv[0]]

    def check(self, kv: KVPages, abstract_kv) -> None:
        """ValueError unless `kv` fits this engine's cache: entries, layers, heads, page
        size, head size and dtypes."""
        layout = self.page_layout(abstract_kv)
        if len(kv.entries) != len(layout):
            raise ValueError(f"moved K/V has {len(kv.entries)} entries per layer, this "
                             f"engine's cache {len(layout)} (one stores quantized K/V with "
                             "scales, the other not): give both the same kv_cache_dtype")
        for x, (want, dtype) in zip(kv.entries, layout):
            got = (x.shape[0], x.shape[1], *x.shape[3:])
            if got != want or jnp.dtype(x.dtype) != dtype:
                raise ValueError(
                    f"moved K/V pages are {x.dtype}{list(got)} (layers, kv heads, page "
                    f"size, head size), this engine's {dtype}{list(want)}: "
                    "both engines must serve the same model with the same page_size and "
                    "kv_cache_dtype")
            if x.shape[2] * x.shape[3] < kv.num_tokens or x.shape[2] > self.buckets[-1]:
                raise ValueError(f"moved K/V has {x.shape[2]} pages for {kv.num_tokens} "
                                 f"tokens; this engine holds at most {self.buckets[-1]} "
                                 "pages a sequence")

    def warmup(self, kv_caches):
        """Compile both programs for every bucket (each runs once on page 0, reading it
        and writing back what it read: no content changes). Returns the caches."""
        for size in self.buckets:
            pages = self.read(kv_caches, 0, [0] * size, 1)
            kv_caches = self.write(kv_caches, self.placed(pages), 0, [0] + [None] * (size - 1))
        return kv_caches


def _read_pages(kv_caches, idx, *, replicas: int):
    return [jnp.stack([layer[e][::replicas, idx] for layer in kv_caches])
            for e in range(len(kv_caches[0]))]


def _write_pages(kv_caches, idx, entries, *, replicas: int):
    return [tuple(c.at[:, idx].set(jnp.repeat(x[i], replicas, axis=0).astype(c.dtype),
                                   mode="drop")
                  for c, x in zip(layer, entries))
            for i, layer in enumerate(kv_caches)]
