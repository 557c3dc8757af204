"""LoRA adapters: the grouped delta against the token-by-token reference, PEFT directories
read and checked, and a batch mixing adapters (and the base model) against PEFT's own
models, transformers underneath."""

from __future__ import annotations

import copy
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import hf_greedy, kernel_interpret, save_peft_adapter
from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.loading.peft import load_adapter
from pallas_kernels.lora import lora_delta, plan
from pallas_kernels.lora import reference

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=(8, 32), enable_lora=True,
              max_loras=2, max_lora_rank=8, num_scheduler_steps=4)
NEW_TOKENS = 8
# name -> (rank, alpha, rsLoRA, target modules): different ranks and targets.
ADAPTERS = {
    "qv": (4, 8, False, ["q_proj", "v_proj"]),
    "all": (8, 16, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"]),
    "mlp": (2, 4, False, ["o_proj", "gate_proj", "down_proj"]),
}


@pytest.mark.parametrize("impl", ["reference", "cpu", "tpu", "gpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_delta_matches_the_token_by_token_reference(impl, dtype):
    rng = np.random.default_rng(0)
    t, k, r, n, g = 37, 64, 8, 48, 3
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    a = jnp.asarray(rng.standard_normal((g, k, r)) / 8, dtype)
    b = jnp.asarray(rng.standard_normal((g, r, n)) / 8, dtype)
    slots = jnp.asarray(rng.integers(0, g + 1, t), jnp.int32).at[:5].set(2)  # slot 3 unused too
    slots = slots.at[slots == 3].set(0)
    want = reference.lora_delta(x, a, b, slots)
    got = lora_delta(x, a, b, plan(slots, g), impl=impl,
                     interpret=impl in ("tpu", "gpu") and kernel_interpret(impl))
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
    assert not np.asarray(got[np.asarray(slots) == 0]).any()  # no adapter: no delta
    assert np.abs(np.asarray(want, np.float32)[np.asarray(slots) > 0]).min(axis=1).max() > 0


def test_plan_sorts_tokens_by_slot_with_the_base_last():
    slots = jnp.asarray([2, 0, 1, 2, 0, 1], jnp.int32)
    p = plan(slots, 3)
    assert np.asarray(slots)[np.asarray(p.order)].tolist() == [1, 1, 2, 2, 0, 0]
    assert np.asarray(p.group_sizes).tolist() == [2, 2, 0]
    assert (np.asarray(p.order)[np.asarray(p.inverse)] == np.arange(6)).all()


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    """{name: (directory, PEFT model)} over the tiny Llama."""
    path, base = checkpoints("llama")
    out = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        out[name] = (tmp_path_factory.mktemp(f"lora-{name}"),)
        out[name] += (save_peft_adapter(base, out[name][0], *spec, seed=10 + i),)
    return out


@pytest.fixture(scope="module")
def lora_llm(checkpoints):
    return LLM(str(checkpoints("llama")[0]), **ENGINE)


def _requests(adapters):
    return {name: LoRARequest(name, i + 1, str(d)) for i, (name, (d, _)) in
            enumerate(adapters.items())}


def test_a_mixed_batch_gives_each_request_what_peft_gives_it_alone(
        lora_llm, adapters, checkpoints, prompts):
    """Three adapters of different ranks and targets and the base model in one batch,
    prompts long enough to be prefilled in chunks, decode steps four to a program, two
    device slots for three adapters (they take turns: evicted and loaded again)."""
    _, base = checkpoints("llama")
    reqs = _requests(adapters)
    names = [None, "qv", "all", "mlp"]
    batch = [(p, name) for p in prompts for name in names]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    loads, multi = lora_llm.engine.loras.num_loads, lora_llm.engine.num_multi_steps
    outs = lora_llm.generate([p for p, _ in batch], params,
                             lora_request=[reqs.get(n) for _, n in batch])
    for (prompt, name), out in zip(batch, outs):
        model = base if name is None else adapters[name][1]
        want = hf_greedy(model, prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == want, (name, len(prompt))
    # The adapters change what the model says, so the comparison above can fail.
    by_name = {n: [o.outputs[0].token_ids for (_, m), o in zip(batch, outs) if m == n]
               for n in names}
    assert all(by_name[n] != by_name[None] for n in names[1:])
    assert lora_llm.engine.loras.num_loads - loads >= 3  # 3 adapters, 2 slots
    assert lora_llm.engine.num_multi_steps > multi


def test_phi3_fused_targets_give_peft_tokens(checkpoints, prompts, tmp_path):
    """PEFT adapters on Phi-3's fused qkv_proj and gate_up_proj (one A per fused module, its
    B split among q/k/v or gate/up, as the base weight is) beside ones on o/down."""
    path, base = checkpoints("phi3")
    peft = {name: save_peft_adapter(base, tmp_path / name, rank, 2 * rank, False, targets, seed)
            for name, rank, targets, seed in (
                ("fused", 8, ["qkv_proj", "gate_up_proj"], 1),
                ("all", 4, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 2))}
    llm = LLM(str(path), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, (name, model) in enumerate(peft.items()):
        outs = llm.generate(prompts, params,
                            lora_request=LoRARequest(name, i + 1, str(tmp_path / name)))
        want = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == want, name
        assert want != [hf_greedy(base, p, NEW_TOKENS) for p in prompts]


def test_prefill_and_decode_engines_give_peft_tokens(adapters, checkpoints, prompts):
    """Prefill/decode disaggregation under adapters: the prefill engine computes the
    prompt's K/V under the request's adapter (k_proj and v_proj change them), the decode
    engine goes on under the same one; a batch mixing adapters and the base model."""
    path, base = checkpoints("llama")
    llm = LLM(str(path), prefill={"num_pages": 80}, decode={"num_pages": 80}, **ENGINE)
    reqs = _requests(adapters)
    names = [None, "all", "qv", "all"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=[reqs.get(n) for n in names])
    for prompt, name, out in zip(prompts, names, outs):
        model = base if name is None else adapters[name][1]
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, NEW_TOKENS), name
    pd = llm.engine
    assert pd.num_handoffs == len(prompts)
    assert pd.prefill.loras.names == pd.decode.loras.names == ["all", "qv"]
    assert not any(hf_greedy(base, p, NEW_TOKENS) == o.outputs[0].token_ids
                   for p, n, o in zip(prompts, names, outs) if n is not None)
    for side in (pd.prefill, pd.decode):
        assert side.status().num_used_pages == 0


def test_pages_are_never_shared_between_adapters(lora_llm, adapters):
    """The prefix cache keys pages by adapter: the same prompt under the base model and
    two adapters shares nothing; under one adapter again, its own pages are reused."""
    reqs = _requests(adapters)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = np.random.default_rng(99).integers(3, 300, 43).tolist()  # 10 full pages of 4
    runs = [lora_llm.generate(prompt, params, lora_request=r)[0]
            for r in (None, reqs["all"], reqs["all"], reqs["qv"], None)]
    assert [r.num_cached_tokens for r in runs] == [0, 0, 40, 0, 40]
    assert runs[1].outputs[0].token_ids == runs[2].outputs[0].token_ids
    assert runs[0].outputs[0].token_ids == runs[4].outputs[0].token_ids


def _write_config(path, **changes):
    conf = json.loads((path / "adapter_config.json").read_text())
    conf.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(conf))


def test_adapters_that_do_not_fit_are_refused_with_what_is_wrong(adapters, checkpoints,
                                                                  tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    model_dir = checkpoints("llama")[0]
    cfg = ModelConfig.from_file(model_dir)
    good = adapters["qv"][0]
    adapter = load_adapter(good, cfg)
    assert adapter.rank == 4 and sorted({m for _, m in adapter.weights}) == ["q_proj", "v_proj"]

    def variant(name, **changes):
        d = tmp_path / name
        shutil.copytree(good, d)
        if changes:
            _write_config(d, **changes)
        return d

    with pytest.raises(ValueError, match="modules_to_save"):
        load_adapter(variant("save", modules_to_save=["lm_head"]), cfg)
    with pytest.raises(ValueError, match="DoRA"):
        load_adapter(variant("dora", use_dora=True), cfg)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter(tmp_path, cfg)
    wide = variant("wide")
    tensors = load_file(wide / "adapter_model.safetensors")
    name = next(k for k in tensors if "layers.1.self_attn.v_proj.lora_A" in k)
    tensors[name] = np.zeros((4, 65), np.float32)
    save_file(tensors, wide / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_adapter(wide, cfg)


def test_requests_with_adapters_fail_alone_and_clearly(lora_llm, adapters, tmp_path):
    engine = lora_llm.engine
    with pytest.raises(ValueError, match="rank 8 > max_lora_rank"):
        from jaxserve.engine.lora import LoraManager  # an engine's with max_lora_rank 4
        LoraManager(engine.model_config, 1, 4).register(_requests(adapters)["all"])
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        lora_llm.generate([5, 6, 7], lora_request=LoRARequest("bad", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "/tmp")
    assert not engine.has_unfinished() and engine.scheduler.num_used_pages == 0
    out = lora_llm.generate([5, 6, 7], SamplingParams(max_tokens=2),
                            lora_request=_requests(adapters)["qv"])
    assert len(out[0].outputs[0].token_ids) == 2


def test_an_adapter_that_cannot_be_read_again_fails_its_request_alone(lora_llm, adapters,
                                                                     tmp_path):
    """An adapter dropped from host memory (max_cpu_loras) is read again when its request
    is admitted; if its files are gone by then, that request ends with an error naming
    the adapter and the reason, its pages freed, and the base request beside it runs."""
    import shutil

    engine = lora_llm.engine
    gone = tmp_path / "gone"
    shutil.copytree(adapters["qv"][0], gone)
    reqs = {**_requests(adapters), "gone": LoRARequest("gone", 20, str(gone))}
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for i, name in enumerate(["base", "gone", "all", "mlp"]):  # 2 host places: "gone" out
        engine.add_request(name, [5, 6, 7 + i], params, lora_request=reqs.get(name))
    shutil.rmtree(gone)
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["gone"].finish_reason == "error"
    assert "'gone'" in finished["gone"].error and "adapter_config.json" in finished["gone"].error
    assert [finished[n].finish_reason for n in ("base", "all", "mlp")] == ["length"] * 3
    assert engine.scheduler.num_used_pages == 0 and engine.loras.running() == {}
    assert engine.remove_lora("gone")


def test_an_engine_without_lora_refuses_adapters(checkpoints, adapters):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine

    engine = Engine.from_config(EngineConfig(model=str(checkpoints("llama")[0]),
                                             **{**ENGINE, "enable_lora": False}))
    with pytest.raises(ValueError, match="enable_lora=True"):
        engine.add_request("r", [5, 6], lora_request=_requests(adapters)["qv"])
    assert engine.runner.lora is None and engine.builder.empty(
        engine.builder.bucket(1, False)).lora_slots is None


@pytest.fixture(scope="module")
def lora_server(checkpoints, adapters, tmp_path_factory):
    from serverproc import running_server

    path, _ = checkpoints("llama")
    log = tmp_path_factory.mktemp("lora-http") / "server.log"
    with running_server(path, log, "--enable-lora", "--max-loras", "2", "--max-lora-rank",
                        "8", "--lora-modules", f"qv={adapters['qv'][0]}") as (target, proc):
        proc.target = target
        yield proc, path


def test_the_openai_client_reaches_adapters_by_model_name(lora_server, lora_llm, adapters,
                                                          prompts):
    """`model=<adapter>` answers as PEFT's model does (the offline engine's text, whose
    tokens are PEFT's), and the responses name it; unknown names are a 404 naming them; adapters load and unload at
    run time (a bad directory: 400) and /v1/models lists them with the base model as
    parent."""
    import httpx
    import openai

    proc, path = lora_server
    client = openai.OpenAI(base_url=f"{proc.http_url}/v1", api_key="unused", max_retries=0)
    base_name = client.models.list().data[0].id
    reqs = _requests(adapters)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def offline(name, prompt):
        out = lora_llm.generate(prompt, params, lora_request=reqs[name])[0].outputs[0]
        assert out.token_ids == hf_greedy(adapters[name][1], prompt, NEW_TOKENS)
        return out.text

    def complete(model, prompt):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        assert out.model == model  # the response names the adapter asked for, as vLLM's
        return out.choices[0].text

    prompt = prompts[1]
    want = offline("qv", prompt)
    assert complete("qv", prompt) == want
    assert complete(base_name, prompt) != want
    chunks = list(client.completions.create(model="qv", prompt=prompt, max_tokens=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and {c.model for c in chunks} == {"qv"}
    with pytest.raises(openai.NotFoundError, match="`all` does not exist"):
        complete("all", prompt)

    load = f"{proc.http_url}/v1/load_lora_adapter"
    bad = httpx.post(load, json={"lora_name": "all", "lora_path": str(path)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    ok = httpx.post(load, json={"lora_name": "all", "lora_path": str(adapters["all"][0])})
    assert ok.status_code == 200, ok.text
    assert httpx.post(load, json={"lora_name": "all", "lora_path": "x"}).status_code == 400
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {base_name, "qv", "all"}
    assert models["all"].model_extra["parent"] == base_name
    assert complete("all", prompt) == offline("all", prompt)
    gone = httpx.post(f"{proc.http_url}/v1/unload_lora_adapter", json={"lora_name": "all"})
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError):
        complete("all", prompt)
    assert httpx.post(f"{proc.http_url}/v1/unload_lora_adapter",
                      json={"lora_name": "all"}).status_code == 404
    assert complete("qv", prompt) == want  # the others serve on
    metrics = httpx.get(f"{proc.http_url}/metrics").text
    tokens = re.search(r'jaxserve:lora_generation_tokens_total\{lora_name="qv",'
                       r'model_name="[^"]*"\} (\S+)', metrics)
    assert tokens and float(tokens[1]) >= 2 * NEW_TOKENS, metrics[-2000:]


def test_grpc_requests_name_their_adapter(lora_server, lora_llm, adapters, prompts):
    import grpc

    from server.client import Client

    proc, _ = lora_server
    prompt = prompts[2]
    want = lora_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                    ignore_eos=True),
                             lora_request=_requests(adapters)["qv"])[0].outputs[0].token_ids
    client = Client(proc.target)
    try:
        ids, _, done = client.complete(prompt, lora_name="qv", max_tokens=NEW_TOKENS,
                                       temperature=0.0, ignore_eos=True)
        assert ids == want and done.finish_reason == "length"
        base, _, _ = client.complete(prompt, max_tokens=NEW_TOKENS, temperature=0.0,
                                     ignore_eos=True)
        assert base != want
        with pytest.raises(grpc.RpcError) as e:
            client.complete(prompt, lora_name="nope", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.value.details()
    finally:
        client.close()


def _dequantized_int8(base):
    """A copy of the torch model whose projections hold what our int8 weights hold: each
    `[in, out]` weight quantized per output column and back (pallas_kernels/quantized_matmul)."""
    import torch

    from pallas_kernels.quantized_matmul import dequantize, quantize

    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                       "up_proj", "down_proj"):
                w = jnp.asarray(module.weight.detach().numpy().T)
                back = np.asarray(dequantize(*quantize(w, "int8"), "int8")).T
                module.weight.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    return model


@pytest.mark.slow
def test_an_int8_base_with_ngram_speculation_and_a_grammar(checkpoints, adapters, prompts):
    """Adapters over int8 base weights give PEFT's tokens over the dequantized base, with
    n-gram speculation verifying drafts under each adapter; a constrained request under an
    adapter keeps to its regular expression."""
    from peft import PeftModel

    from jaxserve.sampling_params import StructuredOutputsParams

    path, base = checkpoints("llama")
    llm = LLM(str(path), **{**ENGINE, "num_scheduler_steps": 1}, quantization="int8",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    deq = _dequantized_int8(base)
    reqs = _requests(adapters)
    names = [None, "all", "mlp"]
    # Repeating prompts, so that prompt lookup finds drafts to verify.
    batch = [(p[:10] * 3, n) for p in prompts[:2] for n in names]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([p for p, _ in batch], params,
                        lora_request=[reqs.get(n) for _, n in batch])
    for (prompt, name), out in zip(batch, outs):
        oracle = deq if name is None else PeftModel.from_pretrained(
            copy.deepcopy(deq), str(adapters[name][0])).eval()
        assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, NEW_TOKENS), name
    assert llm.engine.speculator.stats.steps > 0  # steps verified drafts
    pattern = "[0-9]{3}-[a-z]{2}"
    shaped = llm.generate(prompts[0], SamplingParams(
        temperature=0.8, seed=3, max_tokens=12,
        structured_outputs=StructuredOutputsParams(regex=pattern)),
        lora_request=reqs["qv"])[0].outputs[0]
    assert re.fullmatch(pattern, shaped.text), shaped.text


@pytest.mark.slow
def test_adapters_on_a_mesh_give_peft_tokens(checkpoints, adapters, prompts, tmp_path):
    """Under TP=2 and 4, TP+SP and DP+TP (8 emulated devices, a process of its own) a batch
    mixing adapters and the base model gives PEFT's tokens."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path, base = checkpoints("llama")
    names = ["qv", "all", "mlp"]
    spec = {"adapters": [f"{n}={adapters[n][0]}" for n in names], "prompts": prompts[:2],
            "new_tokens": NEW_TOKENS}
    out = tmp_path / "runs.json"
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    script = Path(__file__).parent / "lora_multidevice_check.py"
    proc = subprocess.run([sys.executable, str(script), str(path), str(out), json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(out.read_text())
    want = [[n, hf_greedy(base if n is None else adapters[n][1], p, NEW_TOKENS)]
            for p in prompts[:2] for n in [None, *names]]
    for mesh, got in runs.items():
        assert got == want, mesh
