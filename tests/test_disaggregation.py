"""Prefill/decode disaggregation in one process: a request prefilled on one engine and
decoded on another gives one engine's tokens, text and logprobs; pages come back on both
sides whatever happens to it.

Here both engines sit on the one CPU device (separate KV pools, separate programs); over
8 emulated devices with different strategies per side the check runs in its own process
(tests/disaggregation_check.py, slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.kv_transfer import KVPages, Prefilled, page_buckets

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=(8, 32))


@pytest.fixture(scope="module")
def model(checkpoints):
    return str(checkpoints("llama8")[0])


@pytest.fixture(scope="module")
def single(model):
    return LLM(model, **ENGINE)


@pytest.fixture(scope="module")
def pd(model):
    # The decode side's pool is small enough (34 pages of 4 tokens) that the batch below
    # preempts there: a request handed over is recomputed by the decode engine then.
    return LLM(model, prefill={"num_pages": 120}, decode={"num_pages": 34}, **ENGINE)


def _batch(single):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (5, 17, 30, 43, 61, 9, 26)]
    base = single.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=24,
                                                        ignore_eos=True))[0].outputs[0]
    stop = base.text[6:9]  # a stop string a few tokens in
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.9, seed=11, logprobs=3),
              SamplingParams(max_tokens=24, temperature=0, stop=[stop], ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5,
                             repetition_penalty=1.3),
              SamplingParams(max_tokens=9, temperature=0, stop_token_ids=[base.token_ids[0]]),
              SamplingParams(max_tokens=18, temperature=1.0, top_k=20, seed=2,
                             ignore_eos=True)]
    prompts[5] = prompts[2]  # its first token is the stop token: ends on the prefill side
    return prompts, params


def _outputs(results):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in results]


def test_tokens_text_and_logprobs_match_one_engine(single, pd):
    prompts, params = _batch(single)
    want = single.generate(prompts, params)
    got = pd.generate(prompts, params)
    assert _outputs(got) == _outputs(want)
    assert got[2].outputs[0].finish_reason == "stop" and got[3].outputs[0].token_ids
    for w, g in zip(want[1].outputs[0].logprobs, got[1].outputs[0].logprobs):
        assert w.keys() == g.keys()
        assert all(abs(w[t].logprob - g[t].logprob) < 1e-5 for t in w)
    e = pd.engine
    # Every request but the one-token one and the one its first token stopped moved over.
    assert e.num_handoffs == 5 and e.handoff_bytes > 0
    for side in (e.prefill, e.decode):
        assert side.status().num_used_pages == 0
        assert side.runner.compiles_after_warmup == 0
        side.scheduler.allocators[0].check_invariants()
    assert e.decode.num_prefilled_waiting == 0 and not e.has_unfinished()


def test_a_decode_side_hands_out_its_first_token_at_once(single, pd, monkeypatch):
    """A stream interval on the decode side holds a request's tokens back after the first
    it makes (the request's second: its first came with it), which goes at once."""
    prompts, _ = _batch(single)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = single.generate(prompts[:2], params)
    decode, sizes = pd.engine.decode, {}
    step = decode.step

    def recording_step():
        outs = step()
        for o in outs:
            sizes.setdefault(o.request_id, []).append(len(o.new_token_ids))
        return outs

    monkeypatch.setattr(decode, "stream_interval", 4)
    monkeypatch.setattr(decode, "step", recording_step)
    assert _outputs(pd.generate(prompts[:2], params)) == _outputs(want)
    assert list(sizes.values()) == [[1, 4, 4, 4, 4, 2]] * 2


def test_decode_side_preemption_recomputes(single, pd):
    """Two requests outgrow the decode pool (34 pages: 29 each at the end): one is preempted
    there and recomputed by the decode engine, with the same tokens. Their prompts fit one
    prefill step together, so both reach the decode side at once, however the two engines'
    threads are timed (with long prompts, a second handed over late found the pool full and
    waited for the first to finish: a CI run saw no preemption)."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 320, size=16).tolist() for _ in range(2)]
    params = [SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=100, temperature=0.7, seed=1, ignore_eos=True)]
    before = pd.engine.decode.status().num_preemptions
    assert _outputs(pd.generate(prompts, params)) == _outputs(single.generate(prompts, params))
    assert pd.engine.decode.status().num_preemptions > before
    assert pd.engine.decode.status().num_used_pages == 0


def test_prefix_cache_on_the_prefill_side(single, pd):
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 320, size=40).tolist()
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = pd.engine.prefill.status().prefix_hits
    first, again = pd.generate([prompt], p), pd.generate([prompt + [7, 8]], p)
    assert pd.engine.prefill.status().prefix_hits - before >= 36  # 9 pages of the prompt
    assert _outputs(first + again) == _outputs(single.generate([prompt, prompt + [7, 8]], p))


def test_aborts_free_pages_on_both_sides(pd):
    e = pd.engine
    rng = np.random.default_rng(9)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def add(i):
        e.add_request(f"abort-{i}", rng.integers(3, 320, size=30).tolist(), params)

    for i in range(2):
        add(i)
    for _ in range(40):  # until both decode
        e.step()
        if e.decode.num_requests >= 2:
            break
    assert e.decode.num_requests == 2

    def add_more_and_abort_all():
        # Under the prefill loop's lock (`call` holds it; it is reentrant): its thread
        # starts no step meanwhile, so the four added wait for their prefill whatever
        # the threads' timing.
        for i in range(2, 6):
            add(i)
        assert e.prefill.num_requests == 4
        for i in range(6):
            assert e.abort_request(f"abort-{i}")

    e._prefill.call(add_more_and_abort_all)
    assert not e.abort_request("abort-0") and not e.has_unfinished()
    for _ in range(3):  # a step in flight when they were aborted lands
        e.step()
    for side in (e.prefill, e.decode):
        assert side.status().num_used_pages == 0 and side.num_requests == 0
    assert e.decode.num_prefilled_waiting == 0


def test_moved_pages_must_fit_the_decode_engine(pd):
    """A decode engine refuses K/V it cannot hold, and one that is not a consumer any."""
    e = pd.engine
    prompt = list(range(3, 23))
    p = SamplingParams(max_tokens=4)
    # As a server sends them: the 5 pages of the 20 tokens (the read pads to 8).
    entries = [np.asarray(x)[:, :, :5]
               for x in e.prefill.runner.read_pages(0, [0] * 5, 20).entries]
    ok = KVPages(tuple(entries), 20)
    with pytest.raises(ValueError, match="not a kv_producer"):
        e.decode.add_request("x", prompt, p, remote_decode=True)
    with pytest.raises(ValueError, match="not a kv_consumer"):
        e.prefill.add_request("x", prompt, p, prefilled=Prefilled(5, ok))
    with pytest.raises(ValueError, match="4 pages for 20 tokens"):
        e.decode.add_request("x", prompt, p, prefilled=Prefilled(
            5, KVPages(tuple(x[:, :, :4] for x in entries), 20)))
    with pytest.raises(ValueError, match="holds 20 tokens, the prompt has 19"):
        e.decode.add_request("x", prompt[:19], p, prefilled=Prefilled(5, ok))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.decode.add_request("x", prompt, p, prefilled=Prefilled(10**6, ok))
    with pytest.raises(ValueError, match="same page_size"):
        e.decode.add_request("x", prompt, p, prefilled=Prefilled(
            5, KVPages(tuple(x[:, :, :, :2] for x in entries), 20)))
    with pytest.raises(ValueError, match="float16.* this engine's float32"):
        e.decode.add_request("x", prompt, p, prefilled=Prefilled(
            5, KVPages(tuple(x.astype(np.float16) for x in entries), 20)))
    with pytest.raises(ValueError, match="max_tokens > 1"):
        e.decode.add_request("x", prompt, SamplingParams(max_tokens=1),
                             prefilled=Prefilled(5, ok))
    # Computed by another model, or under an adapter this request does not name.
    with pytest.raises(ValueError, match="computed by another model"):
        e.decode.add_request("x", prompt, p, prefilled=Prefilled(5, ok, "0123456789abcdef"))
    with pytest.raises(ValueError, match="under adapter 'sql', this request names None"):
        e.decode.add_request("x", prompt, p, prefilled=Prefilled(
            5, ok, e.prefill.model_digest, "sql"))
    with pytest.raises(ValueError, match="prompt's token ids differ"):
        e.decode.add_request("x", prompt, p, prefilled=Prefilled(
            5, ok, token_ids=[7] + prompt[1:]))
    with pytest.raises(ValueError, match="images differ"):
        e.decode.add_request("x", prompt, p, prefilled=Prefilled(
            5, ok, token_ids=prompt, images=["00ff"]))
    assert e.decode.status().num_used_pages == 0 and e.decode.num_prefilled_waiting == 0
    # Host arrays (as from another process) are taken as they are.
    e.decode.add_request("x", prompt, p, prefilled=Prefilled(
        5, ok, e.prefill.model_digest, None, prompt, []))
    assert e.decode.num_prefilled_waiting == 1
    assert e.decode.abort_request("x") and e.decode.num_prefilled_waiting == 0
    assert e.decode.status().num_used_pages == 0


def test_config_checks():
    from jaxserve.config import EngineConfig, KVTransferConfig

    assert EngineConfig(kv_transfer_config={"kv_role": "kv_consumer"}).kv_transfer_config == \
        KVTransferConfig("kv_consumer")
    for bad, match in (({"kv_role": "prefill"}, "kv_role must be one of"),
                       ({"kv_rol": "kv_producer"}, "unknown keys"),
                       ({"kv_hold_seconds": 0}, "kv_hold_seconds must be positive"),
                       ({"kv_port": 70000}, "kv_port must be a port")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(kv_transfer_config=bad)
    for devices in ((), (0, 0), (-1,), (True,)):
        with pytest.raises(ValueError, match="distinct device indices"):
            EngineConfig(devices=devices)
    with pytest.raises(ValueError, match="takes 2 of this process's 1 devices"):
        LLM(None, devices=[0, 1], mesh={"model": 2}, warmup=False)


@pytest.mark.parametrize("connector", ["grpc", "jax"])
def test_kv_service_moves_pages_as_stored(pd, connector):
    """The servers' K/V service (server/kv_transfer.py) in one process: what the puller
    gets is what was read out (only the prompt's pages over gRPC; the bucket through
    jax.experimental.transfer), with the prompt and first token; a transfer is gone once
    pulled, and one never pulled is released after hold_seconds."""
    from server.kv_transfer import KVPuller, KVSender, KVTransferError

    e = pd.engine
    sender = KVSender("127.0.0.1", 0, None, 1.0, 1000, connector)
    puller = KVPuller(e.decode.mesh.devices.flat[0])
    try:
        kv = e.prefill.runner.read_pages(0, [3, 1, 4, 1, 5], 18)  # 5 pages, 18 tokens
        want = [np.asarray(x) for x in kv.entries]
        params = sender.hold(Prefilled(42, kv, e.prefill.model_digest, "an-adapter",
                                       list(range(18)), ["00ff"]))
        assert sender.stats.held == 1 and sender.stats.held_bytes > 0
        assert params["num_bytes"] == sum(x.nbytes for x in want) * (5 if connector == "grpc"
                                                                     else 8) // 8
        prefilled, seconds = puller.pull(params, 30)
        assert prefilled.token_ids == list(range(18)) and prefilled.first_token == 42
        assert (prefilled.model, prefilled.lora, prefilled.images) == (
            e.decode.model_digest, "an-adapter", ["00ff"]) and seconds > 0
        got = [np.asarray(x) for x in prefilled.kv.entries]
        pages = 5 if connector == "grpc" else 8
        assert [g.shape[2] for g in got] == [pages] * len(got)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w[:, :, :pages])
        assert sender.stats.sent == 1 and sender.stats.held == 0
        with pytest.raises(KVTransferError, match="NOT_FOUND.*already pulled"):
            puller.pull(params, 30)
        late = sender.hold(Prefilled(7, e.prefill.runner.read_pages(0, [2], 3)))
        deadline = time.monotonic() + 10
        while sender.stats.held and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sender.stats.expired == 1 and sender.stats.held_bytes == 0
        with pytest.raises(KVTransferError, match="not pulled within kv_hold_seconds"):
            puller.pull(late, 30)
    finally:
        sender.stop()


def test_page_buckets():
    assert page_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert page_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert page_buckets(1) == [1]


@pytest.mark.slow
def test_two_meshes_of_8_devices_match_one_device(checkpoints, tmp_path):
    """Prefill on devices 0-3 and decode on 4-7 under pairs of strategies (TP to DP+TP,
    DP to TP, TP=2 to TP=4+SP with the KV heads stored twice, int8 KV): greedy and seeded
    tokens equal one engine's on one device; no page left on either side."""
    path, _ = checkpoints("llama8")
    out = tmp_path / "runs.json"
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    script = Path(__file__).parent / "disaggregation_check.py"
    proc = subprocess.run([sys.executable, str(script), str(path), str(out)],
                          env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(out.read_text())
    # int8 K/V changes the logprobs (the tiny model's tokens stay the same): the int8
    # pairs give the int8 engine's, so the quantized pages and their scales moved as stored.
    int8, floats = runs["one device int8 kv"]["logprobs"], runs["one device"]["logprobs"]
    assert max(abs(a - b) for a, b in zip(int8, floats)) > 1e-3
    pairs = [name for name in runs if "->" in name]
    assert len(pairs) == 4
    for name in pairs:
        run = runs[name]
        base = runs["one device int8 kv" if "int8" in name else "one device"]
        assert run["tokens"] == base["tokens"], name
        assert max(abs(a - b) for a, b in zip(run["logprobs"], base["logprobs"])) < 1e-4, name
        assert run["used_pages"] == [0, 0] and run["compiles_after_warmup"] == 0, name
        assert run["handoffs"] == 5, name
        assert run["decode_devices"] == [4, 5, 6, 7], name
        assert set(run["prefill_devices"]) <= {0, 1, 2, 3}, name


def test_model_digest_tells_what_computes_the_kv_apart(checkpoints, tmp_path):
    """Copies of a checkpoint agree; a fine-tune (every tensor moved a little, shapes and
    config the same), another dtype or quantization, and LongRoPE's factors for another
    max_model_len do not."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxserve.config import EngineConfig, ModelConfig
    from jaxserve.engine.kv_transfer import model_digest
    from jaxserve.loading.digest import weights_digest

    src = checkpoints("llama8")[0]
    copy, tuned = shutil.copytree(src, tmp_path / "copy"), shutil.copytree(src, tmp_path / "t")
    tensors = load_file(tuned / "model.safetensors")
    rng = np.random.default_rng(0)
    save_file({k: (v + 1e-3 * rng.standard_normal(v.shape)).astype(v.dtype)
               for k, v in tensors.items()}, tuned / "model.safetensors", {"format": "pt"})
    size = (tuned / "model.safetensors").stat().st_size
    assert size == (src / "model.safetensors").stat().st_size  # (so the samples tell)
    weights = weights_digest(src)
    assert weights_digest(copy) == weights and weights_digest(tuned) != weights
    with pytest.raises(ValueError, match="no weights files"):
        weights_digest(tmp_path)

    cfg = ModelConfig.from_file(src)
    base = model_digest(EngineConfig(dtype="float32"), cfg, weights)
    assert model_digest(EngineConfig(dtype="float32"), cfg, weights) == base
    for other in (model_digest(EngineConfig(dtype="bfloat16"), cfg, weights),
                  model_digest(EngineConfig(dtype="float32", quantization="int8"), cfg,
                               weights),
                  model_digest(EngineConfig(dtype="float32"), cfg, weights_digest(tuned))):
        assert other != base
    phi = ModelConfig.from_file(checkpoints("phi3_longrope")[0])
    short, long = (model_digest(EngineConfig(), phi.for_context(n), weights) for n in (32, 128))
    assert short != long == model_digest(EngineConfig(), phi.for_context(64), weights)
