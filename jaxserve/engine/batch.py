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
import itertools
from typing import NamedTuple

import jax
import numpy as np

from jaxserve.engine.persistent_batch import PersistentBatch
from jaxserve.engine.request import PLACEHOLDER, Sequence
from jaxserve.engine.sampler import SamplingArrays, TokenHistory
from jaxserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.engine.speculative import drafts as trees
from jaxserve.models.transformer import AttentionMetadata
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

_NO_PENDING = (-1, 0)  # a seq without a step in flight: first row -1, no drafts


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
    # [T]: each token's LoRA adapter slot (0: none; padding 0); None when LoRA is off.
    lora_slots: np.ndarray | None = None
    # [T]: for an image's token, the row of its embedding in the image encoder's buffer
    # (multimodal/); else -1. None for a text-only model.
    image_rows: np.ndarray | None = None
    # [3, T]: M-RoPE (Qwen2.5-VL): what each token's time, height and width positions add
    # to its position (Sequence.rope_offsets); None for the usual rope.
    rope_offsets: np.ndarray | None = None


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
    # Batches carry each token's LoRA adapter slot (`StepBatch.lora_slots`, from
    # `Sequence.lora_slot`).
    lora: bool = False
    # Batches carry each image token's row of embeddings (`StepBatch.image_rows`, from
    # `Sequence.images`).
    images: bool = False
    # Batches carry M-RoPE offsets (`StepBatch.rope_offsets`).
    mrope: bool = False
    # Images are seen whole: batches carry each image token's image end
    # (`AttentionMetadata.image_end`; Gemma 3).
    whole_images: bool = False
    _open_masks: dict[int, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)
    # Each sequence's page-table row and sampling parameters, kept across steps.
    rows: PersistentBatch = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = CarryLayout(self.max_num_seqs, self.num_speculative_tokens)
        self.rows = PersistentBatch(2 * self.max_num_seqs, self.pages_per_seq,
                                    self.eos_token_ids)
        # The token buckets of one data shard's block, ascending.
        self._shard_buckets = sorted({-(-t // self.data_shards) for t in self.token_buckets})
        self._empty: dict[BucketKey, StepBatch] = {}
        self._buckets: dict[tuple[int, bool, bool], BucketKey] = {}  # bucket()'s, by its args

    def bucket(self, num_tokens: int, history: bool, drafts: bool = False) -> BucketKey:
        """The bucket for `num_tokens` tokens in the busiest shard (`drafts`: a step that
        verifies drafts)."""
        key = self._buckets.get((num_tokens, history, drafts))
        if key is None:
            d = self.data_shards
            t = self._shard_buckets[bisect.bisect_left(self._shard_buckets, num_tokens)]
            key = self._buckets[num_tokens, history, drafts] = BucketKey(
                d * t, d * min(t, self.max_num_seqs // d), history,
                self.num_speculative_tokens if drafts else 0, self.tree and drafts)
        return key

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
        outputs and its chunk's first `token` in the batch. `pending` has, for each seq
        whose newest tokens the step still in flight emits (PLACEHOLDERs), its first row in
        that step's outputs and its drafts there: the step reads the tokens from the device
        (the carry), and with drafts moves the seq's positions back by those rejected
        (`StepBatch.shift_row`).

        Whole-array numpy over the schedule's columns: a Python loop per sequence only
        reads them (and their tokens: one for a decode); only sequences with drafts are
        laid out one at a time."""
        d, scheduled, pending = self.data_shards, out.scheduled, pending or {}
        seqs = [s.seq for s in scheduled]
        seats = self.rows.seats(seqs)
        # With each seq's pending step: its first row there and its drafts (-1, 0: none).
        cols = np.fromiter(itertools.chain.from_iterable(
            (s.start, s.num_new_tokens, len(s.drafts.tokens), q.data_shard,
             len(q.output_token_ids), len(q.prompt_token_ids)) + pending.get(q, _NO_PENDING)
            for s, q in zip(scheduled, seqs)), np.int64, 8 * len(seqs)).reshape(-1, 8)
        start, n, ndrafts, shard, num_out, num_prompt = cols[:, :6].T
        num_tokens, pend = num_out + num_prompt, cols[:, 6:]
        decodes = out.num_batched_tokens == len(scheduled)  # a token each: no drafts
        any_drafts = not decodes and bool(ndrafts.any())
        history = not self.draft_model and self.rows.any_penalties(seats)
        # A seq whose pending step had drafts moves back by those rejected: only a bucket
        # with drafts does that (programs.forward's `verifies`). (Seqs of the pending step
        # not scheduled now need nothing.)
        pending_drafts = bool(pend[:, 1].any()) if pending else False
        tokens = np.bincount(shard, n, d) if d > 1 else n.sum(keepdims=True)
        key = self.bucket(int(tokens.max()), history, any_drafts or pending_drafts)
        batch = self.empty(key)
        shard_t, shard_s, shard_r = key.tokens // d, key.seqs // d, key.rows // d
        rows = 1 + ndrafts
        # Within its data shard: each seq's ordinal, first token and first row.
        if d == 1:
            ordinal = np.arange(len(seqs))
            local = ordinal if decodes else _starts(n)
            first_row = ordinal if decodes else _starts(rows)
        else:
            ordinal, local, first_row = (np.empty_like(n) for _ in range(3))
            for k in range(d):
                mine = shard == k
                ordinal[mine] = np.arange(np.count_nonzero(mine))
                local[mine] = _starts(n[mine])
                first_row[mine] = _starts(rows[mine])
        i = shard * shard_s + ordinal  # the seq's index among the batch's
        row = shard * shard_r + first_row
        t = shard * shard_t + local  # the seq's first token in the batch
        for s, r, first in zip(scheduled, row.tolist(), t.tolist()):
            s.row, s.token = r, first
        attn, sampling = batch.attn, batch.sampling
        counts = np.bincount(shard, minlength=d) if d > 1 else [len(seqs)]
        writable(attn, "num_seqs")[:] = counts
        writable(batch, "num_rows")[:] = np.bincount(shard, rows, d) if d > 1 else rows.sum()
        cu_q_lens = writable(attn, "cu_q_lens")
        if d == 1:
            cu_q_lens[1:len(seqs) + 1] = local + n
        else:
            cu_q_lens[shard * (shard_s + 1) + ordinal + 1] = local + n
        for k in range(d):
            block = k * (shard_s + 1)
            cu_q_lens[block + counts[k] + 1:block + shard_s + 1] = tokens[k]
        writable(attn, "kv_lens")[i] = start + n
        writable(attn, "page_indices")[i] = self.rows.page_table[seats]
        shift_row = np.where(pend[:, 1] > 0, pend[:, 0], -1) if pending_drafts else None
        if shift_row is not None:
            writable(batch, "shift_row")[i] = shift_row
        own = n - ndrafts  # the chunk's tokens that are the seq's own
        self._place_tokens(batch, scheduled, seats, t, start, n, own, pend, num_tokens,
                           pending_drafts)
        if batch.lora_slots is not None:  # every token of a seq's chunk, drafts too
            of_token, j = _segments(n)
            writable(batch, "lora_slots")[t[of_token] + j] = np.array(
                [q.lora_slot for q in seqs], np.int32)[of_token]
        if batch.image_rows is not None:
            for x in (x for x, q in enumerate(seqs) if q.images):
                _place_images(writable(batch, "image_rows"), seqs[x], int(t[x]),
                              int(start[x]), int(n[x]),
                              attn.image_end if attn.image_end is None
                              else writable(attn, "image_end"))
                if batch.rope_offsets is not None:
                    writable(batch, "rope_offsets")[:, t[x]:t[x] + n[x]] = seqs[x].rope_offsets_at(
                        int(start[x]), int(n[x]))
        dest, seat = self._place_rows(batch, seats, row, local + n, rows, num_out, shift_row)
        for x in np.flatnonzero(ndrafts) if any_drafts else ():
            self._place_drafts(batch, scheduled[x], int(i[x]), int(t[x] + own[x]))
        # Stop tokens banned from the rows sampling an output before min_tokens.
        banned = sampling.output_index[dest] < self.rows.min_tokens[seat]
        if banned.any():
            writable(sampling, "banned_ids")[dest[banned]] = self.rows.banned_ids[seat[banned]]
        return batch, key

    def _place_tokens(self, batch: StepBatch, scheduled: list[ScheduledSeq],
                      seats: np.ndarray, t: np.ndarray, start: np.ndarray, n: np.ndarray,
                      own: np.ndarray, pend: np.ndarray, num_tokens: np.ndarray,
                      pending_drafts: bool) -> None:
        """Each seq's chunk from token `t` on: token j is its position start + j, whose KV
        slot its page row gives; its own tokens' ids (or where in the carry those still on
        the device lie). Drafts' ids are `_place_drafts`'."""
        of_token, j = _segments(n)
        dest, pos = t[of_token] + j, start[of_token] + j
        writable(batch, "positions")[dest] = pos
        writable(batch.attn, "slot_mapping")[dest] = (
            self.rows.page_table[seats[of_token], pos // self.page_size] * self.page_size
            + pos % self.page_size)
        if len(dest) == len(scheduled):  # a token each (decodes)
            ids = np.fromiter((s.seq.token_at(s.start) for s in scheduled), np.int64,
                              len(scheduled))
        else:
            ids = np.fromiter(itertools.chain.from_iterable(
                s.seq.tokens(s.start, s.start + m) for s, m in zip(scheduled, own.tolist())),
                np.int64, int(own.sum()))
        if len(ids) < len(dest):  # drafts follow some seqs' own tokens
            is_own = j < own[of_token]
            dest, pos, of_token = dest[is_own], pos[is_own], of_token[is_own]
        writable(batch, "input_ids")[dest] = ids
        on_device = ids == PLACEHOLDER
        if on_device.any():
            of = np.arange(len(n))[of_token][on_device]
            dest, pos = dest[on_device], pos[on_device]
            batch.input_ids[dest] = 0
            self._pending_tokens(batch, dest, pos, pend[of], num_tokens[of], pending_drafts)

    def _place_rows(self, batch: StepBatch, seats: np.ndarray, first_row: np.ndarray,
                    end: np.ndarray, rows: np.ndarray, num_out: np.ndarray,
                    shift_row: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Each seq's `rows` sampled rows from `first_row` on: row j samples the logits of
        its chunk's (rows - j)-th last token (its chunk ends before token `end` of its data
        shard's block) with the seat's parameters, for output number `num_out` + j (a
        chain's row j is j drafts ahead; `_place_drafts` sets a tree's). Returns each
        row's place and seat."""
        a = batch.sampling
        of_row, j = _segments(rows)
        dest, seat = first_row[of_row] + j, seats[of_row]
        writable(batch, "sample_index")[dest] = (end - rows)[of_row] + j
        for name, values in self.rows.sampling_columns(seat):
            writable(a, name)[dest] = values
        writable(a, "output_index")[dest] = num_out[of_row] + j
        if shift_row is not None:
            writable(a, "shift_row")[dest] = shift_row[of_row]
        return dest, seat

    def _pending_tokens(self, batch: StepBatch, dest: np.ndarray, pos: np.ndarray,
                        pend: np.ndarray, num_tokens: np.ndarray, pending_drafts: bool
                        ) -> None:
        """Where in the carry the PLACEHOLDER tokens at `dest` (positions `pos` of seqs of
        `num_tokens` tokens) lie, whose pending steps' first rows and drafts are `pend`: a
        seq's newest token is the last that step emits (its sample, or with drafts the one
        after those kept: with `CarryLayout.overlap` read from its `bonus` block, which a
        proposer's guesses never overwrite), and after a step with drafts the one before
        it may be read too (a draft model's round 1 feeds both)."""
        first = pend[:, 0]
        assert (first >= 0).all(), "a token on the device without a pending step"
        sample = self.layout.bonus + first if self.layout.overlap else first
        if not pending_drafts:  # only a seq's newest token can be on the device
            writable(batch, "prev_index")[dest] = sample
            return
        newest = pos == num_tokens - 1
        assert (newest | (pend[:, 1] > 0) & (pos == num_tokens - 2)).all(), (
            "only the newest tokens of a seq can be still on the device")
        writable(batch, "prev_index")[dest] = np.where(newest, sample, self.layout.last + first)

    def _place_drafts(self, batch: StepBatch, sched: ScheduledSeq, i: int, t: int) -> None:
        """A seq's drafts after its own tokens (from token `t`; `i` its index among the
        batch's seqs): their ids (or where they lie on the device), a chain's count for
        the acceptance on the device, a tree's positions, masks and its rows' lookahead,
        and where sampled drafts' distributions lie."""
        drafts, r, n = sched.drafts, sched.row, len(sched.drafts)
        if drafts.on_device:
            writable(batch, "prev_index")[t:t + n] = drafts.device_index
        else:
            writable(batch, "input_ids")[t:t + n] = drafts.tokens
        if drafts.parents is None:
            writable(batch.sampling, "group_drafts")[r] = n
        else:  # a tree: its nodes' own positions and masks, and each node's depth ahead
            depth = np.asarray(trees.depths(drafts.parents))
            root = sched.start + sched.num_new_tokens - n - 1  # the seq's last token's
            writable(batch, "positions")[t:t + n] = root + depth
            writable(batch.attn, "tree_start")[i] = root + 1
            writable(batch.attn, "tree_mask")[t:t + n] = trees.masks(drafts.parents)
            writable(batch.sampling, "output_index")[r + 1:r + 1 + n] = \
                len(sched.seq.output_token_ids) + depth
        if (self.sampled_drafts and drafts.on_device and drafts.parents is None
                and sched.seq.params.temperature > 0):
            # Draft j's distribution: SampledDrafts row max_num_seqs x j + r.
            writable(batch.sampling, "draft_index")[r:r + n] = (
                np.asarray(drafts.device_index) - self.max_num_seqs)

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
                writable(batch.history, "tokens")[sched.row + j, :len(tokens)] = tokens
                writable(batch.history, "prompt_lens")[sched.row + j] = sched.seq.num_prompt_tokens

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
        """An all-padding batch of the bucket's shapes (also used to compile it). Its
        arrays are the bucket's templates, made once, read-only and shared by every batch
        of the bucket: whoever fills a field takes a copy of it first (`writable`). A
        batch copies the fields its step writes only (a decode: 11 of ~30; copying all
        of them cost ~30 us a step), and never writes into an array an earlier batch
        holds: a CPU program may read its numpy arguments in place while it runs."""
        if key not in self._empty:
            self._empty[key] = _read_only(self._make_empty(key))
        return _shallow(self._empty[key])

    def _make_empty(self, key: BucketKey) -> StepBatch:
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
                image_end=np.full(t, -1, i32) if self.whole_images else None,
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
            lora_slots=np.zeros(t, i32) if self.lora else None,
            image_rows=np.full(t, -1, i32) if self.images else None,
            rope_offsets=np.zeros((3, t), i32) if self.mrope else None,
        )


def _place_images(image_rows: np.ndarray, seq: Sequence, t: int, start: int, n: int,
                  image_end: np.ndarray | None = None) -> None:
    """The rows of the embeddings of `seq`'s image tokens among its chunk of `n` tokens
    from position `start` (at token `t` of the batch), and with `image_end` (images seen
    whole) each one's image's last position."""
    for span in seq.images:
        lo, hi = max(span.start, start), min(span.end, start + n)
        if lo < hi:
            assert span.slots is not None, "an image's tokens scheduled without its rows"
            image_rows[t + lo - start:t + hi - start] = span.slots[lo - span.start:hi - span.start]
            if image_end is not None:
                assert hi == span.end, "an image seen whole split across steps"
                image_end[t + lo - start:t + hi - start] = span.end - 1


def writable(obj, name: str) -> np.ndarray:
    """The array field `name` of `obj` (a batch or one of its parts), to write into: the
    object's own copy, taken now if the field still is a shared template (read-only)."""
    x = getattr(obj, name)
    if not x.flags.writeable:
        x = x.copy()
        setattr(obj, name, x)
    return x


def _shallow(batch: StepBatch) -> StepBatch:
    """A new StepBatch (and new parts: attention metadata, sampling arrays, history)
    holding the same arrays as `batch`."""
    y = _clone(batch)
    y.attn = _clone(batch.attn)
    y.sampling = _clone(batch.sampling)
    if batch.history is not None:
        y.history = _clone(batch.history)
    return y


def _clone(x):
    y = object.__new__(type(x))
    y.__dict__.update(x.__dict__)
    return y


def _read_only(x):
    """`x` (a dataclass of numpy arrays, nested) with all its arrays made read-only."""
    for v in x.__dict__.values():
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
        elif dataclasses.is_dataclass(v):
            _read_only(v)
    return x


def _segments(lengths: np.ndarray) -> tuple[np.ndarray | slice, np.ndarray | int]:
    """For segments of `lengths` laid end to end: each element's segment and its index
    within it, as `x[of] + j` reads them (when every length is 1, `slice(None)` and 0)."""
    total = int(lengths.sum())
    if total == len(lengths):  # one each (a batch of decodes): x[of] + j is x
        return slice(None), 0
    of = np.repeat(np.arange(len(lengths)), lengths)
    return of, np.arange(total) - _starts(lengths)[of]


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Where each segment of `lengths` laid end to end starts."""
    return np.add.accumulate(lengths) - lengths
