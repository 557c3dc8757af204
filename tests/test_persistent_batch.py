"""The persistent batch (persistent_batch.py): seats kept across steps, page-table rows that
follow a sequence's pages, and BatchBuilder.build's whole-array layout checked against a
plain per-sequence layout of random schedules (prompt chunks, decodes, tokens still on the
device, chains of drafts, two data shards). No JAX compile."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from jaxserve.engine.batch import BatchBuilder
from jaxserve.engine.request import PLACEHOLDER, Sequence, SequenceStatus
from jaxserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.engine.speculative.drafts import Drafts
from jaxserve.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

PAGE, PAGES_PER_SEQ, NUM_PAGES, MAX_LEN = 4, 8, 64, 32


def builder(data_shards: int = 1, max_num_seqs: int = 8, k: int = 0) -> BatchBuilder:
    return BatchBuilder(token_buckets=(8, 16, 32, 64), max_num_seqs=max_num_seqs,
                        page_size=PAGE, num_pages=NUM_PAGES, pages_per_seq=PAGES_PER_SEQ,
                        max_model_len=MAX_LEN, eos_token_ids=(1,), vocab_size=64,
                        data_shards=data_shards, num_speculative_tokens=k)


def decode(seq: Sequence) -> SchedulerOutput:
    return SchedulerOutput([ScheduledSeq(seq, seq.num_tokens - 1, 1)], [], 1)


def test_a_seat_is_kept_and_its_page_row_follows_the_pages():
    b = builder()
    seq = Sequence("a", [3, 4, 5], params=SamplingParams(seed=0), page_ids=[7])
    batch, _ = b.build(decode(seq))
    seat = b.rows._seat[seq]
    assert batch.attn.page_indices[0].tolist() == [7] + [0] * 7
    seq.page_ids.extend([9, 2])  # grown in place (PageAllocator.allocate_more)
    seq.output_token_ids += [6, 6, 6, 6]
    batch, _ = b.build(decode(seq))
    assert b.rows._seat[seq] == seat
    assert batch.attn.page_indices[0].tolist() == [7, 9, 2] + [0] * 5
    assert batch.attn.slot_mapping[0] == 9 * PAGE + 2  # position 6: page 1, offset 2
    seq.page_ids = [7, 5]  # truncated, then grown to as many pages (a new list)
    batch, _ = b.build(decode(seq))
    assert batch.attn.page_indices[0].tolist() == [7, 5] + [0] * 6


def test_changed_parameters_are_rewritten():
    b = builder()
    seq = Sequence("a", [3, 4], params=SamplingParams(seed=0, temperature=0.5), page_ids=[1])
    assert b.build(decode(seq))[0].sampling.temperature[0] == 0.5
    seq.params = SamplingParams(seed=0, temperature=0.25)
    assert b.build(decode(seq))[0].sampling.temperature[0] == 0.25


def test_seats_of_finished_sequences_are_reused_and_running_ones_kept():
    b = builder(max_num_seqs=1)  # two seats
    seqs = [Sequence(str(i), [3, 4], params=SamplingParams(seed=i), page_ids=[i])
            for i in range(5)]
    for i, seq in enumerate(seqs):
        seq.status = SequenceStatus.RUNNING
        batch, _ = b.build(decode(seq))
        assert batch.attn.page_indices[0, 0] == i and batch.sampling.seed[0] == i
        seq.status = SequenceStatus.FINISHED
    assert b.rows.capacity == 2
    for seq in seqs:  # all running: none may lose its seat, so the table grows
        seq.status = SequenceStatus.RUNNING
        b.build(decode(seq))
    assert b.rows.capacity == 8
    assert len({b.rows._seat[s] for s in seqs}) == 5


# ---------------------------------------------------------------- random schedules


def reference_layout(b: BatchBuilder, out: SchedulerOutput, pending: dict, key) -> dict:
    """The batch laid out one sequence and one token at a time (the builder's layout before
    it gathered from seats), as a dict of arrays."""
    d, t_, s_, r_ = b.data_shards, key.tokens, key.seqs, key.rows
    st, ss, sr = t_ // d, s_ // d, r_ // d
    ref = copy.deepcopy(b.empty(key))  # its templates are read-only
    counts, ends, rows = [0] * d, [0] * d, [0] * d
    for sched in out.scheduled:
        seq, start, n = sched.seq, sched.start, sched.num_new_tokens
        k = seq.data_shard
        i, local, r = k * ss + counts[k], ends[k], k * sr + rows[k]
        t = k * st + local
        drafts = sched.drafts
        own = n - len(drafts)
        tokens = seq.token_ids
        for j in range(n):
            pos = start + j
            ref.positions[t + j] = pos
            ref.attn.slot_mapping[t + j] = seq.page_ids[pos // PAGE] * PAGE + pos % PAGE
            if j < own:
                token = tokens[pos]
                if token == PLACEHOLDER:
                    first, _ = pending[seq]
                    ref.prev_index[t + j] = (first if pos == seq.num_tokens - 1
                                             else b.layout.last + first)
                else:
                    ref.input_ids[t + j] = token
            elif drafts.on_device:
                ref.prev_index[t + j] = drafts.device_index[j - own]
            else:
                ref.input_ids[t + j] = drafts.tokens[j - own]
        ref.attn.kv_lens[i] = start + n
        ref.attn.page_indices[i, :len(seq.page_ids)] = seq.page_ids
        if pending.get(seq, (0, 0))[1]:
            ref.shift_row[i] = pending[seq][0]
        p = seq.params
        for j in range(1 + len(drafts)):
            row = r + j
            ref.sample_index[row] = local + n - (1 + len(drafts)) + j
            a = ref.sampling
            a.temperature[row], a.top_k[row], a.top_p[row] = p.temperature, p.top_k, p.top_p
            a.seed[row], a.logprobs[row] = p.seed, p.logprobs is not None
            a.repetition_penalty[row] = p.repetition_penalty
            a.output_index[row] = len(seq.output_token_ids) + j
            if pending.get(seq, (0, 0))[1]:
                a.shift_row[row] = pending[seq][0]
            if len(seq.output_token_ids) + j < p.min_tokens:
                banned = list(p.stop_token_ids) + [1]
                a.banned_ids[row, :len(banned)] = banned
        if drafts:
            ref.sampling.group_drafts[r] = len(drafts)
        assert sched.row == r
        counts[k] += 1
        rows[k] += 1 + len(drafts)
        ends[k] = local + n
        ref.attn.cu_q_lens[k * (ss + 1) + counts[k]] = ends[k]
    for k in range(d):
        block = k * (ss + 1)
        ref.attn.cu_q_lens[block + counts[k] + 1:block + ss + 1] = ends[k]
    ref.attn.num_seqs[:] = counts
    ref.num_rows[:] = rows
    return ref


def random_schedule(rng: random.Random, d: int, k: int, step: int):
    """A schedule of up to 8 seqs over `d` shards: prompt chunks, decodes (some with their
    newest tokens still on the device, some verifying drafts)."""
    scheduled, pending, tokens = [], {}, [0] * d
    for x in range(rng.randint(1, 8 // d * d)):
        shard = x % d
        prompt = [rng.randrange(2, 60) for _ in range(rng.randint(1, 12))]
        outputs = [rng.randrange(2, 60) for _ in range(rng.randint(0, 10))]
        params = SamplingParams(seed=rng.randrange(100), temperature=rng.choice([0.0, 0.7]),
                                top_k=rng.choice([0, 5]), min_tokens=rng.choice([0, 4]),
                                stop_token_ids=rng.choice([[], [7, 9]]),
                                repetition_penalty=1.0, logprobs=rng.choice([None, 2]))
        seq = Sequence(f"{step}-{x}", prompt, params=params, output_token_ids=outputs,
                       data_shard=shard)
        drafts = Drafts()
        if outputs and rng.random() < 0.5:  # a decode, its newest token maybe on the device
            if rng.random() < 0.5:
                seq.output_token_ids[-1] = PLACEHOLDER
                pending[seq] = (rng.randrange(8), 0)
            if k and rng.random() < 0.5:
                if rng.random() < 0.5:
                    drafts = Drafts([rng.randrange(2, 60) for _ in range(k)])
                else:
                    drafts = Drafts([PLACEHOLDER] * k, None,
                                    [b * 8 + rng.randrange(8) for b in range(1, k + 1)])
            start, n = seq.num_tokens - 1, 1 + len(drafts)
        else:
            start = rng.randrange(len(prompt))
            n = rng.randint(1, len(prompt) - start)
        if tokens[shard] + n > 32:
            continue
        tokens[shard] += n
        seq.page_ids = rng.sample(range(NUM_PAGES), -(-(start + n) // PAGE))
        scheduled.append(ScheduledSeq(seq, start, n, drafts=drafts,
                                      samples=start + n == seq.num_tokens + len(drafts)))
    return SchedulerOutput(scheduled, [], sum(tokens)), pending


@pytest.mark.parametrize("data_shards,k", [(1, 0), (1, 2), (2, 0), (2, 3)])
def test_random_schedules_match_the_per_sequence_layout(data_shards, k):
    rng = random.Random(data_shards * 10 + k)
    b = builder(data_shards, k=k)
    for step in range(60):
        out, pending = random_schedule(rng, data_shards, k, step)
        if not out.scheduled:
            continue
        batch, key = b.build(out, pending)
        ref = reference_layout(b, out, pending, key)
        for name, got, want in [("input_ids", batch.input_ids, ref.input_ids),
                                ("positions", batch.positions, ref.positions),
                                ("prev_index", batch.prev_index, ref.prev_index),
                                ("sample_index", batch.sample_index, ref.sample_index),
                                ("num_rows", batch.num_rows, ref.num_rows),
                                ("shift_row", batch.shift_row, ref.shift_row)]:
            np.testing.assert_array_equal(got, want, err_msg=name)
        for field in ("slot_mapping", "cu_q_lens", "kv_lens", "page_indices", "num_seqs"):
            np.testing.assert_array_equal(getattr(batch.attn, field), getattr(ref.attn, field),
                                          err_msg=field)
        for field in ("temperature", "top_k", "top_p", "seed", "logprobs", "output_index",
                      "banned_ids", "shift_row", "group_drafts", "repetition_penalty"):
            np.testing.assert_array_equal(getattr(batch.sampling, field),
                                          getattr(ref.sampling, field), err_msg=field)
        assert batch.sampling.banned_ids.shape[1] == MAX_STOP_TOKEN_IDS


def _arrays(batch) -> dict[str, np.ndarray]:
    """A batch's arrays by field path (its parts' fields too)."""
    out = {}
    for name, v in vars(batch).items():
        if isinstance(v, np.ndarray):
            out[name] = v
        elif v is not None and hasattr(v, "__dataclass_fields__"):
            out.update({f"{name}.{k}": x for k, x in _arrays(v).items()})
    return out


@pytest.mark.parametrize("data_shards,k", [(1, 2), (2, 3)])
def test_a_batch_writes_only_arrays_of_its_own(data_shards, k):
    """A dispatched batch's arrays may be the device's own (a CPU program reads numpy
    arguments in place, while it runs): no later batch may write into them. Each batch's
    written arrays are new; the rest are the bucket's read-only templates, which stay
    all-padding."""
    rng = random.Random(7)
    b = builder(data_shards, k=k)
    kept, seen = [], set()
    for step in range(40):
        out, pending = random_schedule(rng, data_shards, k, step)
        if not out.scheduled:
            continue
        batch, key = b.build(out, pending)
        kept.append(batch)  # (alive, so no id is reused)
        template = _arrays(b._empty[key])
        for name, x in _arrays(batch).items():
            if x.flags.writeable:
                assert id(x) not in seen, f"{name} written into an earlier batch's array"
                seen.add(id(x))
            else:
                assert x is template[name], name
    assert kept
    for key, template in b._empty.items():
        fresh = _arrays(b._make_empty(key))
        for name, x in _arrays(template).items():
            np.testing.assert_array_equal(x, fresh[name], err_msg=name)
            with pytest.raises(ValueError, match="read-only"):
                x[...] = 0
