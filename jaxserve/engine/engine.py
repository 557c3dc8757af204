"""The engine: requests in, tokens out, one `step()` at a time.

Each step: the scheduler picks tokens, the builder lays them out as a bucket-padded
ragged batch, the runner dispatches the jitted step, and the host appends the sampled
tokens and checks the token-level stops (EOS, stop ids, length, grammars). With
`detokenize` (the default) it also turns them into text and checks stop strings; the
servers turn that off and do it on a thread of their own (output_text.py either way).
Speculative decoding sits behind `self.speculator` (speculative/), a no-op when off.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import compile_cache
from jaxserve.engine.batch import BatchBuilder, BucketKey, StepBatch
from jaxserve.engine.host_kv_cache import HostKVCache
from jaxserve.engine.kv_memory import pages_per_seq, pool_pages
from jaxserve.engine.kv_transfer import KVPages, Prefilled, model_digest
from jaxserve.engine.loader import Vision, load
from jaxserve.engine.lora import LoraManager, LoRARequest
from jaxserve.engine.multimodal.images import Images
from jaxserve.engine.multimodal.inputs import ImageInput
from jaxserve.engine.output_text import OutputText
from jaxserve.engine.page_allocator import salted_root
from jaxserve.engine.request import (PLACEHOLDER, Request, Sequence, check_params, check_priority,
                                     check_prompt)
from jaxserve.engine.runner import ModelRunner, fetch, fetch_scores
from jaxserve.engine.sampler import SampleOutput, prompt_token_logprobs, token_logprobs
from jaxserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from jaxserve.engine.speculative.setup import SpeculativeModels
from jaxserve.engine.status import EngineStatus
from jaxserve.engine.structured_output import GrammarCompiler, MaskFiller
from jaxserve.engine.token_filters import token_filter
from jaxserve.loading.digest import weights_digest
from jaxserve.loading.classifier import Classifier, read_classifier
from jaxserve.loading.pooling_config import (ModelPooling, read_hf_config, read_pooling,
                                             with_pooler_config)
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.models.layers import dense_impl, weights_for_native_matmul
from jaxserve.models.lora import abstract_stacks, stacks_bytes
from jaxserve.outputs import StepOutput
from jaxserve.pooling_params import EMBEDDING_PARAMS, PoolingParams, finish_embedding
from jaxserve.sampling_params import SamplingParams
from pallas_kernels.ragged_paged_attention import default_impl
from pallas_kernels.ragged_paged_attention.kv_cache import pool_dtype
from sharding.platforms import skip_absent_accelerators
from sharding.rules import ShardingContext

log = logging.getLogger(__name__)


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step: what it computes (each scheduled seq with its row in the
    outputs) and its sampled outputs, still on the device. A step sampled apart has
    `out` None between its forward pass and its sampling (`batch` and `key` wait for it)."""

    schedule: SchedulerOutput
    out: SampleOutput | None
    batch: StepBatch | None = None
    key: BucketKey | None = None
    steps: int = 1  # decode steps in its program (runner.dispatch_steps: `out` is [steps, R])
    expert_load: jax.Array | None = None  # ModelRunner.expert_load as this step leaves it
    speculation: Any = None  # the speculator's record of it (Speculator.dispatching)
    # Prompt logprobs (`Engine._score_targets`): the step's scores on the device, and for
    # each chunk scored its request, first position, first token in the batch and length.
    scores: Any = None
    scored: list = dataclasses.field(default_factory=list)
    # Embeddings (`Engine._pool_segments`): the step's pool segments' sums on the device,
    # and each chunk pooled its request, segment and whether it starts the prompt.
    pool_sums: Any = None
    pooled: list = dataclasses.field(default_factory=list)

    @functools.cached_property
    def sampling(self) -> list[ScheduledSeq]:
        """The scheduled seqs whose sample is real: each holds a PLACEHOLDER for it."""
        return [s for s in self.schedule.scheduled if s.samples]

    @functools.cached_property
    def pending(self) -> dict[Sequence, tuple[int, int]]:
        """Each sampling seq's first row in the outputs and its drafts (BatchBuilder.build;
        read by a proposer and the next step's batch alike)."""
        return {s.seq: (s.row, len(s.drafts.tokens)) for s in self.sampling}


def _is_ready(out: SampleOutput) -> bool:
    return all(x.is_ready() for x in jax.tree.leaves(out))


# The host KV tier's copies (Engine._move_host_pages): the most bytes one moves, and the
# most the copies out under way may hold before the engine waits for them to land.
HOST_COPY_BYTES = 128 * 2**20
HOST_PENDING_BYTES = 1 << 30


class Engine:
    """Continuous-batching engine over one model (see `Engine.from_config`)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, graphdef, params,
                 tokenizer: Tokenizer | None, shard: ShardingContext, broadcaster=None,
                 speculative: SpeculativeModels | None = None, vision: Vision | None = None):
        spec = speculative or SpeculativeModels()
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        # Turn tokens into text and check stop strings in step() (OutputText); whoever
        # turns this off does both itself, before adding requests.
        self.detokenize = True
        # With detokenize: hand each step's text back as it comes; False (the offline LLM,
        # which returns whole outputs) decodes a request without stop strings or logprobs
        # once, at its end.
        self.stream_text = True
        # A plain request's tokens (`Request.plain`) are handed out once this many are
        # new, and with the first it makes here and its last (the servers'
        # --stream-interval; the offline LLM, which returns whole outputs, holds them to
        # the end): fewer StepOutputs to make and to read. Other requests' tokens go out
        # in the step that makes them.
        self.stream_interval = 1
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        # The tokenizer's list gathers its own EOS, generation_config.json's and config.json's.
        eos = tokenizer.eos_token_ids if tokenizer is not None else model_config.eos_token_ids
        self.eos_token_ids = tuple(sorted(set(eos)))
        self.shard = shard
        self.broadcaster = broadcaster  # multi-host process 0's (broadcast.py)
        # Prefill/decode disaggregation (kv_transfer.py): this engine's side, or None.
        self.kv_transfer = config.kv_transfer_config
        # What this engine computes with (kv_transfer.model_digest; from_config sets it for
        # disaggregation): a decode engine refuses K/V another model computed.
        self.model_digest: str | None = None
        if self.kv_transfer is not None and broadcaster is not None:
            raise ValueError("prefill/decode disaggregation (kv_transfer_config) with "
                             "several hosts is not supported yet")
        kv_dtype = pool_dtype(config.kv_storage_dtype, config.kernel_impl or default_impl())
        # LoRA adapters (engine/lora.py): where they are, and their device stacks' shapes.
        self.loras, lora_stacks = None, None
        if config.enable_lora:
            if model_config.kv_lora_rank:
                raise ValueError("enable_lora: LoRA adapters on DeepSeek's latent attention "
                                 "are not supported yet")
            self.loras = LoraManager(model_config, config.max_loras, config.max_lora_rank,
                                     config.max_cpu_loras)
            lora_stacks = abstract_stacks(model_config, config.max_loras, config.max_lora_rank,
                                          jnp.dtype(config.dtype),
                                          shard.rules.kv_head_replicas)
        lora_bytes = stacks_bytes(lora_stacks)
        # A vision-language model's images (multimodal/; None: text only). Made before the
        # KV pool is sized, so the device memory left counts its tower and buffer.
        self.images = None
        if model_config.vision is not None:
            if vision is None:
                raise ValueError("a vision-language model needs its vision tower's weights")
            if spec.config is not None and spec.config.method not in ("ngram", "draft_model"):
                raise ValueError(f"{spec.config.method} speculative decoding with a "
                                 "vision-language model is not supported yet (n-gram and "
                                 "draft-model speculation are)")
            self.images = Images(model_config.vision, vision.params, vision.processor,
                                 config.mm_encoder_cache_tokens,
                                 (config.limit_mm_per_prompt or {}).get("image"),
                                 config.max_num_batched_tokens, config.dtype, shard.sharding(()),
                                 _token_text(tokenizer), broadcaster)
        num_pages = pool_pages(  # per data shard
            config, model_config, shard, self.max_model_len, kv_dtype,
            spec.page_bytes(model_config, config.page_size, kv_dtype, config.dtype),
            spec.reserved_bytes(config.max_num_seqs, model_config.vocab_size) + lora_bytes)
        self.num_pages = num_pages * shard.data_shards
        self.scheduler = Scheduler(SchedulerConfig.of_engine(
            config, self.max_model_len, num_pages, shard.data_shards), self.loras,
            self.images.cache if self.images is not None else None)
        spec.check(model_config)
        self.builder = BatchBuilder(
            token_buckets=config.token_buckets, max_num_seqs=config.max_num_seqs,
            page_size=config.page_size, num_pages=num_pages,
            pages_per_seq=pages_per_seq(self.max_model_len, config.page_size),
            max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
            vocab_size=model_config.vocab_size, data_shards=shard.data_shards,
            num_speculative_tokens=spec.num_drafts, tree=bool(spec.tree),
            sampled_drafts=spec.sampled_drafts,
            layout=spec.layout(config.max_num_seqs, config.async_scheduling),
            lora=self.loras is not None, images=self.images is not None,
            mrope=bool(model_config.mrope_section),
            whole_images=self.images is not None and self.images.whole)
        # Several decode steps per program: not with speculative decoding (its steps
        # verify drafts) nor on several hosts (the others follow single steps).
        decode_steps = (config.num_scheduler_steps
                        if spec.config is None and broadcaster is None else 1)
        self.runner = ModelRunner(graphdef, self._laid_out(params, shard), shard, self.builder,
                                  model_config, kv_dtype, broadcaster, spec.medusa,
                                  spec.features_from, decode_steps, lora_stacks,
                                  self.images.encoder if self.images is not None else None)
        # The prefix cache's second tier in host memory (host_kv_cache.py), or None.
        self.host_kv = self._host_tier(spec, broadcaster)
        self.speculator = spec.speculator(config, self.runner, self.scheduler,
                                          self.max_model_len, self.running_requests,
                                          self._laid_out)
        self.grammars = (GrammarCompiler(tokenizer, model_config.vocab_size, self.eos_token_ids)
                         if tokenizer is not None else None)
        self.masks = MaskFiller()
        self._requests: dict[str, Request] = {}
        self._num_sampled_apart = 0  # requests whose params.needs_history
        self._num_logprobs = 0  # requests that ask for logprobs (else a step's ids alone)
        self._num_scoring = 0  # requests whose prompt logprobs are not handed out yet
        self._num_pooling = 0  # embedding requests not handed out yet
        # How the checkpoint pools an embedding, and its classification head (from_config
        # reads them; loading/pooling_config.py, loading/classifier.py).
        self.pooling = ModelPooling()
        self.classifier: Classifier | None = None
        self._failed: list[StepOutput] = []  # requests the scheduler could not admit
        self._num_prefilled = 0  # requests whose moved K/V wait to be written (`_write_kv`)
        self._num_remote_decode = 0  # requests whose pages are read out (`_read_kv`)
        self._rng = random.Random(config.seed)
        self._inflight: InFlightStep | None = None
        self._expert_load = self.runner.expert_load  # as of the last collected step
        self.num_steps = 0  # steps dispatched
        self.num_overlapped_steps = 0  # dispatched while the step before was still running
        self.num_multi_steps = 0  # decode steps run in programs of several (_decode_steps)

    def _host_tier(self, spec: SpeculativeModels, broadcaster) -> HostKVCache | None:
        """`kv_offloading_size` GiB of host memory for the pages the prefix cache evicts,
        given to every data shard's allocator (content-addressed: one shard may load what
        another evicted)."""
        size = self.config.kv_offloading_size
        if size is None:
            return None
        if broadcaster is not None:
            raise ValueError("kv_offloading_size with several hosts is not supported yet")
        if spec.config is not None and spec.config.method not in ("ngram", "medusa"):
            raise ValueError(f"kv_offloading_size with {spec.config.method} speculative "
                             "decoding is not supported yet: its model's K/V shares the "
                             "target's pages (n-gram and Medusa speculation work with it)")
        shapes, dtypes = zip(*self.runner.page_layout())
        page_bytes = HostKVCache.page_bytes(shapes, dtypes)
        capacity = int(size * 2**30 // page_bytes)
        if capacity < 1:
            raise ValueError(f"kv_offloading_size {size} GiB holds no KV page of this model "
                             f"({page_bytes / 2**20:.1f} MiB each)")
        host = HostKVCache(capacity, list(shapes), list(dtypes))
        for allocator in self.scheduler.allocators:
            allocator.host = host
        # Pages a copy moves at most: the largest of PageMover's counts within
        # HOST_COPY_BYTES (each copy's pages are device memory while it is under way).
        buckets = self.runner.pages.buckets
        self._host_chunk = max([b for b in buckets if b * page_bytes <= HOST_COPY_BYTES]
                               or buckets[:1])
        return host

    def _laid_out(self, params, shard: ShardingContext):
        """The parameters as the matmuls read them fastest: on one CPU device running the
        native matmul, the float weights laid out `[N, K]` (in place)."""
        if shard.mesh.size == 1 and dense_impl(self.config.model_options) == "cpu":
            return weights_for_native_matmul(params)
        return params

    @classmethod
    def from_config(cls, config: EngineConfig, random_weights_preset: str | None = None,
                    broadcaster=None) -> "Engine":
        """Load the checkpoint directory `config.model` (the demo model when None), or with
        `random_weights_preset` (a YAML model preset) random weights and no tokenizer, for
        benchmarks (loader.py). `broadcaster`: multi-host process 0's StepBroadcaster."""
        compile_cache.enable(config.compilation_cache_dir)  # before anything compiles
        skip_absent_accelerators()  # before JAX starts its platforms
        m = load(config, random_weights_preset)
        engine = cls(m.config, m.model_config, m.graphdef, m.params, m.tokenizer, m.shard,
                     broadcaster, m.speculative, m.vision)
        if config.kv_transfer_config is not None:
            weights = (f"random weights of {random_weights_preset}, seed {config.seed}"
                       if random_weights_preset is not None else weights_digest(m.config.model))
            engine.model_digest = model_digest(m.config, m.model_config, weights)
        if random_weights_preset is None:
            hf = {**read_hf_config(m.config.model), **(config.hf_overrides or {})}
            engine.pooling, engine.classifier = with_pooler_config(
                read_pooling(m.config.model, hf),
                read_classifier(m.config.model, hf, m.tokenizer), config.pooler_config)
            if engine.pooling.dimensions is not None:  # a default fit for every request
                PoolingParams(engine.pooling.dimensions).check(
                    engine.model_config.hidden_size, engine.pooling.matryoshka)
        return engine

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None,
                    images: list | None = None, remote_decode: bool = False,
                    prefilled: Prefilled | None = None,
                    cache_salt: str | None = None,
                    pooling: PoolingParams | None = None) -> list[int]:
        """Queue a request (with `lora_request`: under that LoRA adapter; with `images`,
        PIL images, image file bytes or `prepare_images`' outputs, one per placeholder
        in the prompt); returns its prompt token ids, each image's placeholder standing
        for its tokens. Bad input raises ValueError. `priority` (lower first) needs
        scheduling_policy "priority". `cache_salt` (vLLM's): its prompt's K/V pages are
        shared through the prefix cache only with requests of the same salt, so a tenant
        cannot learn another's prompts from how fast its own come back.

        Prefill/decode disaggregation (kv_transfer_config): `remote_decode` (a producer)
        computes the prompt and samples the first token only; unless that token ends the
        request, its last output carries the prompt's K/V (`StepOutput.kv_pages`) for a
        decode engine, which takes them as `prefilled` (a consumer) with that token and
        the request's params (its seed too), and decodes on from the second token.

        `pooling` (an embedding or a classification; `params` are not used): the prompt's
        final hidden states (after the last norm) pooled (an embedding's as the checkpoint
        says, `self.pooling`: its last token's by default; a classification's last token's
        through `self.classifier`), finished as PoolingParams says, come back in its only
        output (`StepOutput.pooled`)."""
        params = params or SamplingParams()
        if pooling is None and self.classifier is not None and not self.classifier.generates:
            raise ValueError(f"model: {self.model_config.architecture} is a sequence "
                             "classifier: it has no LM head to generate with; it serves "
                             "classify, score and rerank requests (and embeddings)")
        if pooling is not None:
            if self.pooling.unsupported is not None and pooling.task == "embed":
                raise ValueError(f"embeddings: {self.pooling.unsupported}")
            if pooling.task == "embed" and pooling.dimensions is None:
                pooling = dataclasses.replace(pooling, dimensions=self.pooling.dimensions)
            pooling.check(self.model_config.hidden_size, self.pooling.matryoshka,
                          self.classifier is not None)
            if remote_decode or prefilled is not None:
                raise ValueError("an embedding request is computed on one engine: not with "
                                 "prefill/decode disaggregation")
            params = EMBEDDING_PARAMS
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        check_priority(priority, self.scheduler.config.policy)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: must be a non-empty string")
        if lora_request is not None:
            self.add_lora(lora_request)
        check_params(params, self.model_config.vocab_size, self.tokenizer is not None)
        if images and isinstance(prompt, str):  # Gemma 3: its image markers written out
            prompt = self._images().preparer.expand_text(prompt)
        token_ids = self._prompt_ids(prompt)
        spans, rope = [], (None, 0)
        if images:
            token_ids, spans, *rope = self._images().place(token_ids,
                                                           self.prepare_images(images))
            token_ids = check_prompt(token_ids, self.model_config.vocab_size,
                                     self.max_model_len)
        if remote_decode or prefilled is not None:
            self._check_kv_role(remote_decode, prefilled, token_ids, lora_request, spans)
        if prefilled is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs the prompt computed here; this request's "
                             "K/V were prefilled elsewhere")
        room = self.max_model_len - len(token_ids)
        if pooling is not None and room < 1:
            raise ValueError(f"prompt ({len(token_ids)} tokens): an embedding's input may "
                             f"have at most {self.max_model_len - 1} tokens (max_model_len "
                             f"{self.max_model_len} less one)")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len}); lower max_tokens to at most {room}")
        if params.seed is None:  # every request samples from its own reproducible stream
            params = dataclasses.replace(params, seed=self._rng.randrange(2**32))
        grammar = (self.grammars.matcher(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        filters = token_filter(params, self.tokenizer, self.model_config.vocab_size)
        limit = min(params.max_tokens or room, room)
        # A prefill engine's request stops after its first token (the decode goes on
        # elsewhere), unless it has only one.
        remote_decode = remote_decode and limit > 1
        seq = Sequence(request_id, token_ids, params=params, priority=priority,
                       max_output_tokens=1 if remote_decode else limit,
                       remote_decode=remote_decode)
        if prefilled is not None:
            if limit <= 1:
                raise ValueError("a prefilled request needs max_tokens > 1: its first token "
                                 "is already made")
            if grammar is not None and not grammar.consume_token(prefilled.first_token):
                raise ValueError(f"prefilled first token {prefilled.first_token} breaks the "
                                 f"request's grammar: {grammar.get_error()}")
            seq.output_token_ids = [prefilled.first_token]
            seq.prefilled = self.runner.pages.placed(prefilled.kv)  # the copy starts here
            self._num_prefilled += 1
        if lora_request is not None:
            seq.lora, seq.cache_root = lora_request, lora_request.cache_root
        if cache_salt is not None:
            seq.cache_root = salted_root(seq.cache_root, cache_salt)
        seq.images = spans
        seq.whole_prompt = pooling is not None and self._pool_kind(pooling) != "last"
        seq.rope_offsets, seq.rope_delta = rope
        seq.whole_images = bool(spans) and self.images.whole
        text = (OutputText(self.tokenizer, token_ids, params, self.eos_token_ids,
                           self.stream_text)
                if self.detokenize and self.tokenizer is not None and pooling is None
                else None)
        if text is not None and prefilled is not None:
            text.skip([prefilled.first_token])  # its text came from the prefill engine
        self._requests[request_id] = Request(
            seq, frozenset(params.stop_token_ids) | frozenset(
                () if params.ignore_eos else self.eos_token_ids), text, grammar, filter=filters,
            pooling=pooling)
        self._num_pooling += pooling is not None
        self._num_sampled_apart += params.needs_history
        self._num_logprobs += params.logprobs is not None
        self._num_scoring += params.prompt_logprobs is not None
        self._num_remote_decode += remote_decode
        self.scheduler.add(seq)
        return token_ids

    def _check_kv_role(self, remote_decode: bool, prefilled: Prefilled | None,
                       token_ids: list[int], lora_request: LoRARequest | None,
                       spans: list) -> None:
        """ValueError unless this engine takes the request's side of disaggregation and
        its moved K/V fit (kv_transfer.py): this model and adapter computed them from this
        prompt and these images, and they fit this engine's cache."""
        role = self.kv_transfer
        if remote_decode and prefilled is not None:
            raise ValueError("a request is either prefilled here for a remote decode "
                             "(remote_decode) or decoded here (prefilled), not both")
        if role is None or (remote_decode and not role.produces) or (
                prefilled is not None and not role.consumes):
            want = "kv_producer" if remote_decode else "kv_consumer"
            raise ValueError(f"this engine is not a {want}: start it with "
                             f"kv_transfer_config {{\"kv_role\": \"{want}\"}} (or kv_both)")
        if prefilled is not None:
            if prefilled.model is not None and prefilled.model != self.model_digest:
                raise ValueError(
                    f"the K/V were computed by another model (digest {prefilled.model}; "
                    f"this engine's is {self.model_digest}): the prefill and decode servers "
                    "must load the same checkpoint with the same dtype, quantization and "
                    "max_model_len")
            lora = lora_request.lora_name if lora_request is not None else None
            if prefilled.lora != lora:
                raise ValueError(f"the K/V were computed under adapter {prefilled.lora!r}, "
                                 f"this request names {lora!r}: send the decode server the "
                                 "same request")
            for what, theirs, ours in (
                    ("prompt's token ids", prefilled.token_ids, token_ids),
                    ("images", prefilled.images, [s.image.hash.hex() for s in spans])):
                if theirs is not None and theirs != ours:
                    raise ValueError(f"the {what} differ from those the prefill engine "
                                     "computed the K/V from; send the decode server the "
                                     "same request")
            self.runner.pages.check(prefilled.kv, self.runner.kv_caches)
            if prefilled.kv.num_tokens != len(token_ids):
                raise ValueError(f"prefilled K/V holds {prefilled.kv.num_tokens} tokens, the "
                                 f"prompt has {len(token_ids)}")
            first = prefilled.first_token
            if not isinstance(first, int) or not 0 <= first < self.model_config.vocab_size:
                raise ValueError(f"prefilled first token {first!r} is outside the vocabulary "
                                 f"[0, {self.model_config.vocab_size})")

    def prepare_images(self, images: list, names: list[str] | None = None
                       ) -> list[ImageInput]:
        """A request's images decoded, checked and processed for the vision tower
        (ValueError naming a bad one, by `names`: where each came from); touches no engine
        state, so any thread may call it (a server prepares images off the engine's
        thread)."""
        if not isinstance(images, (list, tuple)):
            images = [images]
        return self._images().prepare(images, names)

    def _images(self) -> Images:
        if self.images is None:
            raise ValueError("this model takes no images (it is not a vision-language "
                             "model)")
        return self.images

    def add_lora(self, lora_request: LoRARequest, adapter=None) -> None:
        """Read an adapter into host memory (checked against the model; ValueError), or
        find it there; `adapter`: already read (`read_lora`, on another thread)."""
        loras = self._lora_manager()
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        loras.register(lora_request, adapter)

    def read_lora(self, lora_request: LoRARequest):
        """An adapter read from disk and checked (loading/peft.py's Adapter; ValueError),
        for `add_lora`; touches no engine state, so any thread may call it."""
        return self._lora_manager().read(lora_request)

    def _lora_manager(self) -> LoraManager:
        if self.loras is None:
            raise ValueError("LoRA adapters are not enabled: start the engine with "
                             "enable_lora=True (jaxserve serve --enable-lora)")
        return self.loras

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter (requests running under it finish); False if unknown."""
        return self.loras is not None and self.loras.unregister(name)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (a text prompt tokenized), checked to be non-empty, in the
        vocabulary and within max_model_len (ValueError)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            prompt = self.tokenizer.encode(prompt)
        return check_prompt(prompt, self.model_config.vocab_size, self.max_model_len)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its pages; False if it is unknown or already done."""
        req = self._pop(request_id)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def held_tokens(self, request_id: str) -> list[int]:
        """A running request's tokens held back by `stream_interval` (in no output yet):
        whoever aborts it and answers its caller sends them."""
        req = self._requests.get(request_id)
        return req.unreported() if req is not None else []

    def _pop(self, request_id: str) -> Request | None:
        """Forget a request (finished, aborted or failed); None if unknown."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._num_sampled_apart -= req.seq.params.needs_history
            self._num_logprobs -= req.seq.params.logprobs is not None
            self._num_scoring -= req.prompt_scores is not None
            self._num_pooling -= req.pooling is not None
            self._num_remote_decode -= req.seq.remote_decode
            if req.seq.prefilled is not None:  # its moved K/V never written
                req.seq.prefilled = None
                self._num_prefilled -= 1
        return req

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_prefilled_waiting(self) -> int:
        """Requests added prefilled whose moved K/V are not in pages yet."""
        return self._num_prefilled

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.shard.mesh

    def status(self) -> EngineStatus:
        """The engine's counters now; any thread may call it."""
        sched, stats = self.scheduler, self.speculator.stats
        return EngineStatus(
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_used_pages=sched.num_used_pages, num_pages=sched.num_pages,
            prefix_queries=sched.prefix_queries, prefix_hits=sched.prefix_hits,
            **self._host_status(),
            num_preemptions=sched.num_preemptions, num_steps=self.num_steps,
            num_overlapped_steps=self.num_overlapped_steps,
            steps_in_flight=int(self._inflight is not None),
            speculation=stats.snapshot() if stats is not None else None,
            lora_running=self.loras.running() if self.loras is not None else None,
            images=self.images.stats() if self.images is not None else None)

    def _host_status(self) -> dict[str, int]:
        host = self.host_kv
        if host is None:
            return {}
        return dict(host_capacity=host.capacity, host_pages=host.num_pages,
                    pages_offloaded=host.pages_stored, host_hits=self.scheduler.host_hits)

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
        if self.kv_transfer is not None or self.host_kv is not None:  # pages moved
            self.runner.kv_caches = self.runner.pages.warmup(self.runner.kv_caches)
        self.speculator.warmup(progress)
        if self.images is not None:
            self.images.warmup()

    def wait_for_device(self) -> None:
        """Wait until the step in flight (if any) has its outputs, changing nothing: the
        next `step()` then spends only host time. Another thread may call it while no
        `step()` runs (DisaggregatedEngine waits so, outside its lock)."""
        inflight = self._inflight
        if inflight is not None and inflight.out is not None:
            jax.block_until_ready(inflight.out)

    def step(self) -> list[StepOutput]:
        """Run one step; return the requests that produced tokens or finished.

        With async scheduling: dispatch step N, then collect step N-1 while the device
        runs N, so a step's tokens come back from the next call (N reads them on the
        device); the speculator may need a step collected sooner. Without it, each step
        is collected before the call returns. docs/engine.md has the whole story.
        """
        prev, self._inflight = self._inflight, None
        outputs = []
        self.speculator.begin_step()
        if prev is not None and (not self.config.async_scheduling
                                 or self.speculator.collects_first(prev.speculation)):
            outputs, prev = self._collect(prev), None
        step = self._dispatch(prev)
        outputs += self._failed
        self._failed = []
        if prev is not None:
            outputs += self._collect(prev, later=step)
        if step is None:
            return outputs
        if step.out is None:
            self._dispatch_sample(step)
        if self.speculator.holds_back(step.speculation):
            # Collected first: its pages join the prefix cache once its tokens are known.
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
        self._inflight = None
        message = f"{type(error).__name__}: {error}"
        outputs = []
        for seq in list(self.scheduler.running):
            req = self._pop(seq.request_id)
            self.scheduler.abort(seq.request_id)
            if req is not None:
                out = StepOutput(seq.request_id, req.unreported(), "", None, True, "error",
                                 num_prompt_tokens=seq.num_prompt_tokens,
                                 num_cached_tokens=seq.num_cached_tokens, error=message)
                if req.text is not None and req.text.deferred:  # the text so far
                    req.text.apply_whole(out, seq.output_token_ids[:seq.num_known_outputs])
                outputs.append(out)
        self.speculator.recover()
        if self.images is not None:
            self.images.recover()
        if self.runner.recover():
            for allocator in self.scheduler.allocators:
                allocator.reset_prefix_cache()
            if self.host_kv is not None:  # (its copies under way read the lost cache)
                self.host_kv.clear()
        return outputs

    def running_requests(self) -> list[Request]:
        """The running sequences' requests (not those finished or aborted meanwhile)."""
        return [req for seq in self.scheduler.running
                if (req := self._requests.get(seq.request_id)) is not None]

    def _decode_steps(self) -> int:
        """How many decode steps the next program runs (`num_scheduler_steps` at most;
        1 unless the runner has a program for more). Several only while every running
        sequence decodes (no prompt to compute, none waiting for a seat: a new request's
        prefill goes first), samples without its token history on the host (no
        grammar, penalties, or stop tokens banned until min_tokens), and has room for
        them all (max_tokens, max_model_len): the steps' tokens then come back together,
        and a sequence that stops early has computed (and discards) the rest. Where the
        runner is `branch_free` (a GPU), all of them or 1, and 1 when a request's
        sampling needs more than the program's `FAST` (top-k, top-p, logprobs)."""
        most = steps = self.runner.decode_steps
        if steps == 1 or self.scheduler.prefills_next:
            return 1
        branch_free = self.runner.branch_free
        for req in self.running_requests():
            if req.samples_from_host or (branch_free and req.seq.params.samples_full):
                return 1
            seq = req.seq
            left = min(req.max_tokens - len(seq.output_token_ids),
                       self.max_model_len - seq.num_tokens)
            if left > 0:  # else the steps in flight end it: not scheduled
                steps = min(steps, left)
        return 1 if branch_free and steps < most else steps

    def _dispatch(self, prev: InFlightStep | None) -> InFlightStep | None:
        """Schedule the next step, build its batch and start it (only its forward pass
        when it is sampled apart); None if nothing to run. Its sampling seqs get a
        PLACEHOLDER for each token it may emit."""
        pending = prev.pending if prev is not None else None
        drafts = self.speculator.propose(pending)
        steps = self._decode_steps()
        schedule = self.scheduler.schedule(steps, drafts)
        if self.host_kv is not None:
            self._move_host_pages()
        for seq, message in schedule.failed:  # each fails alone (finished, pages freed)
            if (req := self._pop(seq.request_id)) is not None:
                self._failed.append(StepOutput(
                    seq.request_id, req.unreported(), "", None, True, "error",
                    num_prompt_tokens=seq.num_prompt_tokens, error=message))
        if schedule.is_empty:
            return None
        if self._num_prefilled:
            self._write_kv(schedule)
        if self.loras is not None:  # adapters given slots for this step
            for slot, adapter in self.loras.take_uploads():
                self.runner.load_lora(slot, adapter)
        if self.images is not None:  # images given rows for this step
            self.images.upload()
        batch, key = self.builder.build(schedule, pending)
        if self.images is not None:
            self.images.done(schedule.scheduled)
        speculation = self.speculator.dispatching(schedule, batch)
        if prev is not None:
            self.num_overlapped_steps += not _is_ready(prev.out)
        step = InFlightStep(schedule, None, batch, key, steps=steps)
        targets = self._score_targets(step, key) if self._num_scoring else None
        segments = self._pool_segments(step, key) if self._num_pooling else None
        if steps > 1:
            step.out = self.runner.dispatch_steps(batch, key, steps)
            self.num_multi_steps += steps
        elif targets is not None or segments is not None:  # sampled next (`_dispatch_sample`)
            step.scores, step.pool_sums = self.runner.dispatch_forward(batch, key, targets,
                                                                       segments)
        elif self._num_sampled_apart and any(s.seq.params.needs_history
                                             for s in step.sampling):
            self.runner.dispatch_forward(batch, key)
        else:
            step.out = self.runner.dispatch(batch, key)
        self.speculator.dispatched(speculation, overlapped=prev is not None)
        step.expert_load, step.speculation = self.runner.expert_load, speculation
        self.num_steps += 1
        for s in step.sampling:  # as many as the step can emit (`_append` keeps those it does)
            s.seq.output_token_ids.extend([PLACEHOLDER] * s.width)
        if self._num_remote_decode:  # their prompts computed: read their pages out
            for s in step.sampling:
                if s.seq.remote_decode:
                    self._read_kv(s.seq)
        return step

    def _score_targets(self, step: InFlightStep, key: BucketKey) -> np.ndarray | None:
        """The step's tokens' targets for prompt logprobs (`ModelRunner.dispatch_forward`):
        at each prompt token of a seq whose prompt is still to be scored, the prompt's next
        token (the last prompt token has none: its next is the first output); None when no
        chunk of the step has such a token."""
        targets = None
        for s in step.schedule.scheduled:
            req = self._requests.get(s.seq.request_id)
            num_prompt = s.seq.num_prompt_tokens
            end = min(s.start + s.num_new_tokens, num_prompt - 1)
            if req is None or req.prompt_scores is None or s.start >= end:
                continue
            if targets is None:
                targets = np.zeros(key.tokens, np.int32)
            targets[s.token:s.token + end - s.start] = \
                s.seq.prompt_token_ids[s.start + 1:end + 1]
            step.scored.append((req, s.start, s.token, end - s.start))
        return targets

    def _pool_segments(self, step: InFlightStep, key: BucketKey) -> np.ndarray | None:
        """The step's tokens' pool segments (`ModelRunner.dispatch_forward`): a segment for
        each chunk of a pooling request's prompt the step computes, holding the tokens
        its pooling reads there (the last prompt token, the first, or all: `self.pooling`),
        the rest -1; None when no chunk has such a token. `step.pooled` lists them."""
        segments = None
        for s in step.schedule.scheduled:
            req = self._requests.get(s.seq.request_id)
            if req is None or req.pooling is None:
                continue
            kind = self._pool_kind(req.pooling)
            end = s.start + s.num_new_tokens  # (an embedding request computes its prompt)
            first, last = ((s.start, end) if kind == "mean" else (0, 1) if kind == "cls"
                           else (s.seq.num_prompt_tokens - 1, s.seq.num_prompt_tokens))
            first, last = max(first, s.start), min(last, end)
            if first >= last:
                continue
            if segments is None:
                segments = np.full(key.tokens, -1, np.int32)
            segment = len(step.pooled)
            segments[s.token + first - s.start:s.token + last - s.start] = segment
            step.pooled.append((req, segment, s.start == 0))
        return segments

    def _pool_kind(self, pooling: PoolingParams) -> str:
        """Which of a prompt's tokens a pooling request reads: a classification its last,
        an embedding as the checkpoint pools (loading/pooling_config.POOLED)."""
        return "last" if pooling.task == "classify" else self.pooling.kind

    def _move_host_pages(self) -> None:
        """Copy out the cached pages the schedule recycles and copy in the host tier's
        pages it gave prompts (page_allocator.py), before the step that writes or reads
        them. Reads of the device's pages go first (a recycled page may be a copy's
        destination); a page recycled and found again in the same schedule is written
        from its read; the host's pages are taken before the read ones are stored (which
        may recycle their slots)."""
        host, most, size = self.host_kv, self._host_chunk, self.config.page_size
        host.land(wait=False)  # the copies out done since
        reads, fresh = [], {}  # fresh: hash -> (its read, its page there)
        for d, allocator in enumerate(self.scheduler.allocators):
            out, allocator.offloads = allocator.offloads, []
            for i in range(0, len(out), most):
                chunk = out[i:i + most]
                kv = self.runner.read_pages(d, [p for p, _ in chunk], len(chunk) * size)
                for x in kv.entries:
                    x.copy_to_host_async()
                fresh.update((h, (len(reads), j)) for j, (_, h) in enumerate(chunk))
                reads.append(([h for _, h in chunk], kv))
        for d, allocator in enumerate(self.scheduler.allocators):
            loads, allocator.loads = allocator.loads, []
            from_reads: dict[int, list[int | None]] = {}  # read -> page_ids to write
            stored = []
            for page, h in loads:
                if h in fresh:
                    r, j = fresh[h]
                    from_reads.setdefault(r, [None] * len(reads[r][0]))[j] = page
                else:
                    stored.append((page, h))
            for i in range(0, len(stored), most):
                chunk = stored[i:i + most]
                entries = host.take([h for _, h in chunk])
                kv = self.runner.pages.placed(KVPages(tuple(entries), len(chunk) * size))
                self.runner.write_pages(kv, d, [p for p, _ in chunk])
            for r, page_ids in from_reads.items():
                self.runner.write_pages(self.runner.pages.placed(reads[r][1]), d, page_ids)
        for hashes, kv in reads:
            host.store(hashes, kv.entries)
        if host.pending_bytes > HOST_PENDING_BYTES:  # a burst: bound the device memory held
            host.land()

    def _write_kv(self, schedule: SchedulerOutput) -> None:
        """Write the moved K/V of the seqs admitted prefilled into their pages, before
        the step that reads them (pages this engine's prefix cache had are left)."""
        size = self.config.page_size
        for s in schedule.scheduled:
            seq = s.seq
            if seq.prefilled is not None:
                kv, seq.prefilled = seq.prefilled, None
                self._num_prefilled -= 1
                cached, n = seq.num_cached_tokens // size, -(-kv.num_tokens // size)
                self.runner.write_pages(kv, seq.data_shard,
                                        [None] * cached + seq.page_ids[cached:n])

    def _read_kv(self, seq: Sequence) -> None:
        """Start reading a remote_decode seq's prompt pages out, as the step computing its
        last chunk is dispatched (`_append` hands them out with its first token)."""
        n = -(-seq.num_prompt_tokens // self.config.page_size)
        req = self._requests[seq.request_id]
        req.kv_pages = self.runner.read_pages(seq.data_shard, seq.page_ids[:n],
                                              seq.num_prompt_tokens)

    def _dispatch_sample(self, step: InFlightStep) -> None:
        """Sample a step sampled apart, now that every token before it is on the host:
        fill its histories (penalties) and its masks (grammars, token filters), then
        start the sampling."""
        batch, key = step.batch, step.key
        if key.history:
            self.speculator.read_back(step.speculation)
            self.builder.fill_history(batch, step.schedule)
        masked = [(req, s.row) for s in step.sampling
                  if (req := self._requests.get(s.seq.request_id)) is not None
                  and req.seq is s.seq and req.masks_tokens]
        if masked:
            grammars = [(req.grammar, row) for req, row in masked if req.grammar is not None]
            mask = (self.masks.fill(grammars, key.rows, self.model_config.vocab_size)
                    if grammars else self.builder.open_mask(key.rows).copy())
            for req, row in masked:
                if req.filter is not None:
                    seq = req.seq
                    req.filter.restrict(mask[row], seq.output_token_ids[:seq.num_known_outputs])
            batch.sampling.grammar_mask = mask
        step.out = self.runner.dispatch_sample(batch, key)
        step.batch = None

    def _collect(self, step: InFlightStep, later: InFlightStep | None = None
                 ) -> list[StepOutput]:
        """Wait for a dispatched step; hand its tokens to the requests still running.
        `later`: the step dispatched after it, in flight (its seqs' counts follow this
        step's)."""
        sampled = fetch(step.out, self._num_logprobs > 0)
        if step.scores is not None:
            self._take_scores(step)
        if step.pooled:
            sums = jax.device_get(step.pool_sums)  # one explicit transfer, after the samples
            for req, segment, starts in step.pooled:  # (a recomputed prompt starts over)
                req.pooled = sums[segment] if starts or req.pooled is None \
                    else req.pooled + sums[segment]
        stride = 0
        if step.steps > 1:  # [steps, R]: the token of seq row r's step i at i x R + r
            stride = sampled.token_ids.shape[1]
            sampled = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), sampled)
        self.speculator.read_back(step.speculation)
        if step.expert_load is not None:
            self._expert_load = step.expert_load  # computed: reading it will not wait
        outputs, requests = [], self._requests
        # Only speculation reads a seq's place in the step in flight (Speculator.commit).
        following = ({s.seq: s for s in later.schedule.scheduled}
                     if later is not None and step.speculation is not None else {})
        token_ids = sampled.token_ids.tolist()  # one copy to Python ints for all rows
        plain = not stride and step.speculation is None  # one row a seq, no drafts
        interval = self.stream_interval
        for s in step.sampling:
            seq = s.seq
            req = requests.get(seq.request_id)
            if req is None or req.seq is not seq:  # aborted or finished meanwhile
                continue
            if plain and req.plain:
                # Most tokens of most requests: one token that does not end it, and
                # nothing else to look at (what `_append` and check_stop come to then;
                # max_output_tokens leaves the prompt room within max_model_len).
                token, outs = token_ids[s.row], seq.output_token_ids
                index = seq.num_known_outputs
                if token not in req.stop_ids and index + 1 < seq.max_output_tokens:
                    outs[index] = token
                    reported = req.num_reported
                    if index > req.num_brought and index - reported + 1 < interval:
                        continue  # held back (stream_interval); its first goes at once
                    req.num_reported = index + 1
                    outputs.append(StepOutput(
                        seq.request_id, outs[reported:index + 1], "", None, False, None,
                        None, len(seq.prompt_token_ids), seq.num_cached_tokens,
                        seq.first_scheduled_at))
                    continue
            rows = (self.speculator.accepted_rows(s, sampled.token_ids) if s.drafts.tokens
                    else range(s.row, s.row + s.steps * stride, stride) if stride
                    else (s.row,))
            outputs.append(self._append(req, sampled, token_ids, s, rows,
                                        following.get(seq), step.speculation))
        self.speculator.collected()
        return outputs

    def _take_scores(self, step: InFlightStep) -> None:
        """Put a step's prompt scores in their requests' `prompt_scores` (`Request`)."""
        scores = fetch_scores(step.scores)
        for req, start, first, n in step.scored:
            rows = slice(first, first + n)
            req.prompt_scores[start + 1:start + 1 + n] = zip(
                scores.logprob[rows].tolist(), scores.rank[rows].tolist(),
                scores.top_ids[rows].tolist(), scores.top_logprobs[rows].tolist())

    def _append(self, req: Request, sampled: SampleOutput, token_ids: list[int],
                s: ScheduledSeq, rows: tuple[int, ...] | range | list[int],
                later: ScheduledSeq | None, speculation) -> StepOutput:
        """Put the samples of `rows` (`s`'s tokens of the step, `token_ids` all the step's
        samples) in the seq's first PLACEHOLDERs, up to the first that ends the request (a
        stop string included); the speculator then drops the PLACEHOLDERs left (drafts
        rejected). `later`: `s`'s seq in the step dispatched after this one, in flight."""
        seq, params = req.seq, req.seq.params
        out_index = seq.num_known_outputs  # this step's first
        finish = stop_reason = error = None
        outputs = seq.output_token_ids
        tokens = req.unreported()  # those held back (stream_interval)
        logprobs = [] if params.logprobs is not None else None
        for index, i in enumerate(rows, out_index):
            token = token_ids[i]
            assert outputs[index] == PLACEHOLDER
            outputs[index] = token
            tokens.append(token)
            if logprobs is not None:
                logprobs.append(token_logprobs(sampled, i, token, params.logprobs))
            finish, stop_reason, error = req.check_stop(token, index + 1, self.eos_token_ids,
                                                        self.max_model_len)
            if finish is not None:
                break
        req.num_reported += len(tokens)
        out = StepOutput(
            request_id=seq.request_id, new_token_ids=tokens, new_text="",
            new_logprobs=logprobs, finished=finish is not None, finish_reason=finish,
            stop_reason=stop_reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, first_scheduled_at=seq.first_scheduled_at,
            error=error)
        if req.prompt_scores is not None:  # its first output
            out.prompt_logprobs = [None] + [
                prompt_token_logprobs(score, token, params.prompt_logprobs)
                for score, token in zip(req.prompt_scores[1:], seq.prompt_token_ids[1:])]
            req.prompt_scores = None
            self._num_scoring -= 1
        if req.pooling is not None:  # its only output: the pooled vector (its token discarded)
            kind = self._pool_kind(req.pooling)
            pooled = req.pooled / (seq.num_prompt_tokens if kind == "mean" else 1)
            out.pooled = (self.classifier.classify(pooled, req.pooling.use_activation)
                          if req.pooling.task == "classify" else
                          finish_embedding(pooled, req.pooling, self.pooling.normalize))
            out.new_token_ids, out.finish_reason, out.stop_reason = [], "stop", None
        text = req.text
        if out.finished and seq.remote_decode and out.finish_reason == "length":
            out.kv_pages = req.kv_pages  # decoded elsewhere, its text goes on there
            if text is not None and text.apply_unfinished(out):  # a stop string after all
                out.kv_pages = None
        elif text is not None and not text.deferred:
            text.apply(out)
        elif text is not None and out.finished:
            text.apply_whole(out, outputs[:index + 1])
        if out.finished:
            self.scheduler.finish(seq, out.finish_reason)
            self._pop(seq.request_id)
        elif speculation is not None:
            self.speculator.commit(s, out_index, rows, later, speculation)
        return out


def _token_text(tokenizer: Tokenizer | None):
    """A token id's text (special tokens too), or None without a tokenizer."""
    if tokenizer is None:
        return None
    return lambda token: tokenizer.decode([token], skip_special_tokens=False)
