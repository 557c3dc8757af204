"""The step's input: a flat ragged batch of numpy arrays, padded to a (tokens, seqs) bucket.

Only T (tokens) varies, over a few buckets; a batch of T tokens has room for
S = min(T, max_num_seqs) sequences, so the number of compiled programs is finite. Penalties need every sequence's token history, so batches that use
them carry a `TokenHistory` and compile as a separate variant.
"""

from __future__ import annotations

import bisect
import dataclasses

import jax
import numpy as np

from jaxserve.engine.request import PLACEHOLDER
from jaxserve.engine.sampler import SamplingArrays, TokenHistory
from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.models.transformer import AttentionMetadata
from jaxserve.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    attn: AttentionMetadata
    sampling: SamplingArrays
    # [T]: for a token whose id is still on the device (a PLACEHOLDER, sampled by the step
    # before), the row of that step's sampled tokens to read it from; else -1.
    prev_index: np.ndarray
    history: TokenHistory | None = None


BucketKey = tuple[int, int, bool]  # (tokens, seqs, with token history)


@dataclasses.dataclass
class BatchBuilder:
    token_buckets: tuple[int, ...]
    max_num_seqs: int
    page_size: int
    num_pages: int
    pages_per_seq: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    def bucket(self, num_tokens: int, history: bool) -> BucketKey:
        t = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        return t, min(t, self.max_num_seqs), history

    def all_buckets(self) -> list[BucketKey]:
        """Every bucket a schedule can produce."""
        return [self.bucket(t, h) for h in (False, True) for t in self.token_buckets]

    def build(self, out: SchedulerOutput, prev_rows: dict[int, int] | None = None
              ) -> tuple[StepBatch, BucketKey]:
        """The batch of a schedule. `prev_rows` maps id(seq) to its row in the sampled
        tokens of the step still in flight, for seqs whose last token is a PLACEHOLDER."""
        seqs = [x.seq for x in out.scheduled]
        history = any(s.params.uses_penalties for s in seqs)
        key = self.bucket(out.num_batched_tokens, history)
        batch = self.empty(key)
        cu, t = batch.attn.cu_q_lens, 0
        for i, sched in enumerate(out.scheduled):
            seq, start, n = sched.seq, sched.start, sched.num_new_tokens
            pos = np.arange(start, start + n, dtype=np.int32)
            pages = np.asarray(seq.page_ids, dtype=np.int32)
            batch.input_ids[t:t + n] = seq.token_ids[start:start + n]
            if batch.input_ids[t + n - 1] == PLACEHOLDER:  # only the newest token can be
                batch.input_ids[t + n - 1] = 0
                batch.prev_index[t + n - 1] = prev_rows[id(seq)]
            batch.positions[t:t + n] = pos
            batch.attn.slot_mapping[t:t + n] = pages[pos // self.page_size] * self.page_size + pos % self.page_size
            t += n
            cu[i + 1] = t
            batch.attn.kv_lens[i] = start + n
            batch.attn.page_indices[i, :len(pages)] = pages
            self._fill_sampling(batch.sampling, i, seq.params, seq)
            if history:
                tokens = seq.token_ids
                batch.history.tokens[i, :len(tokens)] = tokens
                batch.history.prompt_lens[i] = seq.num_prompt_tokens
        cu[len(seqs) + 1:] = t
        batch.attn.num_seqs[...] = len(seqs)
        return batch, key

    def _fill_sampling(self, a: SamplingArrays, i: int, p: SamplingParams, seq) -> None:
        a.temperature[i] = p.temperature
        a.top_k[i] = max(p.top_k, 0)
        a.top_p[i] = p.top_p
        a.min_p[i] = p.min_p
        a.presence_penalty[i] = p.presence_penalty
        a.frequency_penalty[i] = p.frequency_penalty
        a.repetition_penalty[i] = p.repetition_penalty
        a.seed[i] = p.seed
        a.output_index[i] = len(seq.output_token_ids)
        if len(seq.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            a.banned_ids[i, :len(banned)] = banned[:MAX_STOP_TOKEN_IDS]

    def empty(self, key: BucketKey) -> StepBatch:
        """An all-padding batch of the bucket's shapes (also used to compile it)."""
        t, s, history = key
        i32 = np.int32
        return StepBatch(
            input_ids=np.zeros(t, i32),
            positions=np.zeros(t, i32),
            prev_index=np.full(t, -1, i32),
            attn=AttentionMetadata(
                slot_mapping=np.full(t, self.num_pages * self.page_size, i32),
                cu_q_lens=np.zeros(s + 1, i32),
                kv_lens=np.zeros(s, i32),
                page_indices=np.zeros((s, self.pages_per_seq), i32),
                num_seqs=np.zeros((), i32),
            ),
            sampling=SamplingArrays(
                temperature=np.zeros(s, np.float32),
                top_k=np.zeros(s, i32),
                top_p=np.ones(s, np.float32),
                min_p=np.zeros(s, np.float32),
                presence_penalty=np.zeros(s, np.float32),
                frequency_penalty=np.zeros(s, np.float32),
                repetition_penalty=np.ones(s, np.float32),
                seed=np.zeros(s, np.uint32),
                output_index=np.zeros(s, i32),
                banned_ids=np.full((s, MAX_STOP_TOKEN_IDS), -1, i32),
            ),
            history=TokenHistory(
                tokens=np.full((s, self.max_model_len), -1, i32),
                prompt_lens=np.zeros(s, i32),
            ) if history else None,
        )
