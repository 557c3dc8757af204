"""What a speculative method adds to an engine: its models loaded and sharded beside the
target (a draft model, Medusa heads, an EAGLE head or DeepSeek's MTP layer, which the
EAGLE proposer drives; none for n-gram), the memory they take per KV page, the batch
layout its steps need, and its Speculator. Without a method (`config` None) it adds
nothing, and `speculator()` is the no-op default."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from jaxserve.engine.batch import CarryLayout
from jaxserve.engine.kv_memory import abstract_kv_cache, kv_page_bytes
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.speculative.draft_model import DraftModel
from jaxserve.engine.speculative.eagle import EagleProposer
from jaxserve.engine.speculative.proposers import MedusaProposer, Proposer
from jaxserve.engine.speculative.speculator import SpeculativeDecoding, Speculator
from jaxserve.loading.eagle import load_eagle, read_eagle
from jaxserve.loading.medusa import load_medusa
from jaxserve.loading.mtp import load_mtp, read_mtp
from jaxserve.loading.safetensors import load_checkpoint
from jaxserve.models.medusa import MedusaHeads
from sharding.rules import ShardingContext, model_sharding

# A model beside the target: its config, sharding, graphdef and parameters.
Loaded = tuple[Any, ShardingContext, Any, Any]


@dataclasses.dataclass
class SpeculativeModels:
    config: SpeculativeConfig | None = None
    draft: Loaded | None = None  # (ModelConfig, ...)
    medusa: MedusaHeads | None = None
    eagle: Loaded | None = None  # (EagleCheckpoint or MtpCheckpoint, ...)

    @classmethod
    def load(cls, config: SpeculativeConfig | None, target: ModelConfig,
             target_shard: ShardingContext, strategy: str, dtype, options,
             target_dir: str | Path | None = None) -> SpeculativeModels:
        """The method's models for `target` (read from `target_dir`: DeepSeek's MTP
        layer), placed on its mesh with its `strategy`."""
        mesh = target_shard.mesh
        if config is None or config.method == "ngram":
            return cls(config)
        if config.method == "mtp":  # an EAGLE-1-like head from the target's checkpoint
            mtp = read_mtp(target_dir, target)
            shard = model_sharding(mesh, strategy, mtp.cfg)
            return cls(config, eagle=(mtp, shard, *load_mtp(target_dir, mtp, dtype, shard,
                                                            options)))
        if config.method == "draft_model":
            return cls(config, draft=_load_draft(config.model, target, mesh, strategy, dtype,
                                                 options))
        if config.method == "medusa":
            return cls(config, medusa=_load_medusa(config, target, dtype, target_shard))
        ckpt = read_eagle(config.model, 3 if config.method == "eagle3" else 1, target)
        shard = model_sharding(mesh, strategy, ckpt.cfg)
        return cls(config, eagle=(ckpt, shard, *load_eagle(ckpt, target, dtype, shard,
                                                           options)))

    @property
    def tree(self) -> tuple[tuple[int, ...], ...] | None:
        return self.config.speculative_token_tree if self.config is not None else None

    @property
    def num_drafts(self) -> int:
        """The most drafts a sequence verifies in a step: a tree's nodes, or k."""
        if self.config is None:
            return 0
        return len(self.tree) if self.tree else self.config.num_speculative_tokens

    @property
    def sampled_drafts(self) -> bool:
        """Whether a model's chains draw sampled requests' guesses from its distribution."""
        return ((self.draft is not None or self.eagle is not None) and not self.tree
                and self.config.sampled_drafts)

    @property
    def features_from(self) -> tuple[int, ...]:
        """The target layers an EAGLE head reads (the target's step keeps their output)."""
        return self.eagle[0].features_from if self.eagle is not None else ()

    def check(self, target: ModelConfig) -> None:
        if self.tree and any(target.layer_window(i) for i in range(target.num_layers)):
            raise ValueError("speculative_config: speculative_token_tree needs a model without "
                             "sliding-window attention (a tree node's window would be "
                             "counted from its slot, not its position); use a chain")

    def page_bytes(self, target: ModelConfig, page_size: int, kv_dtype, dtype) -> int:
        """Bytes one device holds per KV page beside the target's: the draft model's K/V,
        or an EAGLE layer's and the target features it reads, of the same page ids."""
        if self.draft is not None:
            return kv_page_bytes(self.draft[0], page_size, kv_dtype, self.draft[1])
        if self.eagle is not None:
            ckpt, shard = self.eagle[:2]
            return (kv_page_bytes(ckpt.cfg, page_size, kv_dtype, shard) + page_size
                    * len(ckpt.features_from) * target.hidden_size * jnp.dtype(dtype).itemsize)
        return 0

    def reserved_bytes(self, max_num_seqs: int, vocab_size: int) -> int:
        """Bytes beside the KV pool: sampled guesses' distributions (ModelRunner.draft_probs),
        max_num_seqs x k x vocabulary floats on every device."""
        if not self.sampled_drafts:
            return 0
        return max_num_seqs * self.config.num_speculative_tokens * vocab_size * 4

    def layout(self, max_num_seqs: int, async_scheduling: bool) -> CarryLayout:
        """The carry's layout. A draft model's chains verify in async steps: the device keeps
        each step's acceptance for the next (Engine.step)."""
        k = self.num_drafts
        overlap = self.draft is not None and not self.tree and async_scheduling
        return CarryLayout(max_num_seqs, k, rows=max_num_seqs * (1 + k) if overlap else 0)

    def speculator(self, engine: EngineConfig, target: ModelRunner, scheduler: Scheduler,
                   max_model_len: int, running: Callable, laid_out: Callable) -> Speculator:
        """The method's Speculator over the engine's runner (`running`: the running
        requests; `laid_out`: how the engine lays out a model's parameters for its
        matmuls)."""
        if self.config is None:
            return Speculator()
        return SpeculativeDecoding(self.config, target, scheduler, max_model_len, running,
                                   self._proposer(engine, target, laid_out))

    def _proposer(self, engine: EngineConfig, target: ModelRunner, laid_out: Callable
                  ) -> Proposer | None:
        k, tokens = self.config.num_speculative_tokens, engine.max_num_batched_tokens
        builder = target.builder
        if self.draft is not None:  # a runner of its own over the same pages
            draft_cfg, shard, graphdef, params = self.draft
            # (a text model: it reads an image's placeholder tokens as tokens, at their
            # plain positions)
            draft_builder = dataclasses.replace(builder, num_speculative_tokens=0,
                                                draft_model=True, images=False, mrope=False,
                                                whole_images=False)
            runner = ModelRunner(graphdef, laid_out(params, shard), shard, draft_builder,
                                 draft_cfg, target.kv_dtype)
            return DraftModel(runner, target, tokens, k)
        if self.medusa is not None:
            return MedusaProposer(self.tree)
        if self.eagle is not None:  # its layer's cache: the target's pages, as a draft's
            ckpt, shard, graphdef, params = self.eagle
            layer = abstract_kv_cache(ckpt.cfg, builder.num_pages * builder.data_shards,
                                      builder.page_size, target.kv_dtype, shard)[0]
            return EagleProposer(graphdef, laid_out(params, shard), shard, layer, target,
                                 tokens, k, self.tree)
        return None  # n-gram's


def _load_medusa(config: SpeculativeConfig, target: ModelConfig, dtype,
                 shard: ShardingContext) -> MedusaHeads:
    """Medusa heads on the devices, the first num_speculative_tokens, each guessing as
    many tokens as the tree's highest rank needs: their LM heads split over the
    vocabulary as the target's is (the strategy's `vocab` axis), the blocks replicated."""
    heads = load_medusa(config.model, target.hidden_size, target.vocab_size)
    if config.num_speculative_tokens > heads.lm_heads.shape[0]:
        raise ValueError(f"speculative_config: num_speculative_tokens is "
                         f"{config.num_speculative_tokens}, but {config.model} has "
                         f"{heads.lm_heads.shape[0]} Medusa heads")
    k = config.num_speculative_tokens
    top = 1 + max(max(p) for p in config.speculative_token_tree or [(0,)])
    axes = ((), (), (None, "embed", "vocab"))
    return MedusaHeads(*(jax.device_put(jnp.asarray(a[:k], dtype), shard.sharding(x))
                         for a, x in zip((heads.block_weights, heads.block_biases,
                                          heads.lm_heads), axes)), top=top)


def _load_draft(path: str, target: ModelConfig, mesh, strategy: str, dtype, options
                ) -> Loaded:
    """The draft model's config, sharding (the target's strategy) and weights."""
    draft_dir = Path(path)
    if not draft_dir.is_dir():
        raise ValueError(f"speculative_config: model {path!r} is not a checkpoint directory")
    draft_cfg = ModelConfig.from_file(draft_dir)
    if draft_cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary has "
                         f"{draft_cfg.vocab_size} tokens, the target's {target.vocab_size}; "
                         "a draft must share the target's tokenizer")
    shard = model_sharding(mesh, strategy, draft_cfg)
    # A float draft is quantized like the target; an act-order permutation, formats of
    # single layers and lookups from the head are the target checkpoint's own.
    options = dataclasses.replace(options, quant_act_order=False, quant_overrides=(),
                                  embed_from_lm_head=False)
    graphdef, params = load_checkpoint(draft_dir, draft_cfg, dtype, shard, options)
    return draft_cfg, shard, graphdef, params

