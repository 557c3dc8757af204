"""The device state a model's steps run on (parameters, KV cache, the carry, compiled
programs) and their dispatch: `ModelRunner` runs the programs of programs.py for one
bucket-padded batch at a time."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxserve.config import ModelConfig
from jaxserve.engine.batch import BatchBuilder, BucketKey, StepBatch
from jaxserve.engine.broadcast import FORWARD, SAMPLE, STEP
from jaxserve.engine.compile_cache import counting_hits
from jaxserve.engine.executable_cache import ExecutableCache, one_device
from jaxserve.engine.kv_memory import abstract_kv_cache
from jaxserve.engine.kv_transfer import KVPages, PageMover
from jaxserve.engine.packing import pack
from jaxserve.engine.programs import FEATURE_AXES, PromptScores, head_kinds, jit_programs
from jaxserve.engine.sampler import SampleOutput, asks_sort
from jaxserve.models.medusa import MedusaHeads
from jaxserve.models.transformer import KVCache
from sharding.rules import ShardingContext

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns params and KV cache on device; runs the step for one bucket-padded batch,
    whole (`dispatch`) or in two halves (`dispatch_forward`, then `dispatch_sample`)."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, shard: ShardingContext,
                 builder: BatchBuilder, cfg: ModelConfig, kv_dtype, broadcaster=None,
                 medusa: MedusaHeads | None = None, features_from: tuple[int, ...] = (),
                 decode_steps: int = 1, lora: list | None = None, images=None):
        self.graphdef = graphdef
        self.params = params
        self.param_leaves = jax.tree.leaves(params)
        self.shard = shard
        self.builder = builder
        # The tokens of the largest bucket a step of decodes alone takes (`fuses`).
        self._decode_tokens = builder.bucket(builder.max_num_seqs // builder.data_shards,
                                             False).tokens
        self.kv_dtype = kv_dtype
        # The programs' host inputs: packed in one transfer (packing.py), or as they are.
        self._pack = pack if packs_inputs() else _as_is
        self._abstract_kv = abstract_kv_cache(cfg, builder.num_pages * builder.data_shards,
                                              builder.page_size, kv_dtype, shard)
        self.kv_caches: KVCache = self.zeros(self._abstract_kv)
        # A request's pages read out and written in (prefill/decode disaggregation).
        self.pages = PageMover(shard, jax.tree.map(lambda x: x.sharding, self._abstract_kv),
                               cfg.num_layers, shard.rules.kv_head_replicas,
                               builder.num_pages, builder.pages_per_seq)
        # Decode steps a program may run (`dispatch_steps`; 1: one step per program).
        self.decode_steps = decode_steps
        # The sampling's branches settled by the host, not by lax.conds (`branch_free`).
        self.branch_free = branch_free()
        self._programs = jit_programs(graphdef, params,
                                      jax.tree.map(lambda x: x.sharding, self._abstract_kv),
                                      shard, builder.layout, builder.page_size, features_from,
                                      medusa, decode_steps, self.branch_free)
        # Programs compiled, by (program, shape): ("forward", T, S, R, tree, verifies),
        # ("sample", R, history, verifies, full), ("step", T, S, R, tree, verifies),
        # ("move",) (`programs`), ("steps", T, S, decode_steps) (`steps_program`),
        # ("score", T, S, R, tree, verifies) (`dispatch_forward`'s with targets),
        # ("pool", T, S, R, tree, verifies, scores) (`dispatch_forward`'s with pool segments).
        self._executables: dict[tuple, Callable] = {}
        self._cache = ExecutableCache.for_process(
            repr((str(graphdef), features_from, self.branch_free)))
        self._from_cache = 0  # programs the caches gave
        self.warmed_up = False
        self.compiles_after_warmup = 0
        self.programs_from_cache = 0
        # Multi-host, process 0: sends each step to the other processes (broadcast.py).
        self.broadcaster = broadcaster
        replicated = shard.sharding(())
        self._open_masks: dict[int, jax.Array] = {}  # BatchBuilder.open_mask, on the device
        # The carry: the last step's sampled tokens, on the device (see `forward`), then
        # room for a proposer's guesses and the acceptance of drafts (BatchBuilder.layout).
        self.carry = self._zero_carry()
        self._speculative_state(cfg, params, features_from)
        self._logits: jax.Array | None = None  # from dispatch_forward, for dispatch_sample
        self._row_tokens: jax.Array | None = None  # likewise (forward's last output)
        self._logits_dtype = None  # the forward pass's logits' (warm-up samples zeros of it)
        self.medusa = medusa  # Medusa heads (device arrays), or None
        self.guesses: jax.Array | None = None  # the last forward pass's Medusa guesses
        # Real tokens each expert of each MoE layer has taken since start (None: dense).
        # Replaced, not donated, each step, so another thread may read any copy.
        layers = sum(cfg.sparse_layers)
        self.expert_load = (jax.device_put(np.zeros((layers, cfg.num_experts), np.int32),
                                           replicated) if layers else None)
        # LoRA adapters' stacks (models/lora.py; `lora` their ShapeDtypeStructs), replicated,
        # written a slot at a time (`load_lora`); None without adapters. Not donated: a
        # step still in flight may read the stacks a load replaces (a copy per load, which
        # is rare: only an adapter without a slot needs one).
        self.lora = None
        # The image encoder (multimodal/encoder.py), whose buffer of embeddings the
        # forward pass reads; None for a text-only model.
        self.images = images
        self._kv_replicas, self._head_dim = shard.rules.kv_head_replicas, cfg.head_dim
        if lora is not None:
            self.lora = self.zeros(jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), lora))
            self._set_lora = jax.jit(
                lambda stacks, i, new: jax.tree.map(lambda s, n: s.at[i].set(n), stacks, new))

    def _speculative_state(self, cfg: ModelConfig, params, features_from: tuple[int, ...]
                           ) -> None:
        """What a proposer's programs share with the steps: an EAGLE head's inputs, the
        layers `features_from` (Transformer.__call__) of every token computed at its KV slot
        (`write_features`); and with sampled drafts (BatchBuilder.sampled_drafts) the
        distributions a proposer drew its guesses in the carry from, draft j of row r at
        max_num_seqs x j + r (written by the proposer's program, read by the sampling)."""
        builder = self.builder
        self.features_from = features_from
        self.features: jax.Array | None = None
        if features_from:
            self._abstract_features = jax.ShapeDtypeStruct(
                (self._abstract_kv[0][0].shape[1] * builder.page_size,
                 len(features_from) * cfg.hidden_size), jax.tree.leaves(params)[0].dtype,
                sharding=self.shard.sharding(FEATURE_AXES))
            self.features = self.zeros(self._abstract_features)
        self._abstract_draft_probs = jax.ShapeDtypeStruct(
            (builder.max_num_seqs * builder.num_speculative_tokens, builder.vocab_size),
            jnp.float32, sharding=self.shard.sharding(()))
        self.draft_probs = (self.zeros(self._abstract_draft_probs) if builder.sampled_drafts
                            else None)

    @staticmethod
    def zeros(abstract):
        """Arrays of zeros shaped, typed and placed as the pytree of ShapeDtypeStructs
        `abstract`, made by one program: a program per array cost a warm start 0.7 s of
        tracing and cache lookups for a 30-layer KV cache."""
        return jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract),
                       out_shardings=jax.tree.map(lambda x: x.sharding, abstract))()

    def _zero_carry(self) -> jax.Array:
        return jax.device_put(np.zeros(self.builder.layout.size, np.int32),
                              self.shard.sharding(()))

    def recover(self) -> bool:
        """After a failed step: if it consumed the donated KV cache (or the last samples),
        make new ones. Returns whether the KV cache was lost (every page's content)."""
        self._logits = None
        lost = any(x.is_deleted() for layer in self.kv_caches for x in layer)
        if self.features is not None and self.features.is_deleted():
            self.features, lost = self.zeros(self._abstract_features), True
        if lost:
            self.kv_caches = self.zeros(self._abstract_kv)
        if self.carry.is_deleted():
            self.carry = self._zero_carry()
        if self.draft_probs is not None and self.draft_probs.is_deleted():
            self.draft_probs = self.zeros(self._abstract_draft_probs)
        return lost

    def programs(self, key: BucketKey) -> list[tuple]:
        """The programs a bucket's steps run: its forward pass and its sampling (`FAST`
        and `FULL` where `branch_free`: `sample_program`), then, if the bucket `fuses`,
        both in one (which `dispatch` runs; a step sampled apart runs the two). Where
        steps with drafts run async (`CarryLayout.overlap`), a bucket without drafts has
        programs of its own (`verifies` False) that neither move sequences back nor
        search for accepted drafts: they cost a draft model's plain steps (speculation
        turned off for a large batch, prefills) what speculation off's do. With Medusa's
        heads where `branch_free`, forward passes with the heads and without
        (`heads_for`)."""
        heads = head_kinds(self.medusa, self.branch_free)
        programs = [self.forward_program(key, h) for h in heads]
        programs.append(self.sample_program(key, False))
        if self.branch_free:
            programs.append(self.sample_program(key, True))
        if self.fuses(key):
            programs += [self.step_program(key, h) for h in heads]
        return programs

    def _verifies(self, key: BucketKey) -> bool:
        return bool(key.drafts) or not self.builder.layout.overlap

    def forward_program(self, key: BucketKey, heads: bool) -> tuple:
        """A bucket's forward pass, with Medusa's heads or without (`heads_for`)."""
        return ("forward", key.tokens, key.seqs, key.rows, key.tree, heads,
                self._verifies(key))

    def step_program(self, key: BucketKey, heads: bool) -> tuple:
        return ("step", *self.forward_program(key, heads)[1:])

    def heads_for(self, batch: StepBatch) -> bool:
        """Whether a step's forward pass runs Medusa's heads (programs.head_kinds): with
        heads always (a step that does not propose skips them on the device), but where
        `branch_free` only in a step that proposes (`batch.propose`, on the host)."""
        return self.medusa is not None and (not self.branch_free or bool(batch.propose))

    def sample_program(self, key: BucketKey, full: bool) -> tuple:
        """A bucket's sampling program; `full` (where `branch_free`; else False): the one
        for rows that ask for top-k, top-p or logprobs (sampler.FULL)."""
        return ("sample", key.rows, key.history, self._verifies(key),
                full and self.branch_free)

    def samples_full(self, batch: StepBatch) -> bool:
        """Whether a row of the batch asks for what only the `FULL` sampling has (top-k,
        top-p, logprobs), where `branch_free`: such a step runs its forward pass and its
        sampling as two programs, not the `FAST` fused one. Reads the batch's host
        arrays (padding rows ask for nothing)."""
        p = batch.sampling
        return self.branch_free and (asks_sort(p) or bool(p.logprobs.any()))

    def fuses(self, key: BucketKey) -> bool:
        """Whether a whole step of the bucket (`dispatch`) is one program, its forward pass
        and its sampling together (programs.forward_and_sample): the buckets a step of
        decodes alone may take (up to the one holding a token for each of max_num_seqs
        sequences) without histories, where a step is short and a launch less is worth
        its compilation. (Bigger buckets keep two: a 64-sequence prefill step of
        smollm2-135m took 27-34 ms on a CPU as one program against 23 ms as two.)"""
        return not key.history and key.tokens <= self._decode_tokens

    def warmup(self, progress: bool = True) -> None:
        """Compile every program of every bucket now, so nothing compiles while serving,
        and run each once on an all-padding batch (which writes and samples nothing a
        request sees; a tree's `move` copies nothing). The progress bar counts the
        programs read from the caches (executable_cache.py, compile_cache.py)."""
        todo, seen = [], set(self._executables)
        for key in self.builder.all_buckets():
            for program in self.programs(key):
                if program not in seen:
                    seen.add(program)
                    todo.append((key, program))
        if self.builder.tree and ("move",) not in seen:
            todo.append((None, ("move",)))
        for key in self.builder.decode_buckets() if self.decode_steps > 1 else ():
            if self.steps_program(key) not in seen:
                todo.append((key, self.steps_program(key)))
        bar = tqdm(todo, desc="compiling step programs", unit="program",
                   disable=not progress or not todo)
        before = self._from_cache
        for key, program in bar:
            if program[0] == "forward":
                self._forward(self.builder.empty(key), program)
            elif program[0] == "step":
                self._step(self.builder.empty(key), program)
            elif program[0] == "steps":
                self.dispatch_steps(self.builder.empty(key), key, 1)
            elif program[0] == "sample":
                self._logits = jax.device_put(
                    np.zeros((key.rows, self.builder.vocab_size), self._logits_dtype),
                    self.shard.sharding(("seqs", "vocab")))
                self._row_tokens = jax.device_put(np.zeros(key.rows, np.int32),
                                                  self.shard.sharding(()))
                self._sample(self.builder.empty(key), program)
            else:
                self._move(*self.moves([]))
            bar.set_postfix_str(f"{self._from_cache - before} from cache")
        if self.lora is not None and not self.warmed_up:  # compiles the slot writer
            self.lora = self._set_lora(self.lora, np.int32(0), self.lora_slot_arrays(None))
        jax.block_until_ready(self.carry)
        self.programs_from_cache = self._from_cache - before
        if todo:
            log.info("step programs: %d compiled, %d read from the compilation cache",
                     len(todo) - self.programs_from_cache, self.programs_from_cache)
        self.warmed_up = True

    def _run(self, program: tuple, fn: Callable, args: tuple):
        """`fn(*args)` (a program of StepPrograms), compiled once per program. In a process
        with one device it runs as a compiled program from the executable cache; with more
        (a mesh, or one device of several) through `fn`, the jit, which places host arrays
        where the program expects them (a compiled program called with them failed on 8
        emulated devices: "Expected args ... to have 8 shards")."""
        executable = self._executables.get(program)
        if executable is not None:
            return executable(*args)
        if program[0] in ("score", "pool"):  # compiled when a bucket's step first needs it
            log.info("compiling %s for %s", program,
                     "prompt logprobs" if program[0] == "score" else "embeddings")
        elif self.warmed_up:
            self.compiles_after_warmup += 1
            log.warning("compiling %s after warm-up: a bucket is missing", program)
        if not one_device():
            with counting_hits() as events:
                out = fn(*args)
            executable, cached = fn, events.hits > 0
        else:
            executable, cached = self._cache.compile("-".join(map(str, program)), fn, args)
            out = executable(*args)
        self._executables[program] = executable
        self._from_cache += cached
        return out

    def dispatch(self, batch: StepBatch, key: BucketKey) -> SampleOutput:
        """Start the whole step (forward pass, then sampling) and return its outputs as
        device arrays, without waiting.

        Placeholder tokens of the batch read the previous dispatched step's samples."""
        if self.broadcaster is not None:
            self.broadcaster.send(STEP, batch, key)
        full, heads = self.samples_full(batch), self.heads_for(batch)
        if self.fuses(key) and not full:
            return self._step(batch, self.step_program(key, heads))
        self._forward(batch, self.forward_program(key, heads))
        return self._sample(batch, self.sample_program(key, full))

    def dispatch_forward(self, batch: StepBatch, key: BucketKey,
                         score_targets: np.ndarray | None = None,
                         pool_segments: np.ndarray | None = None
                         ) -> tuple[PromptScores | None, jax.Array | None]:
        """Start the step's forward pass; its logits wait on the device for
        `dispatch_sample`, which must come next (after any host work). Given
        `score_targets` (`[T]`, the batch's tokens' next prompt tokens), it also scores
        every token against its target (programs.prompt_scores); given `pool_segments`
        (`[T]`, each token's segment or -1), it also sums each segment's final hidden
        states (`[R, hidden]` float32: embeddings). Both device arrays, not waited for;
        None where not asked."""
        if self.broadcaster is not None:
            self.broadcaster.send(FORWARD, batch, key, score_targets, pool_segments)
        return self._forward(batch, self.forward_program(key, self.heads_for(batch)),
                             score_targets, pool_segments)

    def dispatch_sample(self, batch: StepBatch, key: BucketKey) -> SampleOutput:
        """Sample from the last `dispatch_forward`'s logits with the batch's sampling
        arrays and history (filled since)."""
        if self.broadcaster is not None:
            self.broadcaster.send(SAMPLE, batch, key)
        return self._sample(batch, self.sample_program(key, self.samples_full(batch)))

    def steps_program(self, key: BucketKey) -> tuple:
        return ("steps", key.tokens, key.seqs, self.decode_steps)

    def dispatch_steps(self, batch: StepBatch, key: BucketKey, num_steps: int) -> SampleOutput:
        """Start `num_steps` (<= `decode_steps`) decode steps of a batch of decoding
        sequences without drafts in one program (`decode_steps`); its outputs are
        `[decode_steps, R]`, step i's samples at i."""
        batch = dataclasses.replace(batch, history=None)
        batch.sampling.grammar_mask = self._grammar_mask(batch.sampling.grammar_mask)
        inputs = self._pack((batch, np.int32(num_steps)))
        args = (self.param_leaves, self.kv_caches, inputs, self.carry, self.expert_load,
                self.lora)
        self.kv_caches, out, self.carry, self.expert_load = self._run(
            self.steps_program(key), self._programs.steps, args)
        return out

    def load_lora(self, slot: int, adapter) -> None:
        """Write an adapter (loading/peft.py's Adapter) into device slot `slot` (1 to
        max_loras) of every stack; the steps dispatched before read the old contents. On
        several hosts process 0 sends the slot's arrays to the others first."""
        arrays = self.lora_slot_arrays(adapter)
        if self.broadcaster is not None:
            self.broadcaster.send_lora(slot, arrays)
        self.write_lora_slot(slot, arrays)

    def write_lora_slot(self, slot: int, arrays) -> None:
        """`load_lora` with the slot's arrays made (`lora_slot_arrays`); a follower's."""
        self.lora = self._set_lora(self.lora, np.int32(slot - 1), arrays)

    def lora_slot_arrays(self, adapter) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
        """One slot of every stack on the host: the adapter's A and B padded to the stacks'
        rank (k/v heads repeated as the model holds them), zeros where it has none."""
        out = []
        for i, layer in enumerate(self.lora):
            mods = {}
            for name, (a, b) in layer.items():
                wa = np.zeros(a.shape[1:], a.dtype)
                wb = np.zeros(b.shape[1:], b.dtype)
                if adapter is not None and (i, name) in adapter.weights:
                    x, y = adapter.weights[i, name]
                    if name in ("k_proj", "v_proj") and self._kv_replicas > 1:
                        y = np.repeat(y.reshape(len(y), -1, self._head_dim),
                                      self._kv_replicas, axis=1).reshape(len(y), -1)
                    wa[:, :x.shape[1]] = x
                    wb[:y.shape[0]] = y
                mods[name] = (wa, wb)
            out.append(mods)
        return out

    def moves(self, moves: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) of `move`: (data shard, src slot, dst slot) laid out as one block per
        shard of `max_num_seqs x num_speculative_tokens` (the most a step accepts), the
        rest copying nothing."""
        b = self.builder
        block = b.max_num_seqs * b.num_speculative_tokens
        src = np.zeros((b.data_shards, block), np.int32)
        dst = np.full((b.data_shards, block), b.num_pages * b.page_size, np.int32)
        used = [0] * b.data_shards
        for shard, s, d in moves:
            src[shard, used[shard]], dst[shard, used[shard]] = s, d
            used[shard] += 1
        return src.reshape(-1), dst.reshape(-1)

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Start copying K/V (and EAGLE features) between slots (`moves`' arrays)."""
        if self.broadcaster is not None:
            self.broadcaster.send_moves(src, dst)
        self._move(src, dst)

    def _move(self, src: np.ndarray, dst: np.ndarray) -> None:
        args = (self.kv_caches, self.features, src, dst)
        self.kv_caches, self.features = self._run(("move",), self._programs.move, args)

    def read_pages(self, data_shard: int, page_ids: list[int], num_tokens: int) -> KVPages:
        """Start reading a sequence's pages out of the KV cache (kv_transfer.py)."""
        return self.pages.read(self.kv_caches, data_shard, page_ids, num_tokens)

    def page_layout(self) -> list[tuple[tuple[int, ...], Any]]:
        """One page as `read_pages` gives it, per cache entry (PageMover.page_layout)."""
        return self.pages.page_layout(self._abstract_kv)

    def write_pages(self, kv: KVPages, data_shard: int, page_ids: list[int | None]) -> None:
        """Start writing moved pages into the KV cache (kv_transfer.py)."""
        self.kv_caches = self.pages.write(self.kv_caches, kv, data_shard, page_ids)

    def _forward(self, batch: StepBatch, program: tuple,
                 score_targets: np.ndarray | None = None,
                 pool_segments: np.ndarray | None = None
                 ) -> tuple[PromptScores | None, jax.Array | None]:
        inputs = self._pack(_forward_inputs(batch))
        args = self._forward_args(inputs, program)
        scores, pool = score_targets is not None, pool_segments is not None
        fn = self._programs.forward[program[-2:]]
        if pool:  # the bucket's forward pass that sums pool segments
            fn = self._programs.pool[(*program[-2:], scores)]
            program = ("pool", *program[1:], scores)
        elif scores:  # the bucket's forward pass that scores its tokens
            fn, program = self._programs.score[program[-2:]], ("score", *program[1:])
        args += (score_targets,) * scores + (pool_segments,) * pool
        out = self._run(program, fn, args)
        (self.kv_caches, self._logits, self.expert_load, self.guesses,
         self.features, self._row_tokens) = out[:6]
        self._logits_dtype = self._logits.dtype
        return (out[6] if scores else None), (out[-1] if pool else None)

    def _step(self, batch: StepBatch, program: tuple) -> SampleOutput:
        inputs = self._pack((_forward_inputs(batch), self._sampling_inputs(batch)))
        (self.kv_caches, out, self.carry, self.expert_load, self.guesses,
         self.features) = self._run(program, self._programs.step[program[-2:]],
                                    self._forward_args(inputs, program) + (self.draft_probs,))
        return out

    def _sample(self, batch: StepBatch, program: tuple) -> SampleOutput:
        logits, self._logits = self._logits, None
        inputs = self._pack(self._sampling_inputs(batch))
        args = (logits, inputs, self.carry, self.draft_probs, self._row_tokens)
        out, self.carry = self._run(program, self._programs.sample[program[-2:]], args)
        return out

    def _forward_args(self, inputs, program: tuple) -> tuple:
        """A forward pass's arguments (`forward_packed`'s, after the graph and params) for
        a `forward_program` or `step_program` (Medusa's heads if it runs them)."""
        return (self.param_leaves, self.kv_caches, inputs, self.carry, self.expert_load,
                self.medusa if program[-2] else None, self.features, self.lora,
                self._image_buffer())

    def _sampling_inputs(self, batch: StepBatch) -> tuple:
        """The sampling's host inputs (its grammar mask on the device)."""
        batch.sampling.grammar_mask = self._grammar_mask(batch.sampling.grammar_mask)
        return batch.sampling, batch.history, batch.num_rows

    def _grammar_mask(self, mask: np.ndarray) -> jax.Array:
        """The batch's grammar mask on the device; one that allows everything is the copy
        kept there (no transfer). Always a device array, as at warm-up: a numpy array in
        its place would miss jit's fast dispatch path (~30 ms a step for this model on a
        CPU). On several hosts every process decides alike (they see the same mask):
        putting a host array on the global devices is itself a collective. A mask already
        on the device (a batch dispatched again) is taken as it is."""
        if isinstance(mask, jax.Array):
            return mask
        if mask is not self.builder.open_mask(mask.shape[0]) and not (mask == -1).all():
            return jax.device_put(mask, self.shard.sharding(()))
        if mask.shape[0] not in self._open_masks:
            self._open_masks[mask.shape[0]] = jax.device_put(
                self.builder.open_mask(mask.shape[0]), self.shard.sharding(()))
        return self._open_masks[mask.shape[0]]

    def compiled(self, key: BucketKey) -> jax.stages.Compiled:
        """The compiled forward pass of a bucket (every collective and kernel of its step
        is there), for reading its HLO (compiles it again)."""
        batch = self._pack(_forward_inputs(self.builder.empty(key)))
        program = self.forward_program(key, self.medusa is not None)
        forward = self._programs.forward[program[-2:]]
        return forward.lower(*self._forward_args(batch, program)).compile()

    def _image_buffer(self) -> jax.Array | None:
        return self.images.buffer if self.images is not None else None

    @property
    def num_compiled(self) -> int:
        return len(self._executables)


def _forward_inputs(batch: StepBatch) -> StepBatch:
    """The batch a forward pass takes: without its sampling arrays and history."""
    return dataclasses.replace(batch, sampling=None, history=None)


def fetch(out: SampleOutput, logprobs: bool = True) -> SampleOutput:
    """Wait for a dispatched step's outputs and copy them to the host (they are replicated:
    on several hosts, this process's copy): on an accelerator in one explicit transfer
    (`jax.device_get`, which jax's transfer guard allows); on a CPU, where they already are
    host memory, as views (device_get costs ~35 us more a step there). `logprobs` False:
    the token ids alone (the logprob fields None), when no request asks for logprobs.

    (On a 2-core Zen 3, a batch-1 step's fresh outputs: all four through
    `addressable_data` 111 us, the token ids alone 44 us, and as a view of the array
    itself 17 us.)"""
    leaves = ([out.token_ids, out.logprob, out.top_ids, out.top_logprobs] if logprobs
              else [out.token_ids])
    shards = leaves if _one_process() else [x.addressable_data(0) for x in leaves]
    host = [np.asarray(x) for x in shards] if _on_cpu() else jax.device_get(shards)
    return SampleOutput(*host) if logprobs else SampleOutput(host[0], None, None, None)


def fetch_scores(scores: PromptScores) -> PromptScores:
    """A scoring step's prompt scores (`dispatch_forward`'s) on the host, in one explicit
    transfer, as `fetch` takes its samples (called after it: nothing more to wait for)."""
    return PromptScores(*jax.device_get(list(scores)))


@functools.cache
def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


@functools.cache
def _one_process() -> bool:
    return jax.process_count() == 1


def branch_free() -> bool:
    """Whether the step programs leave out `lax.cond`s on the device's data, the host
    picking the program instead (sampler.Static, programs.decode_steps): on a GPU, where
    XLA runs a `lax.cond` by copying its predicate to the host and waiting for it, and a
    loop of a count not known when compiled likewise each time round. A program holding
    one returns to its caller only when the device gets there: on an H200 (2026-12-04,
    Llama-3-8B shape, bf16) a batch-1 step's call returned after 9.1 ms, the step's whole
    time, and no step was queued behind another."""
    return jax.default_backend() == "gpu"


def packs_inputs() -> bool:
    """Whether step programs take their host inputs packed (packing.py): on accelerators,
    where each array is a transfer of its own; not on a CPU, where packing costs more."""
    return not _on_cpu()


def _as_is(tree):
    return tree
