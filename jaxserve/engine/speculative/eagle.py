"""The EAGLE proposer (EAGLE-1 and EAGLE-3 heads, models/eagle.py): a one-layer head over
the target model's own features guesses each sequence's next k tokens: greedily, or for
a request that samples (SpeculativeConfig.sampled_drafts, chains) drawn from the head's
own distribution, which the program leaves on the device for the target's step to keep
or reject each guess by (sampler.draw_drafts, sampler.verify_drafts).

The target's step writes each token's features (the layers the head reads) into a cache
of one row per KV slot (device.write_features), so the features of every computed token
sit where its K/V do: prefix-cache hits, chunked prefill and preemption need nothing of
their own, and a rejected draft's row is overwritten as its K/V are. The head has its own
one-layer KV cache of the target's page count, addressed by the target's page tables (as
the draft model's, draft_model.py). Its position p holds the pair (token p + 1, the
target's features at p); the sequence's `SeqSpeculation.computed` counts the pairs whose
K/V are valid: those whose token and features are final, so at most num_tokens - 1 (the
newest token has no features yet).

One program per step (`draft`): round 1 feeds each sequence's new pairs (its whole prompt
the first time, chunked by the token budget; then those of the tokens the last step
accepted) and guesses from the last; rounds 2..k, a loop on the device, feed each
sequence the round before's guess with the head's own output as its features, at the
next position. Those rounds' K/V hold guessed features, so the next step's round 1
recomputes those positions with the target's. The guesses stay on the device, laid out
in the target's carry, where its step reads its PLACEHOLDER tokens: the host schedules
and dispatches the verification behind the program without waiting for it, and reads
the guesses with the verification's samples (SpeculativeDecoding.read_back). One wait
per step.

With a tree (SpeculativeConfig.speculative_token_tree, drafts.py: EAGLE's
top-k trees) round 1's top guesses are the first depth's nodes, and each later round
feeds every node of a depth that has children at once (its token, its parent's output
as features), each in a slot of its own after the sequence's pairs (node j at kv_lens + j)
with its depth's position, seeing its ancestors only (the tree masks the target's
verification uses); a node's children are its top guesses by rank.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.engine.batch import BucketKey, StepBatch, writable
from jaxserve.engine.programs import sampled_rows
from jaxserve.engine.request import PLACEHOLDER, Sequence
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.slots import global_slots, position_slots
from jaxserve.engine.speculative import drafts as trees
from jaxserve.engine.speculative.device import write_guesses
from jaxserve.engine.speculative.drafts import NO_DRAFTS, Drafts
from jaxserve.engine.speculative.proposers import DeviceProposer, first_round
from jaxserve.engine.speculative.rounds import round_guesses, round_metadata, seqs_as_tokens
from jaxserve.models.eagle import EagleHead, embed
from jaxserve.models.transformer import AttentionMetadata
from sharding.rules import ShardingContext


def draft(graphdef: nnx.GraphDef, params: nnx.State, target_graphdef: nnx.GraphDef,
          target_params: nnx.State, kv: tuple, features: jax.Array, batch: StepBatch,
          limits: jax.Array, probs: jax.Array | None, *, rounds: int, max_num_seqs: int,
          page_size: int, drop_slot: int, tree: tuple[tuple[int, ...], ...] | None = None,
          sorts: bool | None = None) -> tuple[tuple, jax.Array, jax.Array | None]:
    """Round 1 over `batch` (each sequence's new pairs: its input ids are the tokens after
    their positions, the features are read from the target's `features` at their slots),
    then `rounds` more rounds of one token per sequence. Returns the cache, the guesses
    `[rounds + 1, S]` and `probs`; sequence i writes K/V in its first `limits[i]` extra
    rounds only (the pages it holds). With `probs` (the target's `draft_probs`), the
    sampled rows of `batch.sampling` draw their guesses (rounds.round_guesses); else every
    guess is greedy; `sorts`: how the draws settle top-k and top-p (sampler.draw_drafts).
    With a `tree` (paths of ranks, parents first), the tree's rounds instead
    (`tree_rounds`), and its nodes' tokens `[nodes, S]`."""
    head: EagleHead = nnx.merge(graphdef, params)
    target = nnx.merge(target_graphdef, target_params)
    meta = batch.attn
    d, s = meta.num_seqs.shape[0], meta.kv_lens.shape[0]
    single = d == 1
    index = global_slots(meta.slot_mapping, features.shape[0] // d, d)
    feats = features.at[index].get(mode="fill", fill_value=0)
    hidden, kv = head(embed(target, batch.input_ids), feats, batch.positions, kv, meta,
                      from_target=True)
    hidden = sampled_rows(hidden, batch.sample_index, d)  # [S, H]: each sequence's last pair
    rows = batch.num_rows[0] if single else None
    logits = head.logits(hidden, target, rows)
    if tree is not None:
        cu, seq_real = seqs_as_tokens(meta)
        return (*tree_rounds(head, target, kv, meta, hidden, logits, seq_real & (limits > 0),
                             cu, seq_real, tree, page_size, drop_slot), probs)

    def guess(logits, j, probs):  # round j + 1's guesses as target ids; `probs` updated
        return round_guesses(logits, batch.sampling, j, probs, max_num_seqs, head.to_target,
                             sorts)

    ids, probs = guess(logits, 0, probs)

    def round_(j, state):  # one token per sequence, the guess of the round before
        kv, ids, hidden, out, probs = state
        pos, attn = round_metadata(meta, j, limits, page_size, drop_slot)
        hidden, kv = head(embed(target, ids), hidden, pos, kv, attn, from_target=False)
        ids, probs = guess(head.logits(hidden, target, rows), j, probs)
        return kv, ids, hidden, out.at[j].set(ids), probs

    out = jnp.zeros((rounds + 1, s), jnp.int32).at[0].set(ids)
    kv, _, _, out, probs = jax.lax.fori_loop(1, rounds + 1, round_,
                                             (kv, ids, hidden, out, probs))
    return kv, out, probs


def tree_rounds(head: EagleHead, target, kv: tuple, meta: AttentionMetadata,
                hidden: jax.Array, logits: jax.Array, writes: jax.Array, cu: jax.Array,
                seq_real: jax.Array, tree: tuple[tuple[int, ...], ...], page_size: int,
                drop_slot: int) -> tuple[tuple, jax.Array]:
    """A tree's rounds after round 1 (whose last pair's output `hidden` and `logits` are
    each sequence's, `[S, ...]`), depth by depth: the nodes of a depth that have children
    are fed together, node j of each sequence at KV position kv_lens + j (written where
    `writes`), rope position kv_lens - 1 + its depth, its parent's output as features,
    and its tree mask; its children take its top guesses by their ranks. Returns the
    cache and the nodes' tokens `[nodes, S]`."""
    s = meta.kv_lens.shape[0]
    single = meta.num_seqs.shape[0] == 1
    parents, depths = trees.paths_parents(tree), [len(p) for p in tree]
    masks = trees.masks(parents)
    children = {j: [c for c, p in enumerate(parents) if p == j]
                for j in (-1, *range(len(tree)))}

    def tops(logits: jax.Array, kids: list[int]) -> jax.Array:  # [rows, top] target ids
        return head.to_target(jax.lax.top_k(logits, 1 + max(tree[c][-1] for c in kids))[1])

    tokens: list[jax.Array | None] = [None] * len(tree)
    outputs, guesses = {-1: hidden}, {-1: tops(logits, children[-1])}  # by node (-1: root)
    for depth in range(1, max(depths) + 1):
        for j in (j for j in range(len(tree)) if depths[j] == depth):
            tokens[j] = guesses[parents[j]][:, tree[j][-1]]
        fed = [j for j in range(len(tree)) if depths[j] == depth and children[j]]
        if not fed:
            break
        n = len(fed)
        slots = jnp.stack([position_slots(meta.page_indices, meta.kv_lens + j, page_size)
                           for j in fed], axis=1).reshape(-1)
        attn = AttentionMetadata(
            slot_mapping=jnp.where(jnp.repeat(writes, n), slots, drop_slot),
            cu_q_lens=cu * n, kv_lens=jnp.where(seq_real, meta.kv_lens + max(fed) + 1, 0),
            page_indices=meta.page_indices, num_seqs=meta.num_seqs,
            tree_start=jnp.where(seq_real, meta.kv_lens, jnp.iinfo(jnp.int32).max),
            tree_mask=jnp.tile(jnp.asarray(masks[fed]), s))
        ids = jnp.stack([tokens[j] for j in fed], axis=1).reshape(-1)
        feats = jnp.stack([outputs[parents[j]] for j in fed], axis=1).reshape(s * n, -1)
        out, kv = head(embed(target, ids), feats, jnp.repeat(meta.kv_lens - 1 + depth, n),
                       kv, attn, from_target=False)
        kids = [c for j in fed for c in children[j]]
        top = tops(head.logits(out, target, meta.num_seqs[0] * n if single else None), kids)
        top, out = top.reshape(s, n, -1), out.reshape(s, n, -1)
        for i, j in enumerate(fed):
            outputs[j], guesses[j] = out[:, i], top[:, i]
    return kv, jnp.stack(tokens)


class EagleProposer(DeviceProposer):
    """EAGLE's proposer; `target` is the engine's runner,
    whose step writes the features (`ModelRunner.features_from`). With a `tree` (paths of
    ranks) it proposes trees of that shape, cut to the depth each sequence may take."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, shard: ShardingContext,
                 kv_abstract: tuple[jax.ShapeDtypeStruct, ...], target: ModelRunner,
                 max_num_batched_tokens: int, k: int,
                 tree: tuple[tuple[int, ...], ...] | None = None):
        assert target.features is not None
        super().__init__(dataclasses.replace(target.builder, num_speculative_tokens=0,
                                             draft_model=True), target)
        self.tree = tree
        self._cuts = trees.cuts(tree) if tree else {}
        self.max_num_batched_tokens = max_num_batched_tokens
        self.params = params
        self._param_leaves = jax.tree.leaves(params)
        self._kv_abstract = kv_abstract
        self.kv = self._zero_kv()
        num_slots = self.builder.num_pages * self.builder.page_size
        program = functools.partial(draft, rounds=k - 1, max_num_seqs=self.builder.max_num_seqs,
                                    page_size=self.builder.page_size, drop_slot=num_slots,
                                    tree=tree)
        target_tree, tree = jax.tree.structure(target.params), jax.tree.structure(params)

        layout = self.builder.layout
        replicated = shard.sharding(())
        kv_shardings = tuple(x.sharding for x in kv_abstract)

        def jitted(sorts: bool | None):
            def on_leaves(target_leaves, leaves, *args):  # as programs.on_param_leaves
                *args, carry = args
                kv, guesses, probs = program(
                    graphdef, jax.tree.unflatten(tree, leaves), target.graphdef,
                    jax.tree.unflatten(target_tree, target_leaves), *args, sorts=sorts)
                return kv, write_guesses(carry, guesses, layout), probs

            return jax.jit(
                on_leaves, donate_argnums=(2, 6),
                in_shardings=([x.sharding for x in target.param_leaves],
                              [x.sharding for x in self._param_leaves], kv_shardings,
                              target.features.sharding, replicated, replicated, replicated,
                              replicated),
                out_shardings=(kv_shardings, replicated, replicated))

        self._draft = {sorts: jitted(sorts) for sorts in self.sorts()}

    def _zero_kv(self) -> tuple:
        return ModelRunner.zeros(tuple(self._kv_abstract))

    def recover(self) -> None:
        if any(x.is_deleted() for x in self.kv):
            self.kv = self._zero_kv()

    def propose_batch(self, entries: list[tuple[Sequence, int]], scheduler: Scheduler,
                      pending: dict[Sequence, tuple[int, int]] | None = None
                      ) -> list[Drafts]:
        """Drafts for each (sequence, at most k: a tree's depth) of the coming step: as
        PLACEHOLDERs, the guesses left on the device where the target's next step reads
        them (their `device_index` in the runner's carry)."""
        shards = self.builder.data_shards
        drafts = [NO_DRAFTS] * len(entries)
        # Pairs up to the newest token's predecessor (the newest has no features yet); a
        # tree's nodes take the slots after it, a chain's rounds k - 1 of them.
        ahead = (lambda k: len(self.tree) - 1) if self.tree else (lambda k: k - 1)
        first, want = first_round(entries, scheduler, self.max_num_batched_tokens, lag=1,
                                  ahead=ahead)
        if not first:
            return drafts
        out = SchedulerOutput([s for _, s in first], [], sum(s.num_new_tokens for _, s in first))
        batch, key = self.builder.build(out)
        shard_t, shard_r = key.tokens // shards, key.rows // shards
        limits = np.zeros(key.seqs, np.int32)
        for i, sched in first:
            # Pair p's input is token p + 1 (all on the host: speculating steps are synced).
            last = (sched.row // shard_r) * shard_t + batch.sample_index[sched.row]
            seq, start, n = sched.seq, sched.start, sched.num_new_tokens
            writable(batch, "input_ids")[last - n + 1:last + 1] = \
                seq.token_ids[start + 1:start + n + 1]
            limits[sched.row] = want.get(i, 1) - 1
        self.run(batch, key, limits)
        for i, sched in first:
            if i not in want:
                continue
            nodes, parents = (self._cuts[min(want[i], len(self._cuts))] if self.tree
                              else (range(want[i]), None))
            drafts[i] = Drafts([PLACEHOLDER] * len(nodes), parents,
                               [self.builder.layout.guess(j, sched.row) for j in nodes])
        return drafts

    def _run(self, inputs: StepBatch, key: BucketKey, limits: np.ndarray,
             sorts: bool | None) -> jax.Array:
        self.kv, out, self.target.draft_probs = self._draft[sorts](
            self.target.param_leaves, self._param_leaves, self.kv, self.target.features,
            inputs, limits, self.target.draft_probs, self.target.carry)
        return out
