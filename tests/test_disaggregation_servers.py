"""Prefill and decode servers behind `jaxserve router`, each a process of its own: the
`openai` package (and a gRPC client) gets one server's answers through the router, the K/V
moved by jax.experimental.transfer; K/V that no decode server pulls are released after
kv_hold_seconds; a prefill server killed while its K/V stream out over gRPC fails that
request alone (503 naming the transfer), leaves no page taken, and the router goes on with
the prefill servers left.

Slow (five processes start): CI runs it with the slow set.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import time

import grpc
import httpx
import numpy as np
import openai
import pytest

from conftest import save_peft_adapter
from serverproc import ENGINE, running_router, running_server
from server.protos.jaxserve.v1 import inference_pb2 as pb
from server.protos.jaxserve.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

# The router's prefill server moves K/V device to device (jax.experimental.transfer);
# the one that is killed streams them as bytes over gRPC, 1 KiB chunks 0.3 s apart.
PRODUCER = '{"kv_role": "kv_producer", "kv_hold_seconds": 8, "kv_connector": "jax"}'
SLOW_PRODUCER = '{"kv_role": "kv_producer", "kv_chunk_bytes": 1024}'
CONSUMER = '{"kv_role": "kv_consumer"}'
ADAPTER = "ad"


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^jaxserve:{name}(?:_total)?{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"{name} not in {url}/metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def cluster(checkpoints, tmp_path_factory):
    model, base = checkpoints("llama8")
    logs = tmp_path_factory.mktemp("pd")
    # The single, prefill and decode servers serve an adapter (ADAPTER) beside the base.
    adapter = tmp_path_factory.mktemp("adapter")
    save_peft_adapter(base, adapter)  # every projection: K/V change with it
    lora = ("--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapter}")
    with contextlib.ExitStack() as stack:
        servers, targets = {}, {}
        for name, flags, env in (
                ("single", lora, {}),
                ("prefill", ("--kv-transfer-config", PRODUCER, *lora), {}),
                ("slow prefill", ("--kv-transfer-config", SLOW_PRODUCER),
                 {"JAXSERVE_TEST_KV_CHUNK_DELAY_S": "0.3"}),
                ("decode", ("--kv-transfer-config", CONSUMER, *lora), {})):
            with _env(env):
                targets[name], servers[name] = stack.enter_context(
                    running_server(model, logs / f"{name}.log", *flags))
                servers[name].grpc = targets[name]
        router = stack.enter_context(running_router(
            [servers["prefill"].http_url], [servers["decode"].http_url], logs / "router.log",
            ([targets["prefill"]], [targets["decode"]])))
        yield servers, router, logs


@contextlib.contextmanager
def _env(extra: dict):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_router_answers_as_one_server(cluster):
    servers, router, _ = cluster
    one, pd = _client(servers["single"].http_url), _client(router)
    model = one.models.list().data[0].id
    cases = [dict(prompt="a prompt of several tokens", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True}),
             dict(prompt="sampled with a seed", max_tokens=12, temperature=0.9, seed=7,
                  extra_body={"ignore_eos": True}),
             dict(prompt="top-p and penalties", max_tokens=10, temperature=0.8, top_p=0.9,
                  seed=3, frequency_penalty=0.5, extra_body={"ignore_eos": True}),
             dict(prompt="one token only", max_tokens=1, temperature=0),
             dict(prompt="with logprobs", max_tokens=6, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True}),
             dict(prompt="echoed, scored", max_tokens=4, temperature=0, logprobs=1,
                  echo=True, extra_body={"ignore_eos": True}),
             dict(prompt="with token ids", max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})]
    for kw in cases:
        want = one.completions.create(model=model, **kw)
        got = pd.completions.create(model=model, **kw)
        w, g = want.choices[0], got.choices[0]
        assert (g.text, g.finish_reason) == (w.text, w.finish_reason), kw
        assert g.model_extra == w.model_extra  # return_token_ids: the same ids
        assert got.usage.completion_tokens == want.usage.completion_tokens
        if kw.get("logprobs"):
            assert g.logprobs.tokens == w.logprobs.tokens
            assert g.logprobs.text_offset == w.logprobs.text_offset
            assert g.logprobs.token_logprobs == pytest.approx(w.logprobs.token_logprobs,
                                                              abs=1e-4)  # echo: None first
        chunks = [c for c in pd.completions.create(model=model, stream=True, **kw)
                  if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == w.text, kw
        if "token_ids" in w.model_extra:
            assert chunks[0].choices[0].model_extra["prompt_token_ids"] == \
                w.model_extra["prompt_token_ids"]
            assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == \
                w.model_extra["token_ids"]
            assert all("prompt_token_ids" not in c.choices[0].model_extra for c in chunks[1:])
    # vLLM's prompt_logprobs: the prefill server's, once (not asked of the decode server).
    kw = dict(prompt="scored twice", max_tokens=3, temperature=0,
              extra_body={"prompt_logprobs": 1})
    want, got = (c.completions.create(model=model, **kw).model_dump()["choices"][0]
                 for c in (one, pd))
    assert got["text"] == want["text"] and len(got["prompt_logprobs"]) > 2
    assert got["prompt_logprobs"][0] is None
    for g, w in zip(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:]):
        assert g.keys() == w.keys()
        assert all(abs(g[t]["logprob"] - w[t]["logprob"]) < 1e-4 for t in g)
    messages = [{"role": "user", "content": "hello, who are you?"}]
    for kw in (dict(max_tokens=12, temperature=0), dict(max_tokens=9, temperature=1.0, seed=5),
               dict(max_tokens=5, temperature=0, extra_body={"return_token_ids": True}),
               dict(max_tokens=1, temperature=0)):  # ends on the prefill server
        want = one.chat.completions.create(model=model, messages=messages, **kw)
        got = pd.chat.completions.create(model=model, messages=messages, **kw)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert (got.model_extra.get("prompt_token_ids"), got.choices[0].model_extra) == (
            want.model_extra.get("prompt_token_ids"), want.choices[0].model_extra)
        chunks = list(pd.chat.completions.create(model=model, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            want.choices[0].message.content
        if "extra_body" in kw:
            assert chunks[0].model_extra["prompt_token_ids"] == want.model_extra[
                "prompt_token_ids"]
            assert [t for c in chunks if c.choices
                    for t in c.choices[0].model_extra.get("token_ids", [])] == \
                want.choices[0].model_extra["token_ids"]
        assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    # Every handed-off request's K/V were pulled; none left held, no page left taken.
    prefill, decode = servers["prefill"].http_url, servers["decode"].http_url
    assert _metric(prefill, "kv_transfer_sent") == _metric(decode, "kv_transfer_pulled") > 0
    assert _metric(decode, "kv_transfer_pulled_bytes") > 0
    assert _metric(prefill, "kv_transfer_held") == 0
    for url in (prefill, decode):
        assert _metric(url, "kv_cache_usage_perc") == 0
    text = httpx.get(router + "/metrics").text
    assert "jaxserve:router_kv_transfer_bytes_count" in text
    for phase in ("queue", "prefill", "transfer", "first_decode"):
        assert f'jaxserve:router_ttft_phase_seconds_count{{phase="{phase}"}}' in text
    # The prefix cache works on the prefill side: a prompt again finds its pages there.
    hits = _metric(prefill, "prefix_cache_hits")
    long = "a prompt long enough to fill several pages of four tokens " * 2
    for _ in range(2):
        pd.completions.create(model=model, prompt=long, max_tokens=3, temperature=0)
    assert _metric(prefill, "prefix_cache_hits") - hits >= 100
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        pd.completions.create(model=model, prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="beam search"):
        pd.completions.create(model=model, prompt="x", max_tokens=2,
                              extra_body={"use_beam_search": True})


def test_router_answers_under_an_adapter_as_one_server(cluster):
    """A request naming the adapter: prefilled under it (its K/V), decoded under it."""
    servers, router, _ = cluster
    one, pd = _client(servers["single"].http_url), _client(router)
    base = one.models.list().data[0].id
    kw = dict(prompt="an adapter's own words", max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    want = one.completions.create(model=ADAPTER, **kw).choices[0].text
    assert want != one.completions.create(model=base, **kw).choices[0].text
    assert pd.completions.create(model=ADAPTER, **kw).choices[0].text == want
    messages = [{"role": "user", "content": "hello, who are you?"}]
    want = one.chat.completions.create(model=ADAPTER, messages=messages, max_tokens=10,
                                       temperature=0.9, seed=4)
    got = pd.chat.completions.create(model=ADAPTER, messages=messages, max_tokens=10,
                                     temperature=0.9, seed=4)
    assert got.choices[0].message.content == want.choices[0].message.content
    # An adapter the servers do not serve fails alone, with the model named.
    with pytest.raises(openai.NotFoundError, match="nope"):
        pd.completions.create(model="nope", prompt="x", max_tokens=2)


def test_router_serves_the_responses_api(cluster):
    """OpenAI's Responses API through the router: the single server's responses (text,
    status, token counts) whole (the body validated by the openai package's Response
    type) and streamed (each event by its event types; a request that ends with its first
    token on the prefill server too), continued by previous_response_id and retrieved from
    the router's store; the prompt's pages written to the prefill server's prefix cache
    (its page size reaches the router); tools refused as on the chat route."""
    from openai.types.responses import Response
    from test_http_server import _events

    servers, router, _ = cluster
    one, pd = _client(servers["single"].http_url), _client(router)
    model = one.models.list().data[0].id
    for kw in (dict(max_output_tokens=8, temperature=0.0),
               dict(max_output_tokens=10, temperature=0.9, extra_body={"seed": 5}),
               dict(max_output_tokens=1, temperature=0.0)):
        ask = dict(model=model, instructions="Be brief.", input="Hello there", **kw)
        want = one.responses.create(**ask)
        got = Response.model_validate(pd.responses.with_raw_response.create(**ask)
                                      .http_response.json())
        assert (got.output_text, got.status) == (want.output_text, want.status), kw
        assert (got.usage.input_tokens, got.usage.output_tokens) == (
            want.usage.input_tokens, want.usage.output_tokens)
        details = got.usage.input_tokens_details
        assert details.cached_tokens + details.cache_write_tokens == \
            got.usage.input_tokens // ENGINE["page_size"] * ENGINE["page_size"]
        body = {**{k: v for k, v in ask.items() if k != "extra_body"},
                **kw.get("extra_body", {})}
        events = _events(router, body)
        assert "".join(e["delta"] for e in events
                       if e["type"] == "response.output_text.delta") == want.output_text, kw
        last = events[-1]
        assert last["type"] == f"response.{want.status}"
        assert last["response"]["usage"]["output_tokens"] == want.usage.output_tokens
    # The text's logprobs: the prefill server's first token's joined to the decode's.
    ask = dict(model=model, input="Hello there", max_output_tokens=6, temperature=0.0,
               include=["message.output_text.logprobs"], top_logprobs=2)
    lp_want, lp_got = ([x.model_dump() for x in c.responses.create(**ask).output[0]
                        .content[0].logprobs] for c in (one, pd))
    streamed = [x for e in _events(router, ask) if e["type"] == "response.output_text.delta"
                for x in e["logprobs"]]
    for lps in (lp_got, streamed):
        assert [x["token"] for x in lps] == [x["token"] for x in lp_want]
        assert len(lp_want) == 6
        assert [x["logprob"] for x in lps] == pytest.approx([x["logprob"] for x in lp_want],
                                                           abs=1e-4)
    second = dict(model=model, input="And again?", max_output_tokens=8, temperature=0.0)
    assert pd.responses.create(previous_response_id=got.id, **second).output_text == \
        one.responses.create(previous_response_id=want.id, **second).output_text
    assert pd.responses.retrieve(got.id).output_text == got.output_text
    with pytest.raises(openai.NotFoundError):
        pd.responses.retrieve(want.id)  # the single server's, not the router's
    with pytest.raises(openai.BadRequestError, match="tools"):
        pd.responses.create(model=model, input="x", tools=[{
            "type": "function", "name": "f", "parameters": {"type": "object"}}])
    r = httpx.post(router + "/v1/responses", json={"input": "x", "background": True})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "background")


def test_router_loads_adapters_on_every_server(cluster, checkpoints, tmp_path):
    """/v1/load_lora_adapter through the router loads on the prefill and the decode server
    (the router's completions under it are then the single server's), unloads from both;
    a load one server refuses is undone on the others; /tokenize, /detokenize,
    /v1/embeddings, /rerank and /version are a decode server's."""
    servers, router, logs = cluster
    _, base = checkpoints("llama8")
    save_peft_adapter(base, tmp_path, seed=3)
    one, pd = _client(servers["single"].http_url), _client(router)
    load = {"lora_name": "ad2", "lora_path": str(tmp_path)}
    assert httpx.post(servers["single"].http_url + "/v1/load_lora_adapter",
                      json=load).status_code == 200
    r = httpx.post(router + "/v1/load_lora_adapter", json=load)
    assert r.status_code == 200, r.text
    for name in ("prefill", "decode"):
        assert "ad2" in [m["id"] for m in httpx.get(
            servers[name].http_url + "/v1/models").json()["data"]]
    kw = dict(prompt="a second adapter", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    want = one.completions.create(model="ad2", **kw).choices[0].text
    assert want != one.completions.create(model=ADAPTER, **kw).choices[0].text
    assert pd.completions.create(model="ad2", **kw).choices[0].text == want
    r = httpx.post(router + "/v1/load_lora_adapter", json=load)  # the name is taken
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_name")
    assert httpx.post(router + "/v1/unload_lora_adapter",
                      json={"lora_name": "ad2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        pd.completions.create(model="ad2", **kw)
    assert httpx.post(router + "/v1/unload_lora_adapter",
                      json={"lora_name": "ad2"}).status_code == 404
    # The slow prefill server has no LoRA: a load it refuses is undone on the other.
    with running_router([servers["prefill"].http_url], [servers["slow prefill"].http_url],
                        logs / "router2.log") as other:
        r = httpx.post(other + "/v1/load_lora_adapter", json={**load, "lora_name": "ad3"})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        assert servers["slow prefill"].http_url in r.json()["error"]["message"]
        assert "ad3" not in [m["id"] for m in httpx.get(
            servers["prefill"].http_url + "/v1/models").json()["data"]]
    for path, body in (("/tokenize", {"prompt": "some words"}),
                       ("/detokenize", {"tokens": [5, 6, 7]})):
        got = httpx.post(router + path, json=body)
        assert got.status_code == 200 and got.json() == httpx.post(
            servers["single"].http_url + path, json=body).json()
    body = {"input": ["some words", "and more words"]}
    got, want = (httpx.post(url + "/v1/embeddings", json=body).json()["data"]
                 for url in (router, servers["single"].http_url))
    np.testing.assert_allclose([d["embedding"] for d in got], [d["embedding"] for d in want],
                               atol=1e-6)
    body = {"query": "some words", "documents": ["and more words", "other text", "words"]}
    got, want = (httpx.post(url + "/rerank", json=body).json()["results"]
                 for url in (router, servers["single"].http_url))
    assert [r["index"] for r in got] == [r["index"] for r in want]
    np.testing.assert_allclose([r["relevance_score"] for r in got],
                               [r["relevance_score"] for r in want], atol=1e-6)
    bad = httpx.post(router + "/detokenize", json={"tokens": [10 ** 9]})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tokens")
    assert httpx.get(router + "/version").json() == httpx.get(
        servers["single"].http_url + "/version").json()


def _generate(target: str, **request) -> tuple[list[int], str, pb.Complete]:
    with grpc.insecure_channel(target) as channel:
        responses = list(pb_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(**request), timeout=120))
    ids = [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]
    text = "".join(r.chunk.text for r in responses if r.HasField("chunk"))
    return ids, text, responses[-1].complete


def test_router_grpc_answers_as_one_server(cluster):
    """Generate through the router's gRPC is the single server's; Embed is a decode
    server's."""
    servers, router, _ = cluster
    cases = [dict(text="tokens over gRPC", sampling=pb.SamplingParams(
                 temperature=0, max_tokens=14, ignore_eos=True)),
             dict(token_ids=pb.TokenIds(ids=list(range(5, 40))), sampling=pb.SamplingParams(
                 temperature=0.9, seed=21, max_tokens=10, ignore_eos=True, logprobs=2)),
             dict(messages=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")]),
                  sampling=pb.SamplingParams(temperature=0, max_tokens=8)),
             dict(text="one", sampling=pb.SamplingParams(temperature=0, max_tokens=1)),
             dict(text="scored over gRPC", sampling=pb.SamplingParams(
                 temperature=0, max_tokens=6, prompt_logprobs=1))]
    for request in cases:
        want = _generate(servers["single"].grpc, **request)
        got = _generate(router.grpc, **request)
        assert got[:2] == want[:2], request
        assert (got[2].finish_reason, got[2].usage.completion_tokens) == \
            (want[2].finish_reason, want[2].usage.completion_tokens)
        assert not got[2].kv_transfer_params_json
    with grpc.insecure_channel(router.grpc) as channel:  # the prefill server's first chunk
        chunks = [r.chunk for r in pb_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(**cases[-1]), timeout=120) if r.HasField("chunk")]
    assert len(chunks[0].prompt_logprobs) > 1 and not any(c.prompt_logprobs
                                                          for c in chunks[1:])
    with pytest.raises(grpc.RpcError) as e:
        _generate(router.grpc, text="x", kv_transfer_params_json="{}")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    embed = pb.EmbedRequest(inputs=[pb.EmbedInput(text="embedded over gRPC")])
    score = pb.ScoreRequest(queries=["a query"], documents=["one document", "another"])
    answers = []
    for target in (router.grpc, servers["single"].grpc):
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            answers.append((stub.Embed(embed, timeout=60), stub.Score(score, timeout=60)))
    (got, got_scores), (want, want_scores) = answers
    assert got.embeddings[0].prompt_tokens == want.embeddings[0].prompt_tokens
    np.testing.assert_allclose(got.embeddings[0].values, want.embeddings[0].values, atol=1e-6)
    np.testing.assert_allclose([x.score for x in got_scores.scores],
                               [x.score for x in want_scores.scores], atol=1e-6)


def test_kv_never_pulled_is_released(cluster):
    servers, _, _ = cluster
    prefill, decode = servers["prefill"].http_url, servers["decode"].http_url
    expired = _metric(prefill, "kv_transfer_expired")
    r = httpx.post(prefill + "/v1/completions", json={
        "prompt": "nobody pulls these pages", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True}}).json()
    kv = r["kv_transfer_params"]
    assert r["usage"]["completion_tokens"] == 1 and kv["num_prompt_tokens"] > 0
    assert _metric(prefill, "kv_transfer_held") == 1
    assert _metric(prefill, "kv_cache_usage_perc") == 0  # held outside the pool
    deadline = time.monotonic() + 30
    while _metric(prefill, "kv_transfer_held") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _metric(prefill, "kv_transfer_expired") == expired + 1
    assert _metric(prefill, "kv_transfer_held_bytes") == 0
    late = httpx.post(decode + "/v1/completions", json={
        "prompt": "nobody pulls these pages", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "kv_transfer_params": {**kv, "do_remote_prefill": True}})
    assert late.status_code == 503
    assert "not pulled within kv_hold_seconds" in late.json()["error"]["message"]
    assert _metric(decode, "kv_cache_usage_perc") == 0


def test_prefill_killed_mid_transfer(cluster):
    """The slow prefill server dies while a decode server pulls from it: that request
    fails with 503 naming the transfer, the decode server keeps no page and serves on,
    and a router that lists the dead server first still answers (the other one)."""
    servers, _, logs = cluster
    slow, decode = servers["slow prefill"], servers["decode"].http_url
    body = {"prompt": "a prompt whose pages stream out slowly " * 2, "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    kv = httpx.post(slow.http_url + "/v1/completions", json={
        **body, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    failed = _metric(decode, "kv_transfer_failed")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, decode + "/v1/completions",
                              json={**body, "kv_transfer_params": {**kv,
                                                                   "do_remote_prefill": True}},
                              timeout=60)
        time.sleep(1.5)  # a few chunks in
        assert not pending.done()
        slow.kill()
        r = pending.result()
    assert r.status_code == 503, r.text
    assert kv["transfer_id"] in r.json()["error"]["message"]
    assert _metric(decode, "kv_transfer_failed") == failed + 1
    assert _metric(decode, "kv_cache_usage_perc") == 0
    assert _metric(decode, "num_requests_running") == 0
    with running_router([slow.http_url, servers["prefill"].http_url], [decode],
                 logs / "router2.log") as url:
        got = _client(url).completions.create(
            model=_client(decode).models.list().data[0].id, prompt=body["prompt"],
            max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 6
