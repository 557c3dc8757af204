"""The attention work a step issues follows its real tokens, whatever its bucket: counted
from the work-item plan that every backend (reference, TPU, GPU) walks."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve.engine.batch import BatchBuilder
from jaxserve.engine.request import Sequence
from jaxserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from pallas_kernels.ragged_paged_attention.work_items import (
    AttentionInputs, issued_rows, plan_blocks)

GROUP, HEAD_DIM, PAGE = 3, 8, 16  # smollm2's 9 query heads over 3 KV heads


def batch_of(q_lens: list[int], token_bucket: int, max_num_seqs: int = 64):
    """The engine's own batch for sequences with these new-token counts (each with a
    context of 100 + q tokens), as BatchBuilder lays it out in `token_bucket`."""
    builder = BatchBuilder(token_buckets=(1, token_bucket), max_num_seqs=max_num_seqs,
                           page_size=PAGE, num_pages=4096, pages_per_seq=64,
                           max_model_len=1024, eos_token_ids=(1,), vocab_size=64)
    scheduled, next_page = [], 0
    for i, q in enumerate(q_lens):
        context = 100 + q
        pages = list(range(next_page, next_page + -(-context // PAGE)))
        next_page += len(pages)
        seq = Sequence(str(i), [5] * context, params=SamplingParams(seed=0), page_ids=pages)
        scheduled.append(ScheduledSeq(seq, context - q, q))
    batch, key = builder.build(SchedulerOutput(scheduled, [], sum(q_lens)))
    return batch, key


def rows_and_items(q_lens: list[int], token_bucket: int) -> tuple[int, int, tuple]:
    batch, key = batch_of(q_lens, token_bucket)
    meta = batch.attn
    pool = jnp.zeros((1, 4096, PAGE, HEAD_DIM), jnp.float32)
    x = AttentionInputs.validate(
        jnp.zeros((key.tokens, GROUP, HEAD_DIM)), pool, pool, meta.kv_lens, meta.page_indices,
        meta.cu_q_lens, meta.num_seqs[0], sm_scale=1.0)
    plan = plan_blocks(x, queries_per_block=min(32, key.tokens), pages_per_block=8)
    rows, items = issued_rows(plan, GROUP)
    return int(rows) // GROUP, int(items), key


def test_one_prompt_in_a_big_bucket_is_one_item_per_32_tokens():
    """A 32-token prompt alone in the 64-token bucket (64 sequence slots): one prefill
    item of 32 queries. (The T // S rule made it 64 items of one query each, every one
    reading the whole context.)"""
    rows, items, key = rows_and_items([32], token_bucket=64)
    assert key.seqs == 64
    assert (rows, items) == (32, 1)


def test_decodes_in_a_mixed_batch_are_not_padded_to_prefill_blocks():
    """63 decodes and a 449-token chunk in the 512 bucket: one row per decode and
    ceil(449 / 32) prefill items, 31 padding rows in all (the T // S rule gave every
    decode an 8-row item: 441 padding rows on the decodes alone)."""
    rows, items, _ = rows_and_items([1] * 63 + [449], token_bucket=512)
    assert items == 63 + 15
    assert rows == 63 + 15 * 32
    assert rows - 512 == 31


@pytest.mark.parametrize("q_lens", [[1] * 5, [1, 7, 1, 40, 2], [3] * 20, [17, 17, 17]])
def test_rows_stay_within_one_block_of_padding_per_prompt(q_lens):
    tokens = sum(q_lens)
    bucket = 1 << (tokens - 1).bit_length()
    rows, items, _ = rows_and_items(q_lens, token_bucket=max(bucket, 8))
    prompts = sum(q > 1 for q in q_lens)
    bq = min(32, max(bucket, 8))
    assert tokens <= rows <= tokens + prompts * (bq - 1)
    assert items == sum(1 if q == 1 else -(-q // bq) for q in q_lens)


def test_an_empty_batch_issues_nothing():
    rows, items, _ = rows_and_items([], token_bucket=8)
    assert (rows, items) == (0, 0)
