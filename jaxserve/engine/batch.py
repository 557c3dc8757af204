"""The step's input: a flat ragged batch of numpy arrays, padded to a (tokens, seqs) bucket.

Only T (tokens) varies, over a few buckets; a batch of T tokens has room for
S = min(T, max_num_seqs) sequences, so the number of compiled programs is finite.
Penalties need every sequence's token history, so batches that use them carry a
`TokenHistory` (filled by `fill_history`) and sample with a separate program.

The step samples R rows: one per sequence (R = S), or, in a step verifying speculative
drafts (`BucketKey.drafts` k > 0), one per draft and one more for each sequence (R =
min(T, S * (k + 1)), the most a batch can need). `sample_index` says which token's logits
each row samples; the sampling arrays are per row. A step verifying trees of drafts
(`BucketKey.tree`: Medusa's or EAGLE's candidate trees, speculative/drafts.py) also
carries the tree masks in its AttentionMetadata, and k counts a tree's nodes.

With D data-parallel shards every array is D equal blocks (T/D tokens, S/D sequences
each), block d holding the sequences placed in shard d, with token offsets, slots and
page ids local to that shard (AttentionMetadata). The bucket is chosen by the busiest
shard.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from jaxserve.engine.request import PLACEHOLDER, Sequence
from jaxserve.engine.sampler import SamplingArrays, TokenHistory
from jaxserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.engine.speculative import drafts as trees
from jaxserve.models.transformer import AttentionMetadata
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    attn: AttentionMetadata
    sampling: SamplingArrays
    # [T]: for a token whose id is still on the device (a PLACEHOLDER, sampled by the step
    # before, or a draft a proposer left there), where in the carry to read it
    # (CarryLayout); else -1.
    prev_index: np.ndarray
    # [R]: the token (index within its data shard's block) each sampled row reads the
    # logits of; [D]: the real rows per data shard (they come first in each shard's block).
    sample_index: np.ndarray
    num_rows: np.ndarray
    # bool []: compute Medusa heads' guesses at the sampled rows (when the model has them)
    propose: np.ndarray
    # [S]: for a sequence whose newest tokens a step still in flight with drafts emits
    # (1 to k + 1 of them: the host counts k + 1), that step's first sampled row of it,
    # whose entry in the carry's acceptance blocks says how many of its drafts were
    # rejected, by which its positions here move back (device.resolve_pending); -1: none.
    shift_row: np.ndarray
    history: TokenHistory | None = None


class BucketKey(NamedTuple):
    """The shapes of one compiled step program, all data shards together."""

    tokens: int  # T
    seqs: int  # S
    history: bool  # carries every sequence's token history (penalties)
    drafts: int = 0  # k: most drafts a sequence verifies (0: no speculation)
    tree: bool = False  # the drafts may be trees (the attention takes tree masks)

    @property
    def rows(self) -> int:
        """R, the sampled rows (all data shards: T and S divide by their count)."""
        return min(self.tokens, self.seqs * (self.drafts + 1)) if self.drafts else self.seqs


@dataclasses.dataclass(frozen=True)
class CarryLayout:
    """The layout of the carry, the device array a step reads its tokens still on the
    device from (`StepBatch.prev_index`), written by the step's sampling and by a
    proposer's program (ModelRunner.carry):
    - [0, max_num_seqs): the step before's samples, row r at r;
    - a proposer's guesses: guess j of row r at max_num_seqs x (1 + j) + r, up to
      `guesses_end`;
    - with `rows` > 0 (steps verifying a draft model's chains may be dispatched while the
      step before them is in flight: `overlap`), three blocks of `rows` entries, one per
      sampled row of the step before, filled at each sequence's first row: the token
      its step emits last (the sample after its accepted drafts, `bonus`), the token
      before it (`last`) and how many of its drafts were rejected (`rejected`).
    """

    max_num_seqs: int
    k: int = 0  # guesses per row
    rows: int = 0  # the acceptance blocks' length (0: none)

    @property
    def overlap(self) -> bool:
        return self.rows > 0

    @property
    def guesses_end(self) -> int:
        return self.max_num_seqs * (1 + self.k)

    @property
    def bonus(self) -> int:
        return self.guesses_end

    @property
    def last(self) -> int:
        return self.bonus + self.rows

    @property
    def rejected(self) -> int:
        return self.last + self.rows

    @property
    def size(self) -> int:
        return self.rejected + self.rows

    def guess(self, j: int, row: int) -> int:
        """Where guess j (0-based) of row `row` lies."""
        return self.max_num_seqs * (1 + j) + row


@dataclasses.dataclass
class BatchBuilder:
    token_buckets: tuple[int, ...]
    max_num_seqs: int
    page_size: int
    num_pages: int  # per data shard
    pages_per_seq: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int  # of the logits, for the grammar mask's width
    data_shards: int = 1
    num_speculative_tokens: int = 0  # k of the speculating buckets (0: none)
    tree: bool = False  # the speculating buckets verify trees (k nodes at most)
    # A proposer's batches (draft_model.py, eagle.py): no drafts and no history (its
    # program draws its guesses with the rows' sampling parameters: `draw_drafts`).
    draft_model: bool = False
    # Sampled requests' chain drafts are drawn from the proposer's distributions: the
    # target's rows verify them by rejection sampling (SamplingArrays.draft_index).
    sampled_drafts: bool = False
    # The carry's layout: where PLACEHOLDER tokens are read from on the device (default:
    # the samples and k guesses per row, no acceptance blocks); a proposer's builder
    # shares its target's.
    layout: CarryLayout | None = None
    _open_masks: dict[int, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = CarryLayout(self.max_num_seqs, self.num_speculative_tokens)

    def bucket(self, num_tokens: int, history: bool, drafts: bool = False) -> BucketKey:
        """The bucket for `num_tokens` tokens in the busiest shard (`drafts`: a step that
        verifies drafts)."""
        d = self.data_shards
        shard_buckets = sorted({-(-t // d) for t in self.token_buckets})
        t = shard_buckets[bisect.bisect_left(shard_buckets, num_tokens)]
        return BucketKey(d * t, d * min(t, self.max_num_seqs // d), history,
                         self.num_speculative_tokens if drafts else 0, self.tree and drafts)

    def all_buckets(self) -> list[BucketKey]:
        """Every bucket a schedule can produce."""
        return sorted({self.bucket(-(-t // self.data_shards), h, k)
                       for h in (False, True) for t in self.token_buckets
                       for k in {False, self.num_speculative_tokens > 0}})

    def decode_buckets(self) -> list[BucketKey]:
        """The buckets of batches of decoding sequences without drafts or history (those
        that may run several decode steps in one program: programs.decode_steps)."""
        d = self.data_shards
        return sorted({self.bucket(s, False) for s in range(1, self.max_num_seqs // d + 1)})

    def build(self, out: SchedulerOutput,
              pending: dict[Sequence, tuple[int, int]] | None = None
              ) -> tuple[StepBatch, BucketKey]:
        """The batch of a schedule; sets each scheduled seq's `row` in the step's sampled
        outputs. `pending` has, for each seq whose newest tokens the step still in flight
        emits (PLACEHOLDERs), its first row in that step's outputs and its drafts there:
        the step reads the tokens from the device (the carry), and with drafts moves the
        seq's positions back by those rejected (`StepBatch.shift_row`)."""
        d = self.data_shards
        pending = pending or {}
        tokens = [0] * d
        for x in out.scheduled:
            tokens[x.seq.data_shard] += x.num_new_tokens
        history = not self.draft_model and any(x.seq.params.uses_penalties
                                               for x in out.scheduled)
        # A seq whose pending step had drafts moves back by those rejected: only a bucket
        # with drafts does that (programs.forward's `verifies`).
        drafts = any(x.drafts or pending.get(x.seq, (0, 0))[1] for x in out.scheduled)
        key = self.bucket(max(tokens), history, drafts)
        batch = self.empty(key)
        shard_t, shard_s, shard_r = key.tokens // d, key.seqs // d, key.rows // d
        # Per data shard: seqs placed, tokens placed, rows placed.
        counts, ends, rows = [0] * d, [0] * d, [0] * d
        for sched in out.scheduled:
            shard = sched.seq.data_shard
            i, local = shard * shard_s + counts[shard], ends[shard]
            sched.row = shard * shard_r + rows[shard]
            self._place(batch, sched, i, shard * shard_t + local, local, pending)
            counts[shard] += 1
            rows[shard] += 1 + len(sched.drafts)
            ends[shard] = local + sched.num_new_tokens
            batch.attn.cu_q_lens[shard * (shard_s + 1) + counts[shard]] = ends[shard]
        for shard in range(d):
            block = shard * (shard_s + 1)
            batch.attn.cu_q_lens[block + counts[shard] + 1:block + shard_s + 1] = ends[shard]
        batch.attn.num_seqs[:] = counts
        batch.num_rows[:] = rows
        return batch, key

    def _place(self, batch: StepBatch, sched: ScheduledSeq, i: int, t: int, local: int,
               pending: dict[Sequence, tuple[int, int]]) -> None:
        """Lay out one scheduled seq: sequence slot `i`, its tokens from `t` (`local` within
        its data shard's block), its sampled rows from `sched.row`."""
        seq, start, n, r = sched.seq, sched.start, sched.num_new_tokens, sched.row
        num_rows = 1 + len(sched.drafts)
        own = n - len(sched.drafts)  # the chunk's tokens that are the seq's own
        # Row j samples the logits of the chunk's (len(drafts) - j + 1)-th last token.
        batch.sample_index[r:r + num_rows] = np.arange(local + n - num_rows, local + n)
        batch.input_ids[t:t + own] = seq.token_ids[start:start + own]
        for j in np.flatnonzero(batch.input_ids[t:t + own] == PLACEHOLDER):
            batch.input_ids[t + j] = 0
            batch.prev_index[t + j] = self._pending_token(*pending[seq], start + j,
                                                          seq.num_tokens)
        if pending.get(seq, (0, 0))[1]:  # its pending step had drafts
            batch.shift_row[i] = pending[seq][0]
            batch.sampling.shift_row[r:r + num_rows] = pending[seq][0]
        pos = np.arange(start, start + n, dtype=np.int32)
        pages = np.asarray(seq.page_ids, dtype=np.int32)
        batch.positions[t:t + n] = pos
        batch.attn.slot_mapping[t:t + n] = (pages[pos // self.page_size] * self.page_size
                                            + pos % self.page_size)
        batch.attn.kv_lens[i] = start + n
        batch.attn.page_indices[i, :len(pages)] = pages
        depth = self._place_drafts(batch, sched, i, t + own)
        for j in range(num_rows):
            self._fill_sampling(batch.sampling, r + j, seq.params, seq, depth[j - 1] if j else 0)

    def _place_drafts(self, batch: StepBatch, sched: ScheduledSeq, i: int, t: int
                      ) -> list[int]:
        """A seq's drafts after its own tokens (from token `t`): their ids (or where they
        lie on the device), a chain's count for the acceptance on the device, a tree's
        positions and masks, and where sampled drafts' distributions lie. Returns each
        draft's depth (its row's lookahead)."""
        drafts, r, n = sched.drafts, sched.row, len(sched.drafts)
        if drafts.on_device:
            batch.prev_index[t:t + n] = drafts.device_index
        else:
            batch.input_ids[t:t + n] = drafts.tokens
        if drafts and drafts.parents is None:
            batch.sampling.group_drafts[r] = n
        depth = list(range(1, n + 1))
        if drafts.parents is not None:  # a tree: its nodes' own positions and masks
            depth = trees.depths(drafts.parents)
            root = sched.start + sched.num_new_tokens - n - 1  # the seq's last token's
            batch.positions[t:t + n] = root + np.asarray(depth)
            batch.attn.tree_start[i] = root + 1
            batch.attn.tree_mask[t:t + n] = trees.masks(drafts.parents)
        if (self.sampled_drafts and drafts.on_device and drafts.parents is None
                and sched.seq.params.temperature > 0):
            # Draft j's distribution: SampledDrafts row max_num_seqs x j + r.
            batch.sampling.draft_index[r:r + n] = (np.asarray(drafts.device_index)
                                                   - self.max_num_seqs)
        return depth

    def _pending_token(self, row: int, drafts: int, position: int, num_tokens: int) -> int:
        """Where in the carry the token at `position` (a PLACEHOLDER) of a seq of
        `num_tokens` tokens lies, whose pending step's first row is `row`: the seq's newest
        token is the last that step emits (its sample, or with drafts the one after those
        kept: with `CarryLayout.overlap` read from its `bonus` block, which a proposer's
        guesses never overwrite), and after a step with `drafts` the one before it may be read too
        (a draft model's round 1 feeds both)."""
        if position == num_tokens - 1:
            return self.layout.bonus + row if self.layout.overlap else row
        assert drafts and position == num_tokens - 2, (
            "only the newest tokens of a seq can be still on the device")
        return self.layout.last + row

    @staticmethod
    def fill_history(batch: StepBatch, out: SchedulerOutput) -> None:
        """Each row's tokens up to the one whose logits it samples, for penalties: the
        sequence's own tokens, then the drafts before the row's. Call it once they are all
        on the host (the newest may have been a PLACEHOLDER at `build`: the engine samples
        such a step apart, after the step before is in). In a tree, the drafts before a
        row are its node's path."""
        for sched in out.scheduled:
            drafts = sched.drafts
            own = sched.start + sched.num_new_tokens - len(drafts)
            for j in range(1 + len(drafts)):
                tokens = sched.seq.token_ids[:own] + [
                    drafts.tokens[i] for i in trees.path(drafts.tree, j - 1)]
                batch.history.tokens[sched.row + j, :len(tokens)] = tokens
                batch.history.prompt_lens[sched.row + j] = sched.seq.num_prompt_tokens

    def _fill_sampling(self, a: SamplingArrays, i: int, p: SamplingParams, seq,
                       ahead: int = 0) -> None:
        """Row `i` samples the sequence's output number len(outputs) + `ahead`."""
        a.temperature[i] = p.temperature
        a.top_k[i] = max(p.top_k, 0)
        a.top_p[i] = p.top_p
        a.min_p[i] = p.min_p
        a.presence_penalty[i] = p.presence_penalty
        a.frequency_penalty[i] = p.frequency_penalty
        a.repetition_penalty[i] = p.repetition_penalty
        a.seed[i] = p.seed
        a.output_index[i] = len(seq.output_token_ids) + ahead
        a.logprobs[i] = p.logprobs is not None
        if p.logit_bias:
            a.bias_ids[i, :len(p.logit_bias)] = list(p.logit_bias)
            a.bias_values[i, :len(p.logit_bias)] = list(p.logit_bias.values())
        if len(seq.output_token_ids) + ahead < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            a.banned_ids[i, :len(banned)] = banned[:MAX_STOP_TOKEN_IDS]

    def open_mask(self, num_rows: int) -> np.ndarray:
        """The grammar mask of a batch without grammars: one shared, read-only array per
        size, which the runner swaps for a copy it keeps on the device (no transfer). A
        batch with grammars gets its own (Engine fills it)."""
        if num_rows not in self._open_masks:
            mask = np.full((num_rows, (self.vocab_size + 31) // 32), -1, np.int32)
            mask.flags.writeable = False
            self._open_masks[num_rows] = mask
        return self._open_masks[num_rows]

    def empty(self, key: BucketKey) -> StepBatch:
        """An all-padding batch of the bucket's shapes (also used to compile it)."""
        t, s, history = key.tokens, key.seqs, key.history
        r = key.rows
        i32 = np.int32
        return StepBatch(
            input_ids=np.zeros(t, i32),
            positions=np.zeros(t, i32),
            prev_index=np.full(t, -1, i32),
            sample_index=np.zeros(r, i32),
            num_rows=np.zeros(self.data_shards, i32),
            propose=np.zeros((), np.bool_),
            shift_row=np.full(s, -1, i32),
            attn=AttentionMetadata(
                slot_mapping=np.full(t, self.num_pages * self.page_size, i32),
                cu_q_lens=np.zeros(s + self.data_shards, i32),
                kv_lens=np.zeros(s, i32),
                page_indices=np.zeros((s, self.pages_per_seq), i32),
                num_seqs=np.zeros(self.data_shards, i32),
                # No tree unless one is laid out: every sequence's tree starts past its end.
                tree_start=np.full(s, np.iinfo(i32).max, i32) if key.tree else None,
                tree_mask=np.zeros(t, i32) if key.tree else None,
            ),
            sampling=SamplingArrays(
                temperature=np.zeros(r, np.float32),
                top_k=np.zeros(r, i32),
                top_p=np.ones(r, np.float32),
                min_p=np.zeros(r, np.float32),
                presence_penalty=np.zeros(r, np.float32),
                frequency_penalty=np.zeros(r, np.float32),
                repetition_penalty=np.ones(r, np.float32),
                seed=np.zeros(r, np.uint32),
                output_index=np.zeros(r, i32),
                banned_ids=np.full((r, MAX_STOP_TOKEN_IDS), -1, i32),
                logprobs=np.zeros(r, np.bool_),
                bias_ids=np.full((r, MAX_LOGIT_BIAS), -1, i32),
                bias_values=np.zeros((r, MAX_LOGIT_BIAS), np.float32),
                grammar_mask=self.open_mask(r),
                draft_index=np.full(r, -1, i32),
                shift_row=np.full(r, -1, i32),
                group_drafts=np.zeros(r, i32),
            ),
            history=TokenHistory(
                tokens=np.full((r, self.max_model_len), -1, i32),
                prompt_lens=np.zeros(r, i32),
            ) if history else None,
        )
