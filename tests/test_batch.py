"""The engine's host arithmetic: BatchBuilder.build's ragged batch, per data shard, checked
array by array against layouts written out by hand from docs/engine.md's table; and the KV
pool's size (kv_memory.kv_page_bytes, kv_memory.pool_size). No JAX compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.batch import BatchBuilder, BucketKey
from jaxserve.engine.request import PLACEHOLDER, Sequence
from jaxserve.engine.kv_memory import DEFAULT_CPU_KV_GIB, kv_page_bytes, pool_size
from jaxserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from sharding.rules import ShardingContext, strategy_rules

PAGE, PAGES_PER_SEQ, NUM_PAGES = 4, 8, 20  # NUM_PAGES per data shard
PAD_SLOT = NUM_PAGES * PAGE  # past the pool: the writer drops it


def builder(data_shards: int = 1, buckets=(1, 8, 16, 32)) -> BatchBuilder:
    return BatchBuilder(token_buckets=buckets, max_num_seqs=8, page_size=PAGE,
                        num_pages=NUM_PAGES, pages_per_seq=PAGES_PER_SEQ, max_model_len=32,
                        eos_token_ids=(1,), vocab_size=64, data_shards=data_shards)


def seq(rid: str, prompt: list[int], pages: list[int], data_shard: int = 0,
        outputs: list[int] = (), **params) -> Sequence:
    params.setdefault("seed", 0)  # the engine gives every request one
    return Sequence(rid, list(prompt), params=SamplingParams(**params),
                    output_token_ids=list(outputs), page_ids=list(pages), data_shard=data_shard)


def scheduled(*items: tuple[Sequence, int, int]) -> SchedulerOutput:
    out = [ScheduledSeq(s, start, n) for s, start, n in items]
    return SchedulerOutput(out, [], sum(n for _, _, n in items))


def test_one_shard_layout():
    """A 5-token prompt chunk and a decode: tokens back to back, cu_q_lens over them,
    padding tokens at the drop slot, padding sequences with no tokens."""
    a = seq("a", [10, 11, 12, 13, 14, 15, 16], pages=[3, 7], temperature=0.5, seed=9)
    b = seq("b", [20, 21, 22], pages=[5], outputs=[23], temperature=0.0)
    out = scheduled((a, 0, 5), (b, 3, 1))
    batch, key = builder().build(out)
    assert key == BucketKey(8, 8, False)  # 6 tokens -> the 8 bucket, room for 8 seqs
    assert batch.input_ids.tolist() == [10, 11, 12, 13, 14, 23, 0, 0]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 3, 0, 0]
    # a: positions 0-3 in page 3, position 4 in page 7; b: position 3 in page 5.
    assert batch.attn.slot_mapping.tolist() == [12, 13, 14, 15, 28, 23, PAD_SLOT, PAD_SLOT]
    assert batch.attn.cu_q_lens.tolist() == [0, 5, 6, 6, 6, 6, 6, 6, 6]
    assert batch.attn.kv_lens.tolist() == [5, 4, 0, 0, 0, 0, 0, 0]
    assert batch.attn.page_indices[:2, :2].tolist() == [[3, 7], [5, 0]]
    assert batch.attn.num_seqs.tolist() == [2]
    assert [s.row for s in out.scheduled] == [0, 1]
    assert batch.sampling.temperature[:2].tolist() == [0.5, 0.0]
    assert batch.sampling.seed[0] == 9
    assert batch.sampling.output_index[:2].tolist() == [0, 1]  # outputs so far
    assert (batch.prev_index == -1).all()
    assert batch.history is None


def test_two_data_shards_each_in_their_own_terms():
    """Each data shard's block holds its own seqs, with token offsets, slots and page ids
    local to its pool; the bucket is picked by the busier shard (6 tokens -> 8 per
    shard, so T = 16 and S = 8 over both)."""
    a = seq("a", [1, 2, 3, 4, 5, 6], pages=[2, 4], data_shard=1)
    b = seq("b", [7, 8], pages=[6], data_shard=0)
    c = seq("c", [9], pages=[0], data_shard=1)
    out = scheduled((a, 0, 6), (b, 0, 2), (c, 0, 1))
    batch, key = builder(data_shards=2).build(out)
    assert key == BucketKey(16, 8, False)
    t, s = 8, 4  # per shard
    assert batch.input_ids.tolist() == [7, 8] + [0] * 6 + [1, 2, 3, 4, 5, 6, 9, 0]
    assert batch.attn.slot_mapping[:t].tolist() == [24, 25] + [PAD_SLOT] * 6
    assert batch.attn.slot_mapping[t:].tolist() == [8, 9, 10, 11, 16, 17, 0, PAD_SLOT]
    # cu_q_lens: S/D + 1 entries per shard, offsets within the shard's tokens.
    assert batch.attn.cu_q_lens.tolist() == [0, 2, 2, 2, 2] + [0, 6, 7, 7, 7]
    assert batch.attn.kv_lens.tolist() == [2, 0, 0, 0] + [6, 1, 0, 0]
    assert batch.attn.num_seqs.tolist() == [1, 2]
    # Rows in the sampled outputs: shard d's seqs from d * S/D on.
    assert [x.row for x in out.scheduled] == [s, 0, s + 1]
    assert batch.attn.page_indices[s, :2].tolist() == [2, 4]


def test_placeholder_reads_the_in_flight_steps_row():
    """A decode whose newest token is still on the device (async scheduling) feeds 0 and
    points prev_index at that seq's row in the step in flight."""
    a = seq("a", [5, 6, 7], pages=[1, 2], outputs=[8, PLACEHOLDER])
    out = scheduled((a, 4, 1))
    batch, _ = builder().build(out, pending={a: (3, 0)})
    assert batch.input_ids[0] == 0 and batch.prev_index[0] == 3
    assert (batch.prev_index[1:] == -1).all()


def test_penalties_carry_the_history():
    a = seq("a", [5, 6, 7], pages=[1], outputs=[8], repetition_penalty=1.2)
    out = scheduled((a, 3, 1))
    batch, key = builder().build(out)
    assert key == BucketKey(1, 1, True)
    a.output_token_ids.append(PLACEHOLDER)  # as the engine does once the step is dispatched
    BatchBuilder.fill_history(batch, out)
    assert batch.history.tokens[0, :4].tolist() == [5, 6, 7, 8]
    assert batch.history.prompt_lens[0] == 3


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    a = seq("a", [5], pages=[1], min_tokens=2, stop_token_ids=[4])
    b = seq("b", [5], pages=[2], min_tokens=2, stop_token_ids=[4], outputs=[9, 9])
    batch, _ = builder().build(scheduled((a, 0, 1), (b, 2, 1)))
    assert sorted(x for x in batch.sampling.banned_ids[0] if x >= 0) == [1, 4]
    assert (batch.sampling.banned_ids[1] == -1).all()


@pytest.mark.parametrize("data_shards", [1, 2])
def test_every_bucket_a_schedule_can_produce_is_listed(data_shards):
    b = builder(data_shards)
    listed = set(b.all_buckets())
    for tokens in range(1, 32 // data_shards + 1):
        for history in (False, True):
            assert b.bucket(tokens, history) in listed
    assert all(isinstance(k, BucketKey) and k.seqs <= k.tokens for k in listed)
    empty = b.empty(BucketKey(16, 8, False))
    assert empty.attn.cu_q_lens.shape == (8 + data_shards,)
    assert np.all(empty.attn.slot_mapping == PAD_SLOT)


# ------------------------------------------------------------ KV pool sizing


def test_page_bytes_per_layer_kv_head_and_device():
    """One page = layers x (K + V) x KV heads x page_size x head_dim x itemsize, plus a
    float32 scale per token and head for an 8-bit cache; a device holds its share of the
    heads under tensor parallelism (and one copy per device when heads are fewer)."""
    cfg = ModelConfig(model_type="llama", architecture="LlamaForCausalLM", vocab_size=64,
                      hidden_size=64, intermediate_size=128, num_layers=3, num_heads=8,
                      num_kv_heads=4, head_dim=8, max_position_embeddings=128)
    assert kv_page_bytes(cfg, 16, jnp.bfloat16) == 3 * 2 * 4 * 16 * 8 * 2
    assert kv_page_bytes(cfg, 16, jnp.int8) == 3 * 2 * (4 * 16 * 8 + 4 * 16 * 4)

    def on(model: int) -> ShardingContext:
        mesh = jax.sharding.AbstractMesh((1, model), ("data", "model"))
        return ShardingContext(mesh, strategy_rules("tp", mesh, 8, 4, 64, 128))

    assert kv_page_bytes(cfg, 16, jnp.bfloat16, on(2)) == 3 * 2 * 2 * 16 * 8 * 2  # 2 heads
    assert kv_page_bytes(cfg, 16, jnp.bfloat16, on(8)) == 3 * 2 * 1 * 16 * 8 * 2  # 1 copy


class _Device:
    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_pool_size_from_budget_capped_at_what_the_seqs_can_use():
    page = 1000
    # An accelerator: utilization of its limit, less what is in use already.
    gpu = _Device({"bytes_limit": 1_000_000, "bytes_in_use": 100_000})
    assert pool_size(page, 10_000, None, 0.5, gpu) == 400
    assert pool_size(page, 300, None, 0.5, gpu) == 300  # max_num_seqs full contexts
    assert pool_size(page, 10_000, None, 0.5, gpu, reserved=100 * page) == 300
    # An explicit budget wins over the device's.
    assert pool_size(page, 10**9, 0.5, 0.5, gpu) == 2**29 // page
    # A CPU reports no limit: the default budget.
    assert pool_size(page, 10**9, None, 0.9, _Device(None)) == int(DEFAULT_CPU_KV_GIB * 2**30) // page
    assert pool_size(page, 10**9, None, 0.9, _Device({"bytes_limit": 0, "bytes_in_use": 5})) == 0
