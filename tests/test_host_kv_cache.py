"""The prefix cache's host tier (`kv_offloading_size`): pages the device's prefix cache
recycles are kept in host memory and copied back for prompts that share their prefix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine import engine as engine_module
from jaxserve.engine.host_kv_cache import HostKVCache
from jaxserve.engine.page_allocator import PageAllocator, hash_page
from jaxserve.engine.request import Sequence
from server.engine_core import EngineSnapshot
from server.metrics import Metrics
from server.servicer import host_kv_status

from conftest import VOCAB, hf_greedy

PS = 4
# A pool of 32 four-token pages: two 40-token prompts with their outputs fill it.
ENGINE = dict(dtype="float32", max_model_len=64, page_size=PS, num_pages=32,
              max_num_seqs=2, max_num_batched_tokens=64, token_buckets=(16, 64))


def pages(values: list[int], shape=(2, 3, PS)) -> np.ndarray:
    """Host pages `[layers, heads, len(values), page_size]`, page j filled with values[j]."""
    out = np.empty((shape[0], shape[1], len(values), *shape[2:]), np.float32)
    for j, v in enumerate(values):
        out[:, :, j] = v
    return out


# ----------------------------------------------------------------- the store itself


def test_host_cache_keeps_pages_by_hash_least_recently_used_first():
    host = HostKVCache(3, [(2, 3, PS)], [np.float32])
    host.store([b"a", b"b", b"c"], (pages([1, 2, 3]),))
    assert b"b" in host and host.num_pages == 3
    [got] = host.take([b"c", b"a"])  # a is now the most recently used, then c
    np.testing.assert_array_equal(got, pages([3, 1]))
    host.store([b"d", b"e"], (pages([4, 5]),))  # b, then c give up their slots
    assert b"b" not in host and b"c" not in host and b"a" in host
    np.testing.assert_array_equal(host.take([b"a", b"d", b"e"])[0], pages([1, 4, 5]))
    host.store([b"a", b"f"], (pages([9, 6]),))  # a already held: kept as it was
    np.testing.assert_array_equal(host.take([b"a", b"f"])[0], pages([1, 6]))
    assert (host.pages_stored, host.pages_loaded) == (6, 7)


def test_host_cache_copies_land_before_their_slots_are_reused():
    """Device arrays whose copy is under way land in their slots before a slot goes to
    another page, and a store of more pages than fit keeps the newest."""
    host = HostKVCache(2, [(2, 3, PS)], [np.float32])
    host.store([b"a", b"b"], (jax.device_put(pages([1, 2])),))
    host.store([b"c"], (jax.device_put(pages([3])),))  # recycles a's slot: a lands first
    np.testing.assert_array_equal(host.take([b"b", b"c"])[0], pages([2, 3]))
    host.store([b"d", b"e", b"f"], (pages([4, 5, 6]),))
    assert [h in host for h in (b"b", b"c", b"d", b"e", b"f")] == [False] * 3 + [True] * 2
    np.testing.assert_array_equal(host.take([b"e", b"f"])[0], pages([5, 6]))
    host.clear()
    assert host.num_pages == 0 and b"e" not in host


# ---------------------------------------------------------------- the allocator


def admit_and_compute(alloc: PageAllocator, seq: Sequence) -> None:
    assert alloc.allocate_prompt(seq, seq.num_tokens - alloc.lookup_prefix(seq))
    seq.num_computed_tokens = seq.num_tokens
    alloc.commit(seq)


def test_allocator_lists_pages_to_copy_out_and_in():
    """A recycled cached page is listed to copy out under its hash; a prompt whose prefix
    goes on in the host tier gets new pages for it, registered and listed to copy in."""
    host: set[bytes] = set()
    alloc = PageAllocator(num_pages=6, page_size=PS, host=host)
    a = Sequence("a", list(range(13)))  # 3 full pages, then 1 token
    admit_and_compute(alloc, a)
    alloc.free(a)
    hashes = alloc._page_hashes(a, 3)
    b = Sequence("b", list(range(100, 121)))  # needs all 6 pages: a's 3 are recycled
    admit_and_compute(alloc, b)
    assert sorted(h for _, h in alloc.offloads) == sorted(hashes)
    assert not alloc.loads and host == set(hashes)
    alloc.offloads.clear()
    alloc.free(b)

    again = Sequence("a2", list(range(13)) + [7, 7])
    assert alloc.lookup_prefix(again) == 12
    assert alloc.allocate_prompt(again, 3)
    assert again.num_computed_tokens == again.num_cached_tokens == 12
    assert [h for _, h in alloc.loads] == hashes
    assert [p for p, _ in alloc.loads] == again.page_ids[:3]
    assert (alloc.prefix_hits, alloc.host_hits) == (12, 12)
    # The pages the loads took held b's cached pages: listed to copy out (first).
    assert len(alloc.offloads) == 3 and set(h for _, h in alloc.offloads).isdisjoint(hashes)
    alloc.check_invariants()
    # A prompt sharing the prefix now finds it on the device.
    loaded = again.page_ids[:3]
    alloc.free(again)
    alloc.loads.clear()
    other = Sequence("a3", list(range(13)) + [9])
    assert alloc.allocate_prompt(other, 2) and not alloc.loads
    assert other.page_ids[:3] == loaded and alloc.host_hits == 12


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def model(checkpoints):
    return checkpoints("llama")


def long_prompts(n: int, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=length).tolist() for _ in range(n)]


def cached_pages(llm: LLM) -> dict[bytes, list[np.ndarray]]:
    """Every page the device's prefix cache holds, by hash: its K/V as stored."""
    alloc, runner = llm.engine.scheduler.allocator, llm.engine.runner
    out = {}
    for h, page in alloc._hash_to_page.items():
        kv = runner.read_pages(0, [page], PS)
        out[h] = [np.asarray(x)[:, :, 0] for x in kv.entries]
    return out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_evicted_prompts_come_back_from_host_memory(model, kv_cache_dtype):
    """Six 40-token prompts through a pool that holds two: the second round finds every
    prompt's full pages in host memory, copies them back as they were stored (the same
    bytes, quantized K/V with its scales too) and generates transformers' tokens."""
    path, hf = model
    prompts = long_prompts(6)
    llm = LLM(str(path), kv_offloading_size=0.001, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first, stored = [], {}
    for p in prompts:
        first.append(llm.generate([p], params)[0])
        stored.update(cached_pages(llm))
    status = llm.engine.status()
    assert status.host_hits == 0 and status.pages_offloaded > 0
    second = [llm.generate([p], params)[0] for p in prompts]
    status = llm.engine.status()
    assert status.host_hits == 6 * 36  # every prompt's 9 full pages before its last token
    assert [o.num_cached_tokens for o in second] == [36] * 6
    metrics = dict(line.rsplit(" ", 1) for line in Metrics("m").scrape(
        EngineSnapshot.of(llm.engine)).decode().splitlines() if line.startswith("jaxserve:"))
    assert float(metrics['jaxserve:host_prefix_cache_hits_total{model_name="m"}']) == 216
    assert float(metrics['jaxserve:host_kv_cache_stored_pages_total{model_name="m"}']) == \
        status.pages_offloaded
    assert float(metrics['jaxserve:host_kv_cache_usage_perc{model_name="m"}']) == \
        status.host_pages / llm.engine.host_kv.capacity > 0
    grpc_status = host_kv_status(status)  # GetServerStatus's
    assert (grpc_status.capacity_pages, grpc_status.pages_held, grpc_status.pages_stored,
            grpc_status.prefix_hit_tokens) == (llm.engine.host_kv.capacity, status.host_pages,
                                               status.pages_offloaded, 216)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
    if kv_cache_dtype == "auto":
        assert [o.outputs[0].token_ids for o in second] == [hf_greedy(hf, p, 8) for p in prompts]
    restored = cached_pages(llm)  # the last prompt's first 9 pages were reloaded
    parent = b""
    for j in range(9):
        parent = hash_page(parent, prompts[-1][j * PS:(j + 1) * PS])
        for got, want in zip(restored[parent], stored[parent]):
            np.testing.assert_array_equal(got, want)
    llm.engine.scheduler.allocator.check_invariants()


def test_a_page_recycled_and_found_in_one_schedule(model, monkeypatch):
    """Admitting one prompt from host memory recycles another's cached pages, and that
    prompt is admitted in the same step: its pages are written back from their copy out
    (not taken from the host), and both generate transformers' tokens. Copies of two
    pages at most, each copy out landed before the step (HOST_COPY_BYTES,
    HOST_PENDING_BYTES): several copies out and in a step."""
    path, hf = model
    prompts = long_prompts(4, seed=5)
    page_bytes = 2 * 2 * 2 * PS * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16
    monkeypatch.setattr(engine_module, "HOST_COPY_BYTES", 2 * page_bytes)
    monkeypatch.setattr(engine_module, "HOST_PENDING_BYTES", 0)
    llm = LLM(str(path), kv_offloading_size=0.001, **{**ENGINE, "num_pages": 24})
    shapes, dtypes = zip(*llm.engine.runner.page_layout())
    assert HostKVCache.page_bytes(shapes, dtypes) == page_bytes
    assert llm.engine._host_chunk == 2
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for p in prompts:  # the pool ends holding prompts 2 and 3 (2 the older)
        llm.generate([p], params)
    host = llm.engine.host_kv
    taken, hits = host.pages_loaded, llm.engine.status().host_hits
    outs = llm.generate([prompts[0], prompts[2]], params)
    assert [o.num_cached_tokens for o in outs] == [36, 36]
    loaded = (llm.engine.status().host_hits - hits) // PS
    assert loaded > 9 and host.pages_loaded - taken == 9  # prompt 2's from its copy out
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, prompts[i], 8)
                                                      for i in (0, 2)]


def test_preempted_requests_reload_their_pages(model):
    """Four requests that outgrow the pool preempt each other; their pages come back from
    host memory when they are readmitted, and every output is transformers'."""
    path, hf = model
    prompts = long_prompts(4, length=24, seed=3)
    llm = LLM(str(path), kv_offloading_size=0.001,
              **{**ENGINE, "num_pages": 20, "max_num_seqs": 4})
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    status = llm.engine.status()
    assert status.num_preemptions > 0 and status.host_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]
    assert status.num_used_pages == 0


def test_no_host_tier_reports_none():
    from jaxserve.engine.status import EngineStatus

    assert host_kv_status(EngineStatus(0, 0, 0, 8, 0, 0, 0, 0, 0, 0, None)) is None


def test_kv_offloading_size_is_checked(model):
    from jaxserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "--kv-offloading-size", "2.5"])
    assert engine_config_from_args(args).kv_offloading_size == 2.5
    with pytest.raises(ValueError, match="kv_offloading_size is the host memory"):
        EngineConfig(kv_offloading_size=0)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(kv_offloading_size=1, enable_prefix_caching=False)
    path, _ = model
    with pytest.raises(ValueError, match="holds no KV page"):
        LLM(str(path), kv_offloading_size=1e-9, **ENGINE)
    with pytest.raises(ValueError, match="draft_model speculative decoding is not supported"):
        LLM(str(path), kv_offloading_size=1, **ENGINE,
            speculative_config={"model": str(path), "num_speculative_tokens": 2})


@pytest.mark.slow
def test_data_shards_share_the_host_tier(model, tmp_path):
    """dp 2 and dp+tp 2x2 on 4 CPU devices: eight prompts outgrow both shards' pools; on
    the second pass every prompt's full pages come back from host memory (a shard may
    load what the other evicted), and every output is transformers'."""
    path, hf = model
    prompts = long_prompts(8)
    want = [hf_greedy(hf, p, 8) for p in prompts]
    out = tmp_path / "runs.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=4"}
    script = Path(__file__).parent / "host_kv_multidevice_check.py"
    proc = subprocess.run([sys.executable, str(script), str(path), str(out),
                           json.dumps({"prompts": prompts, "new_tokens": 8})], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(out.read_text())
    assert set(runs) == {"dp 2", "dp+tp 2x2"}
    for name, run in runs.items():
        assert run["tokens"] == [want, want], name
        assert run["host_hits"] == 8 * 36 and run["offloaded"] > 0, name
        assert run["used_pages"] == 0, name
