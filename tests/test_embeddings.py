"""Embeddings (vLLM's LLM.embed and PoolingParams): a prompt's final hidden state at its last
token, after the last norm (last-token pooling), against transformers' last_hidden_state."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from jaxserve import LLM, PoolingParams, SamplingParams
from jaxserve.loading.pooling_config import read_pooling
from test_prompt_logprobs import assert_prompt_logprobs, hf_logprobs

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, token_buckets=(16,), enable_prefix_caching=True)


def hf_last_hidden(model, prompt: list[int], normalize: bool = True) -> np.ndarray:
    """transformers' final hidden state (after the last norm) at the prompt's last token."""
    with torch.no_grad():
        h = model.model(torch.tensor([prompt])).last_hidden_state[0, -1].float().numpy()
    return h / np.linalg.norm(h) if normalize else h


@pytest.fixture(scope="module")
def llm(checkpoints):
    """Chunks of 16 tokens (the 30- and 43-token prompts take several steps)."""
    return LLM(str(checkpoints("llama")[0]), **ENGINE)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_embeddings_match_transformers(llm, checkpoints, prompts, arch):
    """Each prompt's embedding, across its chunks, normalized and not: Llama 3, Qwen2,
    Gemma 2 (its norm's +1 offset)."""
    path, model = checkpoints(arch)
    if arch != "llama":
        llm = LLM(str(path), **ENGINE)
    outs = llm.embed(prompts)
    assert [o.prompt_token_ids for o in outs] == prompts
    for prompt, out in zip(prompts, outs):
        want = hf_last_hidden(model, prompt)
        assert len(out.outputs.embedding) == model.config.hidden_size
        np.testing.assert_allclose(out.outputs.embedding, want, atol=2e-6)
    raw = llm.embed(prompts[2], PoolingParams(normalize=False))[0].outputs.embedding
    np.testing.assert_allclose(raw, hf_last_hidden(model, prompts[2], False), rtol=1e-5,
                               atol=1e-5)
    assert abs(np.linalg.norm(raw) - 1) > 0.1  # not normalized: a different vector


def test_embeddings_beside_generation_and_prompt_logprobs(llm, checkpoints, prompts):
    """Embedding requests share steps with requests that generate and that score their
    prompts (a step both scoring and pooling): each gets what it would alone, and a
    second embedding of a prompt from the prefix cache is the same."""
    _, model = checkpoints("llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], greedy)]
    engine = llm.engine
    scored = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    engine.add_request("gen0", prompts[0], greedy)
    engine.add_request("emb3", prompts[3], pooling=PoolingParams())
    engine.add_request("score2", prompts[2], scored)
    engine.add_request("gen1", prompts[1], greedy)
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    tokens = {rid: [t for o in os_ for t in o.new_token_ids] for rid, os_ in outs.items()}
    assert [tokens["gen0"], tokens["gen1"]] == alone
    assert len(outs["emb3"]) == 1 and outs["emb3"][0].finished
    assert (outs["emb3"][0].new_token_ids, outs["emb3"][0].finish_reason) == ([], "stop")
    np.testing.assert_allclose(outs["emb3"][0].pooled, hf_last_hidden(model, prompts[3]),
                               atol=2e-6)
    assert all(o.pooled is None for rid in ("gen0", "gen1", "score2") for o in outs[rid])
    assert_prompt_logprobs(outs["score2"][0].prompt_logprobs, prompts[2],
                           hf_logprobs(model, prompts[2]), 2)
    again = engine.add_request("emb3b", prompts[3], pooling=PoolingParams())
    assert again == prompts[3]
    cached = [o for o in engine.step() if o.request_id == "emb3b"]
    while not cached:
        cached = [o for o in engine.step() if o.request_id == "emb3b"]
    assert cached[0].num_cached_tokens == 40  # its full pages but the last token's
    np.testing.assert_allclose(cached[0].pooled, outs["emb3"][0].pooled, atol=1e-6)


def test_dimensions_need_a_matryoshka_model(llm, checkpoints, prompts, tmp_path):
    """`dimensions` is refused for a model not trained for it; for one whose config.json
    names its sizes, the first N entries, then normalized (vLLM's order)."""
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed(prompts[0], PoolingParams(dimensions=16))
    path, model = checkpoints("llama")
    shutil.copytree(path, tmp_path / "m", dirs_exist_ok=True)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    small = LLM(str(tmp_path / "m"), **ENGINE)
    got = small.embed(prompts[1], PoolingParams(dimensions=16))[0].outputs.embedding
    want = hf_last_hidden(model, prompts[1], False)[:16]
    np.testing.assert_allclose(got, want / np.linalg.norm(want), atol=2e-6)
    for bad in (8, 0, 1000):
        with pytest.raises(ValueError, match="dimensions"):
            small.embed(prompts[1], PoolingParams(dimensions=bad))


def _sentence_transformers_dir(path, tmp_path, pooling: dict, normalize: bool):
    """A copy of a checkpoint with sentence-transformers' module files, as its
    save() writes them."""
    out = tmp_path
    shutil.copytree(path, out, dirs_exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    flags = {k: False for k in ("pooling_mode_cls_token", "pooling_mode_mean_tokens",
                                "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")}
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, **flags, **pooling}))
    return out


def hf_hidden(model, prompt: list[int]) -> np.ndarray:
    """transformers' final hidden states (after the last norm), `[len(prompt), hidden]`."""
    with torch.no_grad():
        return model.model(torch.tensor([prompt])).last_hidden_state[0].float().numpy()


def test_sentence_transformers_modules(checkpoints, prompts, tmp_path):
    """A checkpoint's sentence-transformers modules decide: last-token pooling without a
    Normalize module comes back unnormalized; mean pooling averages every prompt token
    across its chunks (none read from the prefix cache, a second request the same); CLS
    pooling reads the first token; max pooling, or a module jaxserve does not run, is
    refused with the reason."""
    path, model = checkpoints("llama")
    last = _sentence_transformers_dir(path, tmp_path / "last", {"pooling_mode_lasttoken": True},
                                      False)
    pooling = read_pooling(last)
    assert (pooling.kind, pooling.normalize, pooling.unsupported) == ("last", False, None)
    llm = LLM(str(last), **ENGINE)
    got = llm.embed(prompts[0])[0].outputs.embedding
    np.testing.assert_allclose(got, hf_last_hidden(model, prompts[0], False), rtol=1e-5,
                               atol=1e-5)
    got = llm.embed(prompts[0], PoolingParams(normalize=True))[0].outputs.embedding
    np.testing.assert_allclose(got, hf_last_hidden(model, prompts[0]), atol=2e-6)

    mean = _sentence_transformers_dir(path, tmp_path / "mean",
                                      {"pooling_mode_mean_tokens": True}, True)
    assert read_pooling(mean).kind == "mean"
    llm.engine.pooling = read_pooling(mean)  # (the same weights: no second engine)
    for prompt in prompts:  # 5 to 43 tokens: one to three chunks of 16
        want = hf_hidden(model, prompt).mean(0)
        for _ in range(2):  # the second time its pages are in the prefix cache
            got = llm.embed(prompt)[0].outputs.embedding
            np.testing.assert_allclose(got, want / np.linalg.norm(want), atol=2e-6)
    cls = _sentence_transformers_dir(path, tmp_path / "cls", {"pooling_mode_cls_token": True},
                                     False)
    llm.engine.pooling = read_pooling(cls)
    got = llm.embed(prompts[3])[0].outputs.embedding
    np.testing.assert_allclose(got, hf_hidden(model, prompts[3])[0], rtol=1e-5, atol=1e-5)

    most = _sentence_transformers_dir(path, tmp_path / "max",
                                      {"pooling_mode_max_tokens": True}, True)
    assert "pools by max" in read_pooling(most).unsupported
    llm.engine.pooling = read_pooling(most)
    with pytest.raises(ValueError, match="pools by max"):
        llm.embed(prompts[0])
    modules = json.loads((last / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                       "type": "sentence_transformers.models.Dense"})
    (last / "modules.json").write_text(json.dumps(modules))
    assert "'Dense'" in read_pooling(last).unsupported


def test_a_preempted_mean_pooled_prompt_starts_over(checkpoints, tmp_path):
    """A mean-pooled prompt preempted between its chunks (a KV pool too small for four
    requests) is recomputed from its first token: its embedding is still the mean over
    the prompt once."""
    path, model = checkpoints("llama")
    mean = _sentence_transformers_dir(path, tmp_path, {"pooling_mode_mean_tokens": True},
                                      True)
    llm = LLM(str(mean), **{**ENGINE, "max_model_len": 64, "num_pages": 16})
    engine, rng = llm.engine, np.random.default_rng(5)
    for i in range(3):
        engine.add_request(f"g{i}", rng.integers(3, 200, size=6).tolist(),
                           SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    prompt = rng.integers(3, 200, size=43).tolist()
    engine.add_request("emb", prompt, pooling=PoolingParams())
    seq = engine._requests["emb"].seq
    got = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "emb":
                got = out.pooled
    assert seq.num_preemptions > 0
    want = hf_hidden(model, prompt).mean(0)
    np.testing.assert_allclose(got, want / np.linalg.norm(want), atol=2e-6)


def test_a_failed_request_leaves_no_other_behind(llm, prompts, monkeypatch):
    """A request a step fails (finish_reason "error", e.g. an adapter that could not be
    read) makes LLM.embed raise naming it, with the call's other requests aborted: none
    left running, every page free, and the next call answers."""
    from jaxserve.outputs import StepOutput

    engine, real = llm.engine, llm.engine.step
    seen: list[str] = []

    def step():
        outs = real()
        if not seen and engine.has_unfinished():  # the first step: fail one request
            rid = next(iter(engine._requests))
            seen.append(rid)
            return outs + [StepOutput(rid, [], "", None, True, "error", error="injected")]
        return outs

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(RuntimeError, match="injected"):
        llm.embed(prompts)
    assert seen and not engine.has_unfinished()
    assert engine.scheduler.allocator.num_used_pages == 0
    monkeypatch.undo()
    assert len(llm.embed(prompts[:2])) == 2


def test_the_pooler_config_overrides_the_checkpoint(checkpoints, prompts, tmp_path):
    """vLLM's --pooler-config over a plain decoder checkpoint: mean pooling, not
    normalized, a default `dimensions` (a Matryoshka model's; refused at load for one
    that is not); keys and values not served are refused by name."""
    path, model = checkpoints("llama")
    llm = LLM(str(path), **ENGINE, pooler_config={"pooling_type": "MEAN",
                                                  "use_activation": False})
    for prompt in prompts[2:4]:  # across chunks, from the prefix cache the second time
        for _ in range(2):
            got = llm.embed(prompt)[0].outputs.embedding
            np.testing.assert_allclose(got, hf_hidden(model, prompt).mean(0), rtol=1e-5,
                                       atol=1e-5)
    shutil.copytree(path, tmp_path / "m")
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**hf, "is_matryoshka": True}))
    short = LLM(str(tmp_path / "m"), **ENGINE, pooler_config={"dimensions": 16})
    got = short.embed(prompts[0])[0].outputs.embedding
    want = hf_last_hidden(model, prompts[0], False)[:16]
    np.testing.assert_allclose(got, want / np.linalg.norm(want), atol=2e-6)
    assert len(short.embed(prompts[0], PoolingParams(dimensions=32))[0].outputs.embedding) == 32
    for bad, match in (({"dimensions": 16}, "Matryoshka"), ({"pooling_type": "MAX"}, "MEAN"),
                       ({"normalize": True}, "known")):
        with pytest.raises(ValueError, match=match):
            LLM(str(path), **ENGINE, pooler_config=bad)
