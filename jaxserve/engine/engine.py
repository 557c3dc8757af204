"""The engine: requests in, tokens out, one `step()` at a time.

Each step: the scheduler picks tokens, the builder lays them out as a bucket-padded
ragged batch, the runner dispatches the jitted step, and the host appends the sampled
tokens and checks stop conditions (see `Engine.step` for the order). With `detokenize`
(the default) it also turns them into text and checks stop strings; the servers turn
that off and do it on a thread of their own (jaxserve/engine/output_text.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import compile_cache, token_tree
from jaxserve.engine.batch import BatchBuilder, BucketKey, Carry, StepBatch
from jaxserve.engine.draft_model import DraftModel
from jaxserve.engine.eagle import EagleProposer
from jaxserve.engine.output_text import OutputText
from jaxserve.engine.proposers import MedusaProposer
from jaxserve.engine.request import PLACEHOLDER, Request, Sequence, SequenceStatus
from jaxserve.engine.runner import (
    ModelRunner, abstract_kv_cache, fetch, kv_page_bytes, pages_per_seq, pool_size)
from jaxserve.engine.sampler import SampleOutput
from jaxserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from jaxserve.engine.speculation import Speculator
from jaxserve.engine.token_tree import accepted_path
from jaxserve.engine.structured_output import GrammarCompiler, MaskFiller
from jaxserve.loading import converted
from jaxserve.loading.eagle import EagleCheckpoint, load_eagle, read_eagle
from jaxserve.loading.medusa import load_medusa
from jaxserve.loading.safetensors import load_checkpoint, random_params
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.models.layers import dense_impl, weights_for_native_matmul
from jaxserve.models.medusa import MedusaHeads
from jaxserve.outputs import Logprob, StepOutput
from jaxserve.sampling_params import SamplingParams
from pallas_kernels.ragged_paged_attention import default_impl
from pallas_kernels.ragged_paged_attention.kv_cache import pool_dtype
from sharding.mesh import make_mesh
from sharding.rules import ShardingContext, model_sharding

log = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step: what it computes (each scheduled seq with its row in the
    outputs) and its sampled outputs, still on the device. A step sampled apart has
    `out` None between its forward pass and its sampling (`batch` and `key` wait for it)."""

    schedule: SchedulerOutput
    out: SampleOutput | None
    batch: StepBatch | None = None
    key: BucketKey | None = None
    expert_load: jax.Array | None = None  # ModelRunner.expert_load as this step leaves it
    guesses: jax.Array | None = None  # Medusa heads' guesses [R, heads, top], if it made them
    # The `prev_tokens` it read drafts still on the device from (an EAGLE head's), until
    # they are read back (Engine._resolve_drafts).
    device_drafts: jax.Array | None = None
    # Decode steps in its program (runner.dispatch_steps; `out` is [steps, R] then).
    steps: int = 1

    @property
    def sampling(self) -> list[ScheduledSeq]:
        """The scheduled seqs whose sample is real: each holds a PLACEHOLDER for it."""
        return [s for s in self.schedule.scheduled if s.samples]

    @functools.cached_property
    def pending(self) -> dict[Sequence, tuple[int, int]]:
        """Each sampling seq's first row in the outputs and its drafts (BatchBuilder.build;
        read by the proposer and the next step's batch alike)."""
        return {s.seq: (s.row, len(s.drafts)) for s in self.sampling}

    @property
    def verifies_drafts(self) -> bool:
        return any(s.drafts for s in self.schedule.scheduled)


def _is_ready(out: SampleOutput) -> bool:
    return all(x.is_ready() for x in jax.tree.leaves(out))


class Engine:
    """Continuous-batching engine over one model (see `Engine.from_config`)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, graphdef, params,
                 tokenizer: Tokenizer | None, shard: ShardingContext, broadcaster=None,
                 draft: tuple[ModelConfig, ShardingContext, object, object] | None = None,
                 medusa: MedusaHeads | None = None,
                 eagle: tuple[EagleCheckpoint, ShardingContext, object, object] | None = None):
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        # Turn tokens into text and check stop strings in step() (OutputText); whoever
        # turns this off does both itself, before adding requests.
        self.detokenize = True
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        # The tokenizer's list gathers its own EOS, generation_config.json's and config.json's.
        eos = tokenizer.eos_token_ids if tokenizer is not None else model_config.eos_token_ids
        self.eos_token_ids = tuple(sorted(set(eos)))
        kv_dtype = pool_dtype(config.kv_storage_dtype, config.kernel_impl or default_impl())
        per_seq = pages_per_seq(self.max_model_len, config.page_size)
        shards = shard.data_shards
        # Pages per data shard: each device holds its shard's pages (of its cache heads),
        # and the draft model's pages of the same ids.
        page_bytes = kv_page_bytes(model_config, config.page_size, kv_dtype, shard)
        if draft is not None:
            page_bytes += kv_page_bytes(draft[0], config.page_size, kv_dtype, draft[1])
        if eagle is not None:  # its layer's K/V, and the target's features it reads
            page_bytes += kv_page_bytes(eagle[0].cfg, config.page_size, kv_dtype, eagle[1])
            page_bytes += (config.page_size * len(eagle[0].features_from)
                           * model_config.hidden_size * jnp.dtype(config.dtype).itemsize)
        spec = config.speculative_config
        tree = spec.speculative_token_tree if spec is not None else None
        # The draft model's and EAGLE chains' sampled guesses' distributions
        # (ModelRunner.draft_probs), on every device: max_num_seqs x k x vocabulary floats.
        sampled_drafts = (draft is not None or eagle is not None) and not tree and (
            spec.sampled_drafts)
        reserved = (config.max_num_seqs * spec.num_speculative_tokens * model_config.vocab_size
                    * 4 if sampled_drafts else 0)
        num_pages = config.num_pages // shards if config.num_pages else pool_size(
            page_bytes, per_seq * config.max_num_seqs // shards, config.kv_cache_memory_gib,
            config.memory_utilization, shard.mesh.local_devices[0], reserved)
        if num_pages < per_seq:
            raise ValueError(
                f"the KV cache holds {num_pages} pages of {config.page_size} tokens per data "
                f"shard, fewer than one sequence of max_model_len={self.max_model_len} needs "
                f"({per_seq}); lower max_model_len or give the cache more memory")
        self.num_pages = num_pages * shards
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            page_size=config.page_size,
            num_pages=num_pages,
            enable_prefix_caching=config.enable_prefix_caching,
            policy=config.scheduling_policy,
            data_shards=shards,
        ))
        if tree and any(model_config.layer_window(i) for i in range(model_config.num_layers)):
            raise ValueError("speculative_config: speculative_token_tree needs a model without "
                             "sliding-window attention (a tree node's window would be "
                             "counted from its slot, not its position); use a chain")
        k = len(tree) if tree else spec.num_speculative_tokens if spec is not None else 0
        # A draft model's chains verify in async steps: the device keeps each step's
        # acceptance for the next (batch.Carry; see `step`).
        overlap = draft is not None and not tree and config.async_scheduling
        self.builder = BatchBuilder(
            token_buckets=config.token_buckets, max_num_seqs=config.max_num_seqs,
            page_size=config.page_size, num_pages=num_pages, pages_per_seq=per_seq,
            max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
            vocab_size=model_config.vocab_size, data_shards=shards,
            num_speculative_tokens=k, tree=bool(tree), sampled_drafts=sampled_drafts,
            carry=Carry(config.max_num_seqs, k,
                        rows=config.max_num_seqs * (1 + k) if overlap else 0))
        # Multi-host, process 0: a broadcast.StepBroadcaster sends every step to the others.
        params = self._laid_out(params, shard)
        # Several decode steps per program (`_decode_steps`): not with speculative
        # decoding (its steps verify drafts) nor on several hosts (the others follow the
        # steps broadcast.py sends, one program each).
        decode_steps = (config.num_scheduler_steps if spec is None and broadcaster is None
                        else 1)
        self.runner = ModelRunner(graphdef, params, shard, self.builder, model_config, kv_dtype,
                                  broadcaster, medusa,
                                  eagle[0].features_from if eagle is not None else (),
                                  decode_steps)
        self.speculator = None
        if spec is not None:
            proposer = None  # n-gram's
            if draft is not None:  # the draft model: a runner of its own, the same pages
                draft_cfg, draft_shard, draft_graphdef, draft_params = draft
                draft_builder = dataclasses.replace(self.builder, num_speculative_tokens=0,
                                                    draft_model=True)
                draft_params = self._laid_out(draft_params, draft_shard)
                proposer = DraftModel(ModelRunner(draft_graphdef, draft_params, draft_shard,
                                                  draft_builder, draft_cfg, kv_dtype),
                                      self.runner, config.max_num_batched_tokens,
                                      spec.num_speculative_tokens)
            elif medusa is not None:
                proposer = MedusaProposer(tree)
            elif eagle is not None:  # its layer's cache: the target's pages, as a draft's
                ckpt, eagle_shard, eagle_graphdef, eagle_params = eagle
                layer = abstract_kv_cache(ckpt.cfg, self.num_pages, config.page_size, kv_dtype,
                                          eagle_shard)[0]
                eagle_params = self._laid_out(eagle_params, eagle_shard)
                proposer = EagleProposer(eagle_graphdef, eagle_params, eagle_shard, layer,
                                         self.runner, config.max_num_batched_tokens,
                                         spec.num_speculative_tokens, tree)
            self.speculator = Speculator(spec, proposer)
        self._requests: dict[str, Request] = {}
        self.grammars = (GrammarCompiler(tokenizer, model_config.vocab_size, self.eos_token_ids)
                         if tokenizer is not None else None)
        self._masks = MaskFiller()
        self._rng = random.Random(config.seed)
        self._inflight: InFlightStep | None = None
        self._moves: list[tuple[int, int, int]] = []  # K/V to move: (data shard, src, dst)
        self._expert_load = self.runner.expert_load  # as of the last collected step
        self.num_steps = 0  # steps dispatched
        self.num_overlapped_steps = 0  # dispatched while the step before was still running
        self.num_multi_steps = 0  # decode steps run in programs of several (_decode_steps)

    def _laid_out(self, params, shard: ShardingContext):
        """The parameters as the matmuls read them fastest: on one CPU device running the
        native matmul, the float weights laid out `[N, K]` (in place)."""
        if shard.mesh.size == 1 and dense_impl(self.config.model_options) == "cpu":
            return weights_for_native_matmul(params)
        return params

    @classmethod
    def from_config(cls, config: EngineConfig, random_weights_preset: str | None = None,
                    broadcaster=None) -> "Engine":
        """Load the checkpoint directory `config.model` (the demo model when None).

        `config.mesh` ({"data": d, "model": m}) and `config.sharding` (a strategy of
        sharding/rules.py) place the model on devices. `random_weights_preset` (a YAML
        model preset) builds random weights instead, with no tokenizer: for benchmarks.
        `broadcaster`: multi-host process 0's StepBroadcaster (broadcast.py).
        """
        compile_cache.enable(config.compilation_cache_dir)  # before anything compiles
        mesh = make_mesh(config.mesh)
        dtype = jnp.dtype(config.dtype)
        options = config.model_options
        if random_weights_preset is not None:
            model_config = ModelConfig.from_file(random_weights_preset)
            shard = model_sharding(mesh, config.sharding, model_config)
            graphdef, params = random_params(model_config, dtype, shard, seed=config.seed,
                                             options=options)
            return cls(config, model_config, graphdef, params, None, shard, broadcaster)
        if config.model is None:
            from jaxserve.demo import demo_model_dir
            config = dataclasses.replace(config, model=str(demo_model_dir()))
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise ValueError(f"model {config.model!r} is not a directory; give a Hugging Face "
                             "checkpoint directory (config.json, *.safetensors, tokenizer)")
        model_config = ModelConfig.from_file(model_dir)
        shard = model_sharding(mesh, config.sharding, model_config)
        if converted.is_converted(model_dir):
            options = converted.served_options(model_dir, options)
            config = dataclasses.replace(config, quantization=options.quantization)
            graphdef, params = converted.restore(model_dir, model_config, dtype, shard, options)
        else:
            graphdef, params = load_checkpoint(model_dir, model_config, dtype, shard, options)
        tokenizer = Tokenizer.from_pretrained(model_dir)
        draft = medusa = eagle = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            draft = cls._load_draft(spec.model, model_config, mesh, config, dtype, options)
        if spec is not None and spec.method == "medusa":
            medusa = cls._load_medusa(spec, model_config, dtype, shard)
        if spec is not None and spec.method in ("eagle", "eagle3"):
            ckpt = read_eagle(spec.model, 3 if spec.method == "eagle3" else 1, model_config)
            eagle_shard = model_sharding(mesh, config.sharding, ckpt.cfg)
            eagle = (ckpt, eagle_shard,
                     *load_eagle(ckpt, model_config, dtype, eagle_shard, options))
        return cls(config, model_config, graphdef, params, tokenizer, shard, broadcaster, draft,
                   medusa, eagle)

    @staticmethod
    def _load_medusa(spec, target: ModelConfig, dtype, shard: ShardingContext) -> MedusaHeads:
        """Medusa heads on the devices, the first num_speculative_tokens, each guessing as
        many tokens as the tree's highest rank needs: their LM heads split over the
        vocabulary as the target's is (the strategy's `vocab` axis), the blocks
        replicated."""
        heads = load_medusa(spec.model, target.hidden_size, target.vocab_size)
        if spec.num_speculative_tokens > heads.lm_heads.shape[0]:
            raise ValueError(f"speculative_config: num_speculative_tokens is "
                             f"{spec.num_speculative_tokens}, but {spec.model} has "
                             f"{heads.lm_heads.shape[0]} Medusa heads")
        k = spec.num_speculative_tokens
        top = 1 + max(max(p) for p in spec.speculative_token_tree or [(0,)])
        axes = ((), (), (None, "embed", "vocab"))
        return MedusaHeads(*(jax.device_put(jnp.asarray(a[:k], dtype), shard.sharding(x))
                             for a, x in zip((heads.block_weights, heads.block_biases,
                                              heads.lm_heads), axes)), top=top)

    @staticmethod
    def _load_draft(path: str, target: ModelConfig, mesh, config: EngineConfig, dtype, options
                    ) -> tuple:
        """The draft model's config, sharding (the target's strategy) and weights."""
        draft_dir = Path(path)
        if not draft_dir.is_dir():
            raise ValueError(f"speculative_config: model {path!r} is not a checkpoint directory")
        draft_cfg = ModelConfig.from_file(draft_dir)
        if draft_cfg.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary has "
                             f"{draft_cfg.vocab_size} tokens, the target's {target.vocab_size}; "
                             "a draft must share the target's tokenizer")
        shard = model_sharding(mesh, config.sharding, draft_cfg)
        graphdef, params = load_checkpoint(draft_dir, draft_cfg, dtype, shard, options)
        return draft_cfg, shard, graphdef, params

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0) -> list[int]:
        """Queue a request; returns its prompt token ids. Bad input raises ValueError."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer and this model has none; "
                             "use stop_token_ids")
        if params.structured_outputs is not None and self.grammars is None:
            raise ValueError("structured_outputs: grammars need a tokenizer and this model "
                             "has none")
        vocab = self.model_config.vocab_size
        for field, ids in (("stop_token_ids", params.stop_token_ids),
                           ("logit_bias", params.logit_bias)):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(f"{field}: token id {outside[0]} is outside the vocabulary "
                                 f"[0, {vocab})")
        token_ids = self._prompt_ids(prompt)
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is "
                             f"{self.max_model_len}, so at most {self.max_model_len - 1} fit")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len}); lower max_tokens to at most {room}")
        if params.seed is None:  # every request samples from its own reproducible stream
            params = dataclasses.replace(params, seed=self._rng.randrange(2**32))
        grammar = (self.grammars.matcher(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        seq = Sequence(request_id, token_ids, params=params, priority=priority,
                       max_output_tokens=min(params.max_tokens or room, room))
        text = (OutputText(self.tokenizer, token_ids, params, self.eos_token_ids)
                if self.detokenize and self.tokenizer is not None else None)
        self._requests[request_id] = Request(seq, text, grammar)
        self.scheduler.add(seq)
        return token_ids

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        return ids

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its pages; False if it is unknown or already done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def expert_load(self) -> np.ndarray | None:
        """`[MoE layers, num_experts]`: how many tokens (prompt and generated) each expert
        has taken, up to the last collected step; None for a dense model. Never waits for
        the device, so the servers may call it from their own threads."""
        load = self._expert_load
        return None if load is None else np.asarray(load.addressable_data(0))

    def router_statistics(self) -> list[tuple[int, np.ndarray, float]]:
        """Per MoE layer: (decoder layer index, tokens per expert, imbalance = the busiest
        expert's tokens / the mean, 1.0 before any token); [] for a dense model."""
        load = self.expert_load()
        if load is None:
            return []
        layers = [i for i, sparse in enumerate(self.model_config.sparse_layers) if sparse]
        return [(i, row, float(row.max() / row.mean()) if row.any() else 1.0)
                for i, row in zip(layers, load)]

    # ----------------------------------------------------------------- stepping

    def warmup(self, progress: bool = True) -> None:
        self.runner.warmup(progress)
        if self.speculator is not None:
            self.speculator.proposer.warmup(progress)

    def step(self) -> list[StepOutput]:
        """Run one batch; return the requests that produced tokens or finished.

        With `async_scheduling` a step's tokens are returned by the next call, which runs
        two phases in this order:
          1. dispatch step N: schedule it, build its batch and start it on the device;
          2. collect step N-1: wait for its samples, append them to their requests,
             detokenize and check stops, while the device runs step N.
        Step N cannot see step N-1's tokens on the host: its batch marks them to be read
        from N-1's outputs on the device (PLACEHOLDER tokens, `StepBatch.prev_index`). So
        the device always has the next step queued while the host works.
        A step whose requests use penalties or a grammar needs every token so far on the
        host to sample (the history; the grammar mask): it is sampled apart. Phase 1
        starts only its forward pass; after phase 2 the host fills the histories and masks
        and starts the sampling, so that work overlaps the forward pass on the device.
        Without async scheduling each call collects the step before it first.
        With speculative decoding a step may verify drafts (speculation.py) and emits
        1 to k + 1 tokens per sequence, as many as its drafts the target agrees with.
        Where the drafts are a draft model's chains (`_overlaps`), such steps run async
        too: the host counts every draft as accepted when it schedules the next step (its
        PLACEHOLDERs, pages and positions), and that step moves each sequence back by its
        drafts rejected, read on the device (batch.Carry, runner.resolve_pending); the
        draft model's next round reads the emitted tokens there too. Otherwise (n-gram's
        drafts come from the host's tokens; trees, Medusa's and EAGLE's heads, grammars,
        penalties) a step with drafts collects the step before it first, and is collected
        itself before returning (its pages are offered to the prefix cache once its
        accepted tokens are known).
        """
        prev, self._inflight = self._inflight, None
        outputs = []
        speculate = (self.speculator is not None
                     and self.speculator.allowed(self.scheduler.num_running,
                                                 self.scheduler.prefills_next))
        overlap = self._overlaps()
        if prev is not None and (not self.config.async_scheduling or (
                (speculate or prev.verifies_drafts) and not overlap)):
            outputs, prev = self._collect(prev), None
        if speculate:
            self._propose(prev)
        step = self._dispatch(prev, speculate)
        if prev is not None:
            outputs += self._collect(prev, later=step)
        if step is None:
            return outputs
        if step.out is None:
            self._dispatch_sample(step)
        if step.verifies_drafts:
            self.speculator.stats.steps += 1
            self.speculator.stats.async_steps += prev is not None
            if not overlap:
                outputs += self._collect(step)
                self.scheduler.cache_pages(step.schedule)
                return outputs
        # Step N's pages are full of known tokens now that N-1's samples are in.
        self.scheduler.cache_pages(step.schedule)
        if self.config.async_scheduling:
            self._inflight = step
        else:
            outputs += self._collect(step)
        return outputs

    def fail_step(self, error: BaseException) -> list[StepOutput]:
        """After `step()` raised: end every running request (they were in the failed step,
        or in the one in flight with it) with finish_reason "error" and free their pages;
        waiting requests stay queued. If the step consumed the KV cache, it is made anew
        and the prefix cache forgotten. The engine can step again afterwards."""
        self._inflight, self._moves = None, []
        message = f"{type(error).__name__}: {error}"
        outputs = []
        for seq in list(self.scheduler.running):
            req = self._requests.pop(seq.request_id, None)
            self.scheduler.abort(seq.request_id)
            if req is not None:
                outputs.append(StepOutput(
                    seq.request_id, [], "", None, True, "error",
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=seq.num_cached_tokens, error=message))
        if self.speculator is not None:
            self.speculator.proposer.recover()
        if self.runner.recover():
            for allocator in self.scheduler.allocators:
                allocator.reset_prefix_cache()
        return outputs

    def _overlaps(self) -> bool:
        """Whether steps with drafts may run async now (see `step`): a draft model
        proposes chains (its builder's carry keeps their acceptance on the device) and
        no running request needs all its tokens on the host before a step samples it
        (a grammar, penalties, stop tokens banned until min_tokens)."""
        if not self.builder.carry.overlap:
            return False
        for seq in self.scheduler.running:
            req = self._requests.get(seq.request_id)
            if req is not None and self._samples_from_host(seq, req):
                return False
        return True

    @staticmethod
    def _samples_from_host(seq: Sequence, req: Request) -> bool:
        """Whether `seq`'s next sample needs its tokens so far on the host: a grammar,
        penalties, or stop tokens banned until min_tokens (of those the host has)."""
        return (req.grammar is not None or seq.params.needs_history
                or seq.num_known_tokens - seq.num_prompt_tokens < seq.params.min_tokens)

    def _decode_steps(self) -> int:
        """How many decode steps the next program runs (`num_scheduler_steps` at most;
        1 unless the runner has a program for more). Several only while every running
        sequence decodes (no prompt to compute, none waiting for a seat: a new request's
        prefill goes first), samples without its token history on the host (no
        grammar, penalties, or stop tokens banned until min_tokens), and has room for
        them all (max_tokens, max_model_len): the steps' tokens then come back together,
        and a sequence that stops early has computed (and discards) the rest."""
        steps = self.runner.decode_steps
        if steps == 1 or self.scheduler.prefills_next:
            return 1
        for seq in self.scheduler.running:
            req = self._requests.get(seq.request_id)
            if req is None:  # finished or aborted meanwhile
                continue
            if self._samples_from_host(seq, req):
                return 1
            left = min(req.max_tokens - len(seq.output_token_ids),
                       self.max_model_len - seq.num_tokens)
            if left > 0:  # else the steps in flight end it: not scheduled
                steps = min(steps, left)
        return steps

    def _propose(self, prev: InFlightStep | None = None) -> None:
        """Give each decoding sequence drafts for the coming step (with the step `prev`
        in flight, its newest tokens are on the device: a draft model reads them there).
        Sequences with a grammar do not speculate (their drafts would need the grammar
        advanced through them), nor those whose request says not to."""
        entries = []
        for seq in self.scheduler.running:
            req = self._requests.get(seq.request_id)
            if (req is None or req.grammar is not None or not seq.params.speculative
                    or seq.num_tokens - seq.num_computed_tokens != 1):
                continue
            entries.append((seq, min(req.max_tokens - len(seq.output_token_ids),
                                     self.max_model_len - seq.num_tokens)))
        self.speculator.propose(entries, self.scheduler, prev.pending if prev else None)

    def _dispatch(self, prev: InFlightStep | None, speculate: bool) -> InFlightStep | None:
        """Schedule the next step, build its batch and start it (only its forward pass
        when it is sampled apart); None if nothing to run. While `speculate`, a model
        with Medusa heads also makes their guesses for the step after.

        Its sampling seqs get a PLACEHOLDER for the token it will sample."""
        steps = 1 if speculate else self._decode_steps()
        schedule = self.scheduler.schedule(steps)
        if schedule.is_empty:
            return None
        batch, key = self.builder.build(schedule, prev.pending if prev else None)
        batch.propose = np.asarray(speculate and self.runner.medusa is not None)
        prev_tokens = self.runner.sampled
        if prev is not None:
            self.num_overlapped_steps += not _is_ready(prev.out)
        if steps > 1:
            step = InFlightStep(schedule, self.runner.dispatch_steps(batch, key, steps),
                                steps=steps)
            self.num_multi_steps += steps
        elif any(s.seq.params.needs_history for s in schedule.scheduled if s.samples):
            self.runner.dispatch_forward(batch, key)
            step = InFlightStep(schedule, None, batch, key)
        else:
            step = InFlightStep(schedule, self.runner.dispatch(batch, key))
        step.expert_load = self.runner.expert_load
        if batch.propose:
            step.guesses = self.runner.guesses
        if any(s.drafts_on_device for s in schedule.scheduled):
            step.device_drafts = prev_tokens
        self.num_steps += 1
        for s in step.sampling:  # as many as the step can emit (`_append` keeps those it does)
            s.out_index = len(s.seq.output_token_ids)
            s.seq.output_token_ids.extend([PLACEHOLDER] * s.width)
        return step

    def _dispatch_sample(self, step: InFlightStep) -> None:
        """Sample a step sampled apart, now that every token before it is on the host:
        fill its histories (penalties) and its grammar masks, then start the sampling."""
        batch, key = step.batch, step.key
        if key.history:
            self._resolve_drafts(step)
            self.builder.fill_history(batch, step.schedule)
        constrained = [(req.grammar, s.row) for s in step.sampling
                       if (req := self._requests.get(s.seq.request_id)) is not None
                       and req.seq is s.seq and req.grammar is not None]
        if constrained:
            batch.sampling.grammar_mask = self._masks.fill(constrained, key.rows,
                                                           self.model_config.vocab_size)
        step.out = self.runner.dispatch_sample(batch, key)
        step.batch = None

    @staticmethod
    def _resolve_drafts(step: InFlightStep) -> None:
        """Give the step's drafts that were still on the device (PLACEHOLDERs) their ids,
        from the array the step read them from."""
        if step.device_drafts is None:
            return
        ids = np.asarray(step.device_drafts.addressable_data(0))
        for s in step.schedule.scheduled:
            if s.drafts_on_device:
                s.drafts = ids[s.guess_index].tolist()
        step.device_drafts = None

    def _collect(self, step: InFlightStep, later: InFlightStep | None = None
                 ) -> list[StepOutput]:
        """Wait for a dispatched step; hand its tokens to the requests still running.
        `later`: the step dispatched after it, in flight (its seqs' counts follow this
        step's)."""
        sampled = fetch(step.out)
        stride = 0
        if step.steps > 1:  # [steps, R]: the token of seq row r's step i at i x R + r
            stride = sampled.token_ids.shape[1]
            sampled = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), sampled)
        self._resolve_drafts(step)
        if step.expert_load is not None:
            self._expert_load = step.expert_load  # computed: reading it will not wait
        guesses = (np.asarray(step.guesses.addressable_data(0))
                   if step.guesses is not None else None)
        outputs = []
        following = {s.seq: s for s in later.schedule.scheduled} if later else {}
        for s in step.sampling:
            req = self._requests.get(s.seq.request_id)
            if req is not None and req.seq is s.seq:  # not aborted or finished meanwhile
                outputs.append(self._append(req, sampled, s, guesses, following.get(s.seq),
                                            stride))
        if self._moves:  # a tree's accepted nodes into their positions' slots
            self.runner.move(*self.runner.moves(self._moves))
            self._moves = []
        return outputs

    def _append(self, req: Request, sampled: SampleOutput, s: ScheduledSeq,
                guesses: np.ndarray | None = None, later: ScheduledSeq | None = None,
                stride: int = 0) -> StepOutput:
        """Put the step's tokens for `s` (its sample; with drafts, the accepted ones and
        the one after them; with several decode steps, each step's sample, `stride` rows
        apart) in its PLACEHOLDERs, up to the first that ends the request, and drop the
        PLACEHOLDERs left (the drafts rejected). `guesses`: Medusa heads' at each row,
        kept for the next step from the row of the last token. `later`: `s`'s seq in the
        step dispatched after this one, in flight, which counted every PLACEHOLDER here
        as a token: its counts move back by those dropped."""
        seq, params = req.seq, req.seq.params
        accepted: list[int] = []  # the drafts accepted (their nodes, in a tree)
        if s.drafts:
            parents = s.parents if s.parents is not None else token_tree.chain(len(s.drafts))
            accepted = accepted_path(s.drafts, parents, sampled.token_ids[s.row:])
            self.speculator.stats.record(max(token_tree.depths(parents)), len(accepted))
        finish = stop_reason = error = None
        new_text = ""
        outputs = seq.output_token_ids
        # Each token's sample.
        rows = ([s.row + i * stride for i in range(s.steps)] if s.steps > 1
                else [s.row] + [s.row + 1 + j for j in accepted])
        for index, i in enumerate(rows, s.out_index):
            token = int(sampled.token_ids[i])
            assert outputs[index] == PLACEHOLDER
            outputs[index] = token
            req.pending.append(token)
            if params.logprobs is not None:
                req.pending_logprobs.append(self._logprobs(sampled, i, token, params.logprobs))
            if req.grammar is not None and not req.grammar.consume_token(token):
                finish, stop_reason = "error", None
                error = (f"structured output: token {token} breaks the grammar: "
                         f"{req.grammar.get_error()}")
            else:
                finish, stop_reason = self._check_stop(req, token, num_outputs=index + 1)
            if req.grammar is not None and finish is None and req.grammar.is_stopped():
                finish = "stop"  # the grammar is complete and allows nothing more
            elif (req.grammar is not None and finish == "length"
                  and not req.grammar.is_accepting()):
                log.info("request %s: max_tokens reached before its grammar could end; the "
                         "output is incomplete", seq.request_id)
            if req.text is not None:
                text, stop = req.text.add([token], finish, stop_reason)
                new_text += text
                if stop is not None:
                    finish, stop_reason = "stop", stop
                if params.logprobs is not None:
                    req.text.decode_logprobs(req.pending_logprobs[-1:])
            if finish is not None:
                break
        if finish is not None:
            self.scheduler.finish(seq, finish)
            del self._requests[seq.request_id]
        else:
            self._keep_emitted(seq, s, index + 1 - s.out_index, accepted, later)
            if guesses is not None:  # they follow the last token: (tokens up to it, guesses)
                seq.medusa_guesses = (seq.num_prompt_tokens + index + 1,
                                      guesses[rows[-1]].tolist())
        out = StepOutput(
            request_id=seq.request_id, new_token_ids=req.pending, new_text=new_text,
            new_logprobs=req.pending_logprobs if params.logprobs is not None else None,
            finished=finish is not None, finish_reason=finish, stop_reason=stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            first_scheduled_at=seq.first_scheduled_at, error=error)
        req.pending, req.pending_logprobs = [], []
        return out

    def _keep_emitted(self, seq: Sequence, s: ScheduledSeq, emitted: int,
                      accepted: list[int], later: ScheduledSeq | None) -> None:
        """After `emitted` tokens of `s`'s step went into its first PLACEHOLDERs: drop
        the others (its rejected drafts) and put the seq's counts where the emitted
        tokens leave them. The draft model's K/V is kept up to the token before the last
        emitted one (its next round feeds those two, as an overlapping step does). With
        `later` (the seq's next step, in flight, scheduled as if every draft were kept)
        the seq's computed tokens, the draft's, and `later`'s own PLACEHOLDERs move back
        by the dropped ones; else the rejected drafts' K/V slots are given up
        (Scheduler.rollback; a tree's accepted nodes move into place)."""
        width = s.width
        dropped = width - emitted
        del seq.output_token_ids[s.out_index + emitted:s.out_index + width]
        start = seq.num_prompt_tokens + s.out_index  # the first emitted token's position
        if seq.status is not SequenceStatus.RUNNING:  # preempted meanwhile: recomputed later
            return
        keep = (start + emitted - 2 if self.speculator is not None
                and self.speculator.proposer.keeps_accepted else start)
        if later is None:
            seq.draft_computed_tokens = min(seq.draft_computed_tokens, keep)
            if s.drafts:
                self._moves += [(seq.data_shard, *m)
                                for m in self.scheduler.rollback(seq, accepted)]
            return
        if seq.draft_computed_tokens >= start + width:  # a later round fed the last two
            seq.draft_computed_tokens -= dropped
        else:
            seq.draft_computed_tokens = min(seq.draft_computed_tokens, keep)
        if dropped:
            seq.num_computed_tokens -= dropped
            later.start -= dropped
            later.out_index -= dropped
            self.scheduler.allocators[seq.data_shard].truncate(seq, seq.num_computed_tokens)

    def _check_stop(self, req: Request, token: int, num_outputs: int
                    ) -> tuple[str | None, str | int | None]:
        """Whether the request ends with `token`, its `num_outputs`-th output (stop strings
        are OutputText's to find)."""
        params, n = req.seq.params, num_outputs
        if n >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if n >= req.max_tokens or req.seq.num_prompt_tokens + n >= self.max_model_len:
            return "length", None
        return None, None

    def _logprobs(self, s: SampleOutput, i: int, token: int, n: int) -> dict[int, Logprob]:
        # A token the grammar mask rules out has logprob -inf: given as -9999 (as vLLM
        # does), so it stays a JSON number.
        top = {int(t): Logprob(max(float(lp), MIN_LOGPROB), rank=r + 1)
               for r, (t, lp) in enumerate(zip(s.top_ids[i][:n], s.top_logprobs[i][:n]))}
        if token not in top:
            rank = next((r + 1 for r, t in enumerate(s.top_ids[i]) if t == token), None)
            top = {token: Logprob(max(float(s.logprob[i]), MIN_LOGPROB), rank=rank), **top}
        return top

