"""The step's jitted programs: pure functions of the parameters, the KV cache, the batch and
the carry (the device array of the last step's tokens), jitted with fixed layouts.

`forward` runs the model over a ragged batch and leaves logits at the rows it samples
(and, given targets, scores every token of the batch: `prompt_scores`; given pool
segments, sums the final hidden states of each segment's tokens: embeddings);
`sample_step` samples them; `forward_and_sample` is both in one program; `decode_steps`
runs several decode steps in one program.
`ModelRunner` (runner.py) holds the device state they run on and dispatches them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.engine.batch import CarryLayout, StepBatch
from jaxserve.engine.packing import Packed, unpack
from jaxserve.engine.sampler import (
    FAST, FULL, SampledDrafts, SampleOutput, SamplingArrays, Static, TokenHistory, sample)
from jaxserve.engine.slots import position_slots
from jaxserve.engine.speculative.device import (
    move_slots, record_acceptance, resolve_pending, shift_sampling, write_features)
from jaxserve.models.lora import LoraInputs
from jaxserve.models.medusa import MedusaHeads, medusa_tokens
from jaxserve.models.transformer import KVCache, Transformer
from jaxserve.sampling_params import MAX_LOGPROBS
from sharding.rules import ShardingContext

FEATURE_AXES = ("pages", None)  # an EAGLE feature cache [slots, F]: split as the pages are
SCORE_BLOCK = 64  # tokens whose full-vocabulary logits `prompt_scores` holds at once


class PromptScores(NamedTuple):
    """Each token's distribution over the next one, scored against a target token (the
    prompt's next; vLLM's prompt_logprobs): `[T]` and `[T, MAX_LOGPROBS]` arrays."""

    logprob: jax.Array  # f32: the target's log-probability
    rank: jax.Array  # i32: its rank, 1 = the most likely
    top_ids: jax.Array  # i32: the most likely tokens, best first
    top_logprobs: jax.Array  # f32: their log-probabilities


def prompt_scores(model: Transformer, hidden: jax.Array, targets: jax.Array) -> PromptScores:
    """The model's log-probabilities at every token of `hidden` (`[T, hidden]`, the last
    layer's output), read at `targets` (`[T]`; any id where the host reads nothing), with
    the rank and the top MAX_LOGPROBS: the full-vocabulary logits of SCORE_BLOCK tokens at a
    time, never of the whole batch."""
    t = hidden.shape[0]
    block = math.gcd(t, SCORE_BLOCK)

    def score(args):
        x, target = args
        logprobs = jax.nn.log_softmax(model.logits(x), axis=-1)
        chosen = jnp.take_along_axis(logprobs, target[:, None], axis=1)[:, 0]
        rank = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
        return PromptScores(chosen, rank, top_ids.astype(jnp.int32), top_logprobs)

    out = jax.lax.map(score, (hidden.reshape(t // block, block, -1),
                              jnp.clip(targets, 0).reshape(t // block, block)))
    return jax.tree.map(lambda x: x.reshape(t, *x.shape[2:]), out)


def forward(graphdef: nnx.GraphDef, params: nnx.State, kv_caches: KVCache, batch: StepBatch,
            carry: jax.Array, expert_load: jax.Array | None,
            medusa: MedusaHeads | None = None, features: jax.Array | None = None,
            lora: list | None = None, images: jax.Array | None = None,
            score_targets: jax.Array | None = None, *,
            features_from: tuple[int, ...] = (), layout: CarryLayout, page_size: int,
            verifies: bool = True, branch_free: bool = False,
            pool_segments: jax.Array | None = None) -> tuple:
    """One forward pass over a ragged batch: float32 logits `[R, vocab]` at the tokens the
    batch samples (`batch.sample_index`: each sequence's last token, and the tokens
    before it that verify drafts).

    The `carry` (laid out as `layout` says) holds the previous step's sampled tokens, then
    a proposer's guesses, still on the device: tokens with `batch.prev_index >= 0` take
    their id from there, so the host can schedule this step before it has seen them (and
    sequences whose pending step rejected drafts move back: `resolve_pending`; a program
    for buckets without drafts, `verifies` False, has none: BatchBuilder.build).
    `expert_load` (`[sparse layers, num_experts]`, None for a dense model) counts the real
    tokens each expert has taken since start; returned with this step's added. `medusa`: Medusa heads, whose guesses
    `[R, heads, top]` at the sampled rows come back fourth when `batch.propose` (zeros when
    not; None without heads; `branch_free`: whenever heads are given, the host passing
    None for a step that does not propose). `features`: an EAGLE head's feature cache
    (`[slots, F]`, see `write_features`), returned with every real token's features (the
    layers `features_from`, Transformer.__call__) written at its KV slot; None without a
    head.
    Last, the token id at each sampled row `[R]` (the sampling records the acceptance of
    drafts from them: `record_acceptance`). `lora`: the LoRA adapters' stacks
    (models/lora.py), each token using the slot `batch.lora_slots` gives it; None without.
    `images`: the image encoder's buffer of embeddings (multimodal/encoder.py), which
    tokens with a `batch.image_rows` entry read; None for a text-only model.
    `score_targets` (`[T]`, given): every token's distribution scored against it
    (`prompt_scores`), returned seventh. `pool_segments` (`[T]`, given): each token's
    segment in [0, R) or -1; returned last, each segment's sum of its tokens' hidden
    states after the final norm, float32 `[R, hidden]` (embeddings: a segment is a
    request's last prompt token, or its first, or a chunk of its prompt to average;
    Engine._pool_segments).
    """
    model = nnx.merge(graphdef, params)
    input_ids, batch = resolve_pending(batch, carry, layout, page_size, verifies)
    positions = batch.positions
    if batch.rope_offsets is not None:  # M-RoPE: each stream's positions
        positions = positions[None] + batch.rope_offsets
    (hidden, kv_caches, new_features), sown = nnx.capture(model.run, nnx.Intermediate)(
        input_ids, positions, kv_caches, batch.attn, expert_load is not None,
        features_from, LoraInputs.of(lora, batch.lora_slots) if lora is not None else None,
        (images, batch.image_rows) if images is not None else None)
    if expert_load is not None:  # MoE layers' counts, in layer order
        sown = sorted(nnx.to_flat_state(sown), key=lambda kv: kv[0])
        counts = [v.get_value()[0] for _, v in sown]
        expert_load = expert_load + jnp.stack(counts)
    data_shards = batch.attn.num_seqs.shape[0]
    rows = sampled_rows(hidden, batch.sample_index, data_shards)
    # In the matmul's dtype: the sampler widens only the rows it samples (a 1-sequence
    # prefill in a 64-row bucket converted 64 rows of a 49k vocabulary: 1.2 ms on a CPU).
    logits = model.logits(rows, rows=batch.num_rows[0] if data_shards == 1 else None,
                          dtype=None)
    guesses = None
    if medusa is not None and branch_free:
        guesses = medusa_tokens(model.final_norm(rows), medusa)
    elif medusa is not None:
        guesses = jax.lax.cond(
            batch.propose, lambda: medusa_tokens(model.final_norm(rows), medusa),
            lambda: jnp.zeros((rows.shape[0], medusa.lm_heads.shape[0], medusa.top),
                              jnp.int32))
    if features is not None:
        features = write_features(features, new_features, batch.attn.slot_mapping, data_shards)
    row_tokens = jnp.take_along_axis(input_ids.reshape(data_shards, -1),
                                     batch.sample_index.reshape(data_shards, -1), 1)
    out = (kv_caches, logits, expert_load, guesses, features, row_tokens.reshape(-1))
    if score_targets is not None:
        out += (prompt_scores(model, hidden, score_targets),)
    if pool_segments is not None:
        out += (jax.ops.segment_sum(model.final_norm(hidden).astype(jnp.float32),
                                    pool_segments, num_segments=rows.shape[0]),)
    return out


def sample_step(logits: jax.Array, sampling: SamplingArrays, history: TokenHistory | None,
                carry: jax.Array, num_rows: jax.Array, draft_probs: jax.Array | None,
                row_tokens: jax.Array, *, layout: CarryLayout, verifies: bool = True,
                static: Static | None = None) -> tuple[SampleOutput, jax.Array]:
    """Sample one token per row; returns them also written into the `carry` (laid out as
    `layout` says: its first rows, and with `layout.overlap` the acceptance of the step's
    chains, `record_acceptance`, from the forward pass's `row_tokens`), where the next
    step reads its PLACEHOLDER tokens.
    `num_rows` (the batch's real rows per data shard) lets one shard's batch sample its
    real rows only (under data parallelism each shard's rows are a block of their own:
    all rows). `draft_probs` (BatchBuilder.sampled_drafts; else None): the distributions
    the guesses in `carry` were drawn from, in their order. `verifies` False: a
    bucket without drafts (no sequence of it moves back, none verifies). `static`: what
    the sampling settles when compiled (sampler.Static; None: on the device)."""
    drafts = None
    if draft_probs is not None:
        drafts = SampledDrafts(
            carry[layout.guesses_end - draft_probs.shape[0]:layout.guesses_end],
            draft_probs)
    if verifies:
        sampling = shift_sampling(sampling, carry, layout)
    out = sample(logits, sampling, history, num_rows[0] if num_rows.shape[0] == 1 else None,
                 drafts, static)
    n = min(out.token_ids.shape[0], layout.guesses_end)
    carry = carry.at[:n].set(out.token_ids[:n])
    if layout.overlap:
        carry = record_acceptance(carry, out.token_ids, row_tokens, sampling.group_drafts,
                                  layout, verifies)
    return out, carry


def next_decode(batch: StepBatch, token_ids: jax.Array, page_size: int) -> StepBatch:
    """The decode batch after `batch` (every sequence one token, row r of data shard d
    sequence r of d, as BatchBuilder lays a batch without drafts out): each real row's
    sample `token_ids[r]` as its sequence's token, one position later (its KV slot from
    the page table, one more KV token), sampling the next output number."""
    meta, s = batch.attn, batch.sampling
    d, t, r = meta.num_seqs.shape[0], batch.input_ids.shape[0], token_ids.shape[0]
    shard = jnp.arange(r) // (r // d)
    real = jnp.arange(r) % (r // d) < batch.num_rows[shard]
    token = jnp.where(real, shard * (t // d) + batch.sample_index, t)  # t: dropped
    positions = batch.positions.at[token].add(1, mode="drop")
    row_positions = positions[jnp.minimum(token, t - 1)]
    slots = meta.slot_mapping.at[token].set(
        position_slots(meta.page_indices, row_positions, page_size), mode="drop")
    attn = dataclasses.replace(meta, slot_mapping=slots, kv_lens=meta.kv_lens + real)
    sampling = dataclasses.replace(s, output_index=s.output_index + real)
    return dataclasses.replace(
        batch, input_ids=batch.input_ids.at[token].set(token_ids, mode="drop"),
        positions=positions, attn=attn, sampling=sampling,
        prev_index=jnp.full_like(batch.prev_index, -1))


def decode_steps(graphdef: nnx.GraphDef, params: nnx.State, kv_caches: KVCache,
                 batch: StepBatch, carry: jax.Array, expert_load: jax.Array | None,
                 num_steps: jax.Array, lora: list | None = None, *, steps: int,
                 layout: CarryLayout, page_size: int, branch_free: bool = False
                 ) -> tuple[KVCache, SampleOutput, jax.Array, jax.Array | None]:
    """`num_steps` (<= `steps`) decode steps of a batch of decoding sequences in one
    program: each a forward pass and its sampling (`forward`, `sample_step`), the next
    feeding each sequence its sample (`next_decode`). The host gives every sequence pages
    for all of them and reads the tokens back once (Engine: `num_scheduler_steps`);
    outputs are `[steps, R]` (step i's samples at i; those past `num_steps` zeros), the
    last step's samples in `carry` as after one step. `branch_free` (ModelRunner's): the
    loop runs `steps` times whatever `num_steps` says (the host asks for no fewer), a
    loop of a known count that XLA:GPU runs without reading a predicate back each time,
    and the sampling is `FAST` (no row of it asks for top-k, top-p or logprobs)."""
    def one(kv, batch, prev, load):
        inputs = dataclasses.replace(batch, sampling=None, history=None)
        kv, logits, load, _, _, row_tokens = forward(
            graphdef, params, kv, inputs, prev, load, lora=lora, layout=layout,
            page_size=page_size, verifies=False)
        out, prev = sample_step(logits, batch.sampling, None, prev, batch.num_rows, None,
                                row_tokens, layout=layout, verifies=False,
                                static=FAST if branch_free else None)
        return kv, out, prev, load

    out = jax.eval_shape(one, kv_caches, batch, carry, expert_load)[1]
    outs = jax.tree.map(lambda x: jnp.zeros((steps, *x.shape), x.dtype), out)

    def step(i, state):
        kv, batch, prev, load, outs = state
        kv, out, prev, load = one(kv, batch, prev, load)
        outs = jax.tree.map(lambda acc, x: acc.at[i].set(x), outs, out)
        return kv, next_decode(batch, out.token_ids, page_size), prev, load, outs

    kv_caches, _, carry, expert_load, outs = jax.lax.fori_loop(
        0, steps if branch_free else num_steps, step,
        (kv_caches, batch, carry, expert_load, outs))
    return kv_caches, outs, carry, expert_load


def sampled_rows(hidden: jax.Array, sample_index: jax.Array, data_shards: int) -> jax.Array:
    """The hidden states of the tokens the batch samples, `[R, hidden]`, taken within each
    data shard's block of tokens (so no shard reads another's)."""
    blocks = hidden.reshape(data_shards, -1, hidden.shape[-1])
    index = sample_index.reshape(data_shards, -1)
    return jnp.take_along_axis(blocks, index[:, :, None], axis=1).reshape(-1, hidden.shape[-1])


class StepPrograms(NamedTuple):
    """The jitted programs of a step: its `forward` pass (KV cache and logits, which stay
    on the device), then `sample_step`. Every step runs both; a step whose sampling waits
    for the host (penalties, grammars: see `Engine.step`) dispatches the second later.
    `step` is both in one program (`forward_and_sample`), which a bucket of at most one
    token per sequence without histories runs when nothing samples apart
    (ModelRunner.programs). `move` (`move_slots` per device) runs after a step whose trees
    accepted nodes outside the slots of their positions."""

    forward: dict[tuple[bool, bool], Callable]  # by `heads` and `verifies` (head_kinds,
    # ModelRunner.programs)
    sample: dict[tuple[bool, bool], Callable]  # by `verifies` and `full` (branch-free: FULL)
    step: dict[tuple[bool, bool], Callable]
    # `forward` with its tokens scored (`prompt_scores`), for a step computing prompts that
    # ask for their logprobs; by `heads` and `verifies`, compiled when first run.
    score: dict[tuple[bool, bool], Callable]
    # `forward` summing its pool segments' hidden states too (`pool_segments`, its last
    # argument), for a step computing prompts that ask for their embedding; by `heads`,
    # `verifies` and whether it also scores (its targets before the segments), compiled
    # when first run.
    pool: dict[tuple[bool, bool, bool], Callable]
    move: Callable
    steps: Callable | None = None  # `decode_steps` (None: one step per program)


def sample_packed(logits: jax.Array, inputs: Packed | tuple, carry: jax.Array,
                  draft_probs: jax.Array | None, row_tokens: jax.Array, **kwargs
                  ) -> tuple[SampleOutput, jax.Array]:
    """`sample_step` with its host inputs (sampling, history, num_rows) in one tuple,
    packed or not (packing.py)."""
    sampling, history, num_rows = unpack(inputs)
    return sample_step(logits, sampling, history, carry, num_rows, draft_probs, row_tokens,
                       **kwargs)


def forward_and_sample(graphdef: nnx.GraphDef, params, kv_caches: KVCache,
                       inputs: Packed | tuple, carry: jax.Array, expert_load: jax.Array | None,
                       medusa: MedusaHeads | None, features: jax.Array | None,
                       lora: list | None, images: jax.Array | None,
                       draft_probs: jax.Array | None, *, layout: CarryLayout,
                       verifies: bool = True, static: Static | None = None, **kwargs):
    """`forward`, then `sample_step` on its logits, in one program: one launch a step, and
    the logits never leave it. `inputs` (packed or not): the batch without its sampling
    arrays and history, then (sampling, history, num_rows). Returns the KV cache, the
    samples, the carry, the expert load, Medusa's guesses and the feature cache."""
    batch, (sampling, history, num_rows) = unpack(inputs)
    kv_caches, logits, expert_load, guesses, features, row_tokens = forward(
        graphdef, params, kv_caches, batch, carry, expert_load, medusa, features, lora,
        images, layout=layout, verifies=verifies, **kwargs)
    out, carry = sample_step(logits, sampling, history, carry, num_rows, draft_probs,
                             row_tokens, layout=layout, verifies=verifies, static=static)
    return kv_caches, out, carry, expert_load, guesses, features


def on_param_leaves(graphdef: nnx.GraphDef, params, fn: Callable) -> Callable:
    """`fn(graphdef, params, *args)` as a function of the parameters' flat list of leaves
    (`jax.tree.leaves(params)`; `params` may be abstract): flattening an nnx.State on every
    call costs the host ~1 µs per parameter."""
    treedef = jax.tree.structure(params)
    return lambda leaves, *args: fn(graphdef, jax.tree.unflatten(treedef, leaves), *args)


def forward_packed(graphdef: nnx.GraphDef, params, kv_caches: KVCache,
                   batch: Packed | StepBatch, *args, **kwargs):
    """`forward` with its batch packed or not (packing.py)."""
    return forward(graphdef, params, kv_caches, unpack(batch), *args, **kwargs)


def forward_pooled(graphdef: nnx.GraphDef, params, kv_caches: KVCache,
                   batch: Packed | StepBatch, *args, **kwargs):
    """`forward_packed` whose last argument is its `pool_segments`."""
    *args, segments = args
    return forward(graphdef, params, kv_caches, unpack(batch), *args, pool_segments=segments,
                   **kwargs)


def decode_steps_packed(graphdef: nnx.GraphDef, params, kv_caches: KVCache,
                        inputs: Packed | tuple, carry: jax.Array, expert_load: jax.Array | None,
                        lora: list | None = None, **kwargs):
    """`decode_steps` with its batch and step count in one tuple, packed or not
    (packing.py)."""
    batch, num_steps = unpack(inputs)
    return decode_steps(graphdef, params, kv_caches, batch, carry, expert_load, num_steps,
                        lora, **kwargs)


def head_kinds(medusa: MedusaHeads | None, branch_free: bool) -> tuple[bool, ...]:
    """Whether the forward passes run Medusa's heads (given `medusa`): with heads always
    (a step that does not propose skips them on the device), and where `branch_free` also
    not (the host picks by whether the step proposes: ModelRunner.heads_for)."""
    if medusa is None:
        return (False,)
    return (False, True) if branch_free else (True,)


def jit_programs(graphdef: nnx.GraphDef, params, cache_shardings, shard: ShardingContext,
                 layout: CarryLayout, page_size: int, features_from: tuple[int, ...] = (),
                 medusa: MedusaHeads | None = None, max_decode_steps: int = 1,
                 branch_free: bool = False) -> StepPrograms:
    """The programs, jitted with fixed layouts in and out (params, KV cache and Medusa
    heads as given, logits as the model leaves them, batch and samples replicated, an
    EAGLE feature cache split as the pages are), so the donated caches and params never
    reshard. They take the parameters as their flat list of leaves (`on_param_leaves`),
    and the batch's host arrays as one argument, packed on accelerators (packing.py):
    `forward` its batch, `sample` its (sampling, history, num_rows), `steps` its (batch,
    num_steps). `branch_free` (ModelRunner's, on a GPU): the sampling settles its
    branches when compiled (sampler.Static): `step` and `steps` sample `FAST`, and the
    `sample` programs come in two, `FAST` and `FULL` (`full`); Medusa's heads run in the
    `forward` and `step` programs they are given to (`forward`)."""
    param_shardings = [x.sharding for x in jax.tree.leaves(params)]
    replicated = shard.sharding(())
    logits_sharding = shard.sharding(("seqs", "vocab"))
    features = shard.sharding(FEATURE_AXES)
    heads = jax.tree.map(lambda x: x.sharding, medusa) if medusa is not None else replicated
    inputs = (param_shardings, cache_shardings, replicated, replicated, replicated, heads,
              features, replicated, replicated)  # LoRA stacks, image embeddings
    slots = shard.rules.spec(("pages",))  # each data shard's moves, a block of its own
    move = move_slots
    if shard.mesh.size > 1:  # every device moves its own pages' slots of its own heads
        specs = lambda tree: jax.tree.map(lambda x: x.spec, tree)  # noqa: E731
        io = (specs(cache_shardings), features.spec if features_from else None)
        move = jax.shard_map(move_slots, mesh=shard.mesh, check_vma=False,
                             in_specs=(*io, slots, slots), out_specs=io)

    def sampling(verifies: bool, full: bool) -> Callable:
        return jax.jit(functools.partial(sample_packed, layout=layout, verifies=verifies,
                                         static=(FULL if full else FAST) if branch_free
                                         else None),
                       in_shardings=(logits_sharding, replicated, replicated, replicated,
                                     replicated),
                       out_shardings=(replicated, replicated))

    def jitted(verifies: bool, heads: bool) -> tuple[Callable, ...]:
        static = dict(features_from=features_from, layout=layout, page_size=page_size,
                      verifies=verifies, branch_free=branch_free)
        ins = inputs if heads else inputs[:5] + (replicated,) + inputs[6:]  # medusa None
        outs = (cache_shardings, logits_sharding, replicated, replicated, features, replicated)
        forward_fn = on_param_leaves(graphdef, params, functools.partial(forward_packed,
                                                                         **static))
        pool_fn = on_param_leaves(graphdef, params, functools.partial(forward_pooled,
                                                                      **static))
        return (jax.jit(forward_fn, donate_argnums=(1, 6), in_shardings=ins,
                        out_shardings=outs),
                jax.jit(on_param_leaves(graphdef, params, functools.partial(
                            forward_and_sample, static=FAST if branch_free else None,
                            **static)),
                        donate_argnums=(1, 6), in_shardings=ins + (replicated,),
                        out_shardings=(cache_shardings, replicated, replicated, replicated,
                                       replicated, features)),
                jax.jit(forward_fn, donate_argnums=(1, 6), in_shardings=ins + (replicated,),
                        out_shardings=outs + (replicated,)),
                *(jax.jit(pool_fn, donate_argnums=(1, 6),
                          in_shardings=ins + (replicated,) * (1 + scores),
                          out_shardings=outs + (replicated,) * (1 + scores))
                  for scores in (False, True)))

    # `verifies` False only where the layout overlaps (else it changes nothing); with
    # Medusa's heads, and without them where the host settles whether a step proposes.
    verifies_kinds = (False, True) if layout.overlap else (True,)
    passes = {(heads, verifies): jitted(verifies, heads)
              for verifies in verifies_kinds for heads in head_kinds(medusa, branch_free)}
    steps = None
    if max_decode_steps > 1:
        # XLA's loop-invariant code motion would hoist the embedding gather's widening of
        # the whole bf16 table to float32 out of the loop: a copy of it every call
        # (smollm2-135m: 113 MB; one step 21 ms instead of 9.5).
        steps = jax.jit(
            on_param_leaves(graphdef, params, functools.partial(
                decode_steps_packed, steps=max_decode_steps, layout=layout,
                page_size=page_size, branch_free=branch_free)),
            donate_argnums=(1,), in_shardings=inputs[:3] + (replicated,) * 3,
            out_shardings=(cache_shardings, replicated, replicated, replicated),
            compiler_options={"xla_disable_hlo_passes": "while-loop-invariant-code-motion"})
    return StepPrograms(
        forward={kind: fns[0] for kind, fns in passes.items()},
        sample={(verifies, full): sampling(verifies, full) for verifies in verifies_kinds
                for full in ((False, True) if branch_free else (False,))},
        step={kind: fns[1] for kind, fns in passes.items()},
        score={kind: fns[2] for kind, fns in passes.items()},
        pool={(*kind, scores): fns[3 + scores] for kind, fns in passes.items()
              for scores in (False, True)},
        move=jax.jit(move, donate_argnums=(0, 1),
                     in_shardings=(cache_shardings, features, replicated, replicated),
                     out_shardings=(cache_shardings, features)),
        steps=steps)
