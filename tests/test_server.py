"""End-to-end: a real `jaxserve serve` process on a free localhost port."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import signal
import time

import grpc
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.huge_pages import huge_page_environment
from serverproc import ENGINE, running_server, wait_idle
from server.client import AsyncClient, Client
from server.protos.jaxserve.v1 import inference_pb2 as pb


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    path, _ = checkpoints("llama")
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(path, log, "--max-waiting", "500", "--grace", "5",
                        cold=True) as (target, proc):
        yield target, proc, path


@pytest.fixture(scope="module")
def client(server):
    c = Client(server[0])
    yield c
    c.close()


@pytest.mark.skipif(huge_page_environment({}) is None,
                    reason="needs Linux, glibc and THP in madvise mode")
def test_server_process_allocates_on_huge_pages(server):
    pid = server[1].pid  # `python -m jaxserve serve`: restarted itself, same pid
    assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in open(f"/proc/{pid}/environ", "rb").read()
    huge = [int(line.split()[1]) for line in open(f"/proc/{pid}/smaps_rollup")
            if line.startswith("AnonHugePages:")]
    assert huge[0] >= 2048  # kB: one or more 2 MiB pages


def test_reflection_lists_services(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)

    channel = grpc.insecure_channel(server[0])
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    channel.close()
    assert {"jaxserve.v1.Inference", "jetstream_proto.Orchestrator",
            "grpc.health.v1.Health"} <= services


def test_stream_equals_offline_api(server, client, prompts):
    params = dict(temperature=0.8, top_p=0.95, seed=77, max_tokens=20, ignore_eos=True)
    llm = LLM(str(server[2]), **ENGINE)
    want_ids = llm.generate([prompts[2]], SamplingParams(**params))[0].outputs[0]
    want_text = llm.generate("Hello, world", SamplingParams(**params))[0]

    messages = list(client.generate(prompts[2], **params))
    assert [m.WhichOneof("kind") for m in messages].count("complete") == 1
    assert messages[-1].HasField("complete")
    ids = [t for m in messages[:-1] for t in m.chunk.token_ids]
    assert ids == want_ids.token_ids
    done = messages[-1].complete
    assert (done.finish_reason, done.usage.prompt_tokens, done.usage.completion_tokens) == (
        "length", len(prompts[2]), 20)

    ids, text, done = client.complete("Hello, world", **params)
    assert ids == want_text.outputs[0].token_ids and text == want_text.outputs[0].text
    assert done.usage.prompt_tokens == len(want_text.prompt_token_ids)
    assert client.tokenize("Hello, world") == want_text.prompt_token_ids


def test_prompt_and_token_logprobs_over_grpc(server, client, prompts):
    """The first chunk carries the prompt's logprobs (from its second token: each with its
    rank and the top 2 there), every chunk its tokens' (top 3), as the offline API."""
    llm = LLM(str(server[2]), **ENGINE)
    params = dict(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3,
                  prompt_logprobs=2)
    want = llm.generate([prompts[1]], SamplingParams(**params))[0]
    chunks = [m.chunk for m in client.generate(prompts[1], **params) if m.HasField("chunk")]
    scored = chunks[0].prompt_logprobs
    assert not any(c.prompt_logprobs for c in chunks[1:])
    assert [s.token_id for s in scored] == prompts[1][1:]
    for s, entries in zip(scored, want.prompt_logprobs[1:]):
        assert s.logprob == pytest.approx(entries[s.token_id].logprob, abs=1e-5)
        assert s.rank == entries[s.token_id].rank
        assert [t.token_id for t in s.top] == sorted(
            (t for t, e in entries.items() if e.rank <= 2), key=lambda t: entries[t].rank)
    tokens = [lp for c in chunks for lp in c.logprobs]
    assert [t.token_id for t in tokens] == want.outputs[0].token_ids
    for t, entries in zip(tokens, want.outputs[0].logprobs):
        assert t.logprob == pytest.approx(entries[t.token_id].logprob, abs=1e-5)
        assert len(t.top) == 3 and t.rank == entries[t.token_id].rank


def test_abort_and_cancel_free_every_page(server, client, prompts):
    long = dict(max_tokens=80, ignore_eos=True, temperature=0.0)
    stream = client.generate(prompts[3], request_id="to-abort", **long)
    assert next(stream).HasField("chunk")
    assert client.status().kv_pages_used > 0
    assert client.abort("to-abort", "no-such-request") == 1  # requests aborted, not ids sent
    rest = list(stream)
    assert rest[-1].complete.finish_reason == "abort"
    assert sum(len(m.chunk.token_ids) for m in rest) < 79

    call = client.stub.Generate(pb.GenerateRequest(
        request_id="to-cancel", token_ids=pb.TokenIds(ids=prompts[1]),
        sampling=pb.SamplingParams(**long)))
    assert next(call).HasField("chunk")
    call.cancel()
    status = wait_idle(client)
    assert (status.running_requests, status.kv_pages_used) == (0, 0)


def test_deadline_is_honoured_and_frees_pages(server, client, prompts):
    long = dict(max_tokens=80, ignore_eos=True)
    start = time.perf_counter()
    assert len(client.complete(prompts[3], **long)[0]) == 80
    deadline = (time.perf_counter() - start) / 4  # a quarter of what the request takes
    received = []
    with pytest.raises(grpc.RpcError) as e:
        for msg in client.generate(prompts[3], timeout=deadline, **long):
            received += msg.chunk.token_ids
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(received) < 80
    status = wait_idle(client)
    assert (status.running_requests, status.kv_pages_used) == (0, 0)


BAD = [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=1000), "max_model_len"),
    (dict(logprobs=99), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(top_p=float("nan")), "top_p"),
]


def test_invalid_utf8_on_the_wire_is_invalid_argument(server, client):
    from server.protos.jetstream_proto import jetstream_pb2 as js

    def corrupt(message) -> bytes:  # the 2-byte text "QQ" replaced by invalid UTF-8
        data = message.SerializeToString()
        assert data.count(b"QQ") == 1
        return data.replace(b"QQ", b"\xff\xfe")

    calls = [
        ("/jaxserve.v1.Inference/Tokenize", client.channel.unary_unary,
         pb.TokenizeRequest(text="QQ")),
        ("/jaxserve.v1.Inference/Generate", client.channel.unary_stream,
         pb.GenerateRequest(text="QQ")),
        ("/jetstream_proto.Orchestrator/Decode", client.channel.unary_stream,
         js.DecodeRequest(text_content=js.DecodeRequest.TextContent(text="QQ"))),
    ]
    for method, kind, message in calls:
        call = kind(method)  # no serializers: raw bytes out, raw bytes back
        with pytest.raises(grpc.RpcError) as e:
            result = call(corrupt(message), timeout=10)
            if kind == client.channel.unary_stream:
                list(result)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
        assert "UTF-8" in e.value.details()
    assert client.tokenize("QQ")  # and the same requests, well formed, still work


def test_a_cancelled_duplicate_leaves_the_original_running(server, client, prompts):
    """Retries under the running request's id that give up before admission (short
    deadlines) are refused or time out; the original runs to its end. A retry may run
    (OK) only once the original has ended: the original is read on a thread of its own,
    which notes when its last output came (fast steps can end it within the retries)."""
    from concurrent.futures import ThreadPoolExecutor

    stream = client.generate(prompts[3], request_id="original", max_tokens=80,
                             ignore_eos=True, temperature=0.0)
    assert next(stream).HasField("chunk")

    def read_original():
        rest = list(stream)
        return rest, time.monotonic()

    def duplicate(timeout: float):
        start = time.monotonic()
        try:
            list(client.generate(prompts[0], request_id="original", timeout=timeout,
                                 max_tokens=2))
        except grpc.RpcError as e:
            return e.code(), start
        return grpc.StatusCode.OK, start

    with ThreadPoolExecutor(9) as pool:
        original = pool.submit(read_original)
        codes = list(pool.map(duplicate, [0.0005 * (1 + i % 20) for i in range(40)]))
        rest, ended = original.result()
    refused = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT}
    assert all(code in refused or (code == grpc.StatusCode.OK and start > ended)
               for code, start in codes), codes
    assert rest[-1].complete.finish_reason == "length"
    assert rest[-1].complete.usage.completion_tokens == 80


def test_big_prompts_are_refused_before_tokenizing(server, client, prompts):
    """Over --max-prompt-bytes (default 32 x max_model_len = 4 KiB here): refused at once,
    without tokenizing, while another stream goes on; over the message limit (twice that
    plus 1 MiB): refused by gRPC itself."""
    stream = client.generate(prompts[3], max_tokens=80, ignore_eos=True, temperature=0.0)
    assert next(stream).HasField("chunk")
    start = time.perf_counter()
    for prompt, code, needle in [
        ("x" * 500_000, grpc.StatusCode.INVALID_ARGUMENT, "--max-prompt-bytes"),
        ("é" * 3000, grpc.StatusCode.INVALID_ARGUMENT, "--max-prompt-bytes"),  # 6000 bytes
        ([5] * 200_000, grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
        ("x" * 3_000_000, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            client.complete(prompt, max_tokens=2)
        assert e.value.code() == code and needle in e.value.details(), e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.tokenize("x" * 500_000)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert time.perf_counter() - start < 2.0
    assert list(stream)[-1].complete.usage.completion_tokens == 80
    assert len(client.tokenize("x" * 4000)) > 0  # at the limit: taken


def test_bad_inputs_fail_alone(server, client, prompts):
    for sampling, field in BAD:
        with pytest.raises(grpc.RpcError) as e:
            client.complete(prompts[0], **sampling)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in e.value.details()
    for request, needle in [
        (pb.GenerateRequest(text=""), "empty"),
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 99999])), "vocabulary"),
        (pb.GenerateRequest(messages=pb.Chat()), "at least one message"),
        (pb.GenerateRequest(messages=pb.Chat(messages=[pb.ChatMessage(
            role="assistant", content="x", tool_calls_json="[{")])), "tool_calls_json"),
        (pb.GenerateRequest(messages=pb.Chat(messages=[pb.ChatMessage(role="user")],
                                             chat_template="{% for %}")), "does not parse"),
        (pb.GenerateRequest(sampling=pb.SamplingParams(logit_bias={5: 500.0}), text="x"),
         "logit_bias"),
        (pb.GenerateRequest(sampling=pb.SamplingParams(
            structured_outputs=pb.StructuredOutputs(regex="[a-")), text="x"),
         "unclosed character class"),
        (pb.GenerateRequest(sampling=pb.SamplingParams(
            structured_outputs=pb.StructuredOutputs(json_schema='{"type": 5}')), text="x"),
         "structured_outputs.json"),
        (pb.GenerateRequest(sampling=pb.SamplingParams(
            structured_outputs=pb.StructuredOutputs()), text="x"), "structured_outputs"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            list(client.stub.Generate(request))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in e.value.details()
    ids, _, done = client.complete(prompts[0], max_tokens=3, ignore_eos=True)
    assert len(ids) == 3 and done.finish_reason == "length"


def test_stop_string_kept_cache_salt_and_priority_over_grpc(server, client):
    """include_stop_str_in_output, allowed_token_ids, bad_words, cache_salt (a salt shares
    pages only with itself) and priority (refused by a server that schedules fcfs) reach
    the engine over gRPC."""
    greedy = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    _, plain, _ = client.complete("Hello", **greedy)
    stop = plain[3:5]
    _, text, done = client.complete("Hello", stop=[stop], include_stop_str_in_output=True,
                                    **greedy)
    assert text == plain[:plain.index(stop) + len(stop)] and done.matched_stop == stop
    ids, _, _ = client.complete("Hello", allowed_token_ids=[50, 60, 70], **greedy)
    assert set(ids) <= {50, 60, 70}
    a, b = client.tokenize("ab", add_special_tokens=False)
    words = client.complete("Hello", logit_bias={a: 6.0, b: 6.0}, **greedy)[1]
    banned = client.complete("Hello", logit_bias={a: 6.0, b: 6.0}, bad_words=["ab", "bb"],
                             **greedy)[1]
    assert "ab" in words or "bb" in words
    assert "ab" not in banned and "bb" not in banned and banned != words
    prompt = list(range(120, 150))  # 30 tokens: 7 full pages of 4, used by no other test
    cached = [client.complete(prompt, cache_salt=salt, max_tokens=2)[2].usage.cached_tokens
              for salt in ("a", "b", "", "a", "")]
    assert cached == [0, 0, 0, 28, 28]
    with pytest.raises(grpc.RpcError) as e:
        client.complete(prompt, priority=2, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--scheduling-policy priority" in e.value.details()


def test_structured_output_over_grpc(server, client, prompts):
    """A regex and a choice, greedy and sampled, beside a free request: each constrained
    output is what the constraint allows (re.fullmatch), on a random-weight model."""
    regex = r"[a-z]{3,6}-[0-9]{2}"
    calls = [dict(structured_outputs=pb.StructuredOutputs(regex=regex), temperature=0.0),
             dict(structured_outputs=pb.StructuredOutputs(regex=regex), seed=4),
             dict(structured_outputs=pb.StructuredOutputs(
                 choice=pb.Choices(choices=["left", "right"])), seed=5),
             dict(ignore_eos=True)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: client.complete(prompts[1], max_tokens=20, **c),
                                calls))
    for (ids, text, done), pattern in zip(results, [regex, regex, "left|right"]):
        assert done.finish_reason == "stop" and re.fullmatch(pattern, text), (text, done)
    assert results[3][2].finish_reason == "length"


def test_client_cli_generates_under_a_constraint(server, capsys, tmp_path):
    from jaxserve.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, '
                      '"maximum": 9}}, "required": ["n"], "additionalProperties": false}')
    regex = "[a-z]{3}-[0-9]"
    for flags, check in [(["--regex", regex], lambda t: re.fullmatch(regex, t)),
                         (["--choice", "yes", "--choice", "no"], lambda t: t in ("yes", "no")),
                         (["--json-schema", str(schema)], lambda t: 0 <= json.loads(t)["n"] <= 9)]:
        assert main(["client", "--target", server[0], "generate", "--prompt", "Hi",
                     "--max-tokens", "30", *flags]) == 0
        text = capsys.readouterr().out.split("\n")[0]
        assert check(text), (flags, text)


def test_chat_messages_equal_offline_chat(server, client):
    import argparse
    import io

    llm = LLM(str(server[2]), **ENGINE)
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello there"}]
    sampling = dict(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True)
    want = llm.chat(conversation, SamplingParams(**sampling))[0]
    ids, text, done = client.complete(conversation, **sampling)
    assert ids == want.outputs[0].token_ids and text == want.outputs[0].text
    assert done.usage.prompt_tokens == len(want.prompt_token_ids)

    # `jaxserve client chat`: each turn sends the whole conversation so far.
    args = argparse.Namespace(system="Be brief.", max_tokens=10, temperature=0.7, seed=3)
    out = io.StringIO()
    from server.client import chat
    messages = chat(client, args, io.StringIO("Hello there\nAnd then?\n\n"), out)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    first = llm.chat(messages[:2], SamplingParams(temperature=0.7, seed=3, max_tokens=10))[0]
    assert messages[2]["content"] == first.outputs[0].text
    second = llm.chat(messages[:4], SamplingParams(temperature=0.7, seed=3, max_tokens=10))[0]
    assert messages[4]["content"] == second.outputs[0].text
    assert first.outputs[0].text in out.getvalue()


def test_a_burst_gets_ok_or_resource_exhausted_never_cancelled(server, client):
    """2,000 streams at once (gRPC itself used to cancel ~10% of such a burst before any
    handler saw them): each is served or told to retry (--max-waiting 500 here)."""
    async def one(c):
        try:
            async for _ in c.generate([5, 6, 7, 8], max_tokens=2, ignore_eos=True):
                pass
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()

    async def main():
        c = AsyncClient(server[0])
        try:
            return await asyncio.gather(*(one(c) for _ in range(2000)))
        finally:
            await c.close()

    codes = asyncio.run(main())
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, \
        {code: codes.count(code) for code in set(codes)}
    assert codes.count(grpc.StatusCode.OK) >= 500
    status = wait_idle(client)
    assert (status.running_requests, status.waiting_requests) == (0, 0)


def test_200_concurrent_streams(server, client, prompts):
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 8) for _ in range(200)]

    async def one(c, i, n):
        count, completes = 0, 0
        async for msg in c.generate(prompts[i % 4], max_tokens=n, ignore_eos=True,
                                    temperature=0.0):
            count += len(msg.chunk.token_ids)
            completes += msg.HasField("complete")
        return count, completes

    async def main():
        c = AsyncClient(server[0])
        try:
            return await asyncio.gather(*(one(c, i, n) for i, n in enumerate(lengths)))
        finally:
            await c.close()

    results = asyncio.run(main())
    assert [r[0] for r in results] == lengths
    assert all(r[1] == 1 for r in results)
    status = wait_idle(client)
    assert status.kv_pages_used == 0 and status.total_generated_tokens >= sum(lengths)


def test_model_info(server, client):
    info = client.info()
    assert (info.architecture, info.vocab_size, info.max_context_length, info.page_size) == (
        "LlamaForCausalLM", 320, 128, 4)
    assert list(info.eos_token_ids) == [1] and info.num_kv_pages >= 32
    assert dict(info.mesh_shape) == {"data": 1, "model": 1}


def test_embed_matches_transformers(server, client, checkpoints):
    """The Embed RPC: text and token-id inputs, each its last-token embedding as
    transformers computes it (normalized, and raw with normalize false); a bad call fails
    alone with the status that says what to fix."""
    import numpy as np

    from test_embeddings import hf_last_hidden

    _, model = checkpoints("llama")
    text = "Hello there"
    ids = client.tokenize(text)
    got = client.embed([text, [7, 8, 9, 10, 11]])
    np.testing.assert_allclose(got[0], hf_last_hidden(model, ids), atol=2e-6)
    np.testing.assert_allclose(got[1], hf_last_hidden(model, [7, 8, 9, 10, 11]), atol=2e-6)
    raw = client.embed([[7, 8, 9, 10, 11]], normalize=False)[0]
    np.testing.assert_allclose(raw, hf_last_hidden(model, [7, 8, 9, 10, 11], False),
                               rtol=1e-5, atol=1e-5)
    response = client.stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=text)]))
    assert response.embeddings[0].prompt_tokens == len(ids)
    for kw, code, needle in (
            (dict(inputs=[]), grpc.StatusCode.INVALID_ARGUMENT, "inputs"),
            (dict(inputs=[[]]), grpc.StatusCode.INVALID_ARGUMENT, "inputs[0]"),
            (dict(inputs=["hi"], dimensions=16), grpc.StatusCode.INVALID_ARGUMENT,
             "dimensions"),
            (dict(inputs=[[5, 10 ** 6]]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
            (dict(inputs=["hi"], lora_name="nope"), grpc.StatusCode.NOT_FOUND, "lora_name")):
        with pytest.raises(grpc.RpcError) as e:
            client.embed(**kw, timeout=30)
        assert e.value.code() == code and needle in e.value.details(), (kw, e.value)
    assert len(client.embed(["still serving"])[0]) == model.config.hidden_size
    assert wait_idle(client).kv_pages_used == 0


@pytest.mark.parametrize("api,rate", [("jaxserve", float("inf")), ("jetstream", 50.0),
                                      ("openai", float("inf"))])
def test_serving_benchmark_counts(server, api, rate):
    from server.bench import run

    r = asyncio.run(run(server[0], api, num_prompts=8, input_len=8, output_len=4,
                        request_rate=rate, max_concurrency=None, seed=0,
                        http_url=server[1].http_url))
    assert (r["completed"], r["failed"]) == (8, 0)
    if api != "jetstream":  # ignore_eos: exact; JetStream may stop at EOS
        assert r["output_tokens"] == 32
    assert 8 <= r["output_tokens"] <= 32
    assert 0 < r["ttft_ms"]["median"] <= r["ttft_ms"]["p99"]
    assert r["server_mean_step_ms"] > 0 and r["server_mean_step_gap_ms"] >= 0


def test_sigint_during_warm_up_stops_cleanly(checkpoints, tmp_path):
    """Ctrl-C while the step programs compile (no compilation cache: seconds of warm-up)
    closes both ports and stops the engine process: exit 0, never serving. (It used to
    exit by KeyboardInterrupt after the program in flight, with a traceback; a server
    started with SIGINT ignored, as a shell's background job, ignored it until ready.)"""
    import os
    import subprocess
    import sys

    from serverproc import ENGINE_FLAGS, free_port

    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve", "serve", "--model", str(checkpoints("llama")[0]),
             "--port", str(free_port()), "--http-port", str(free_port()), *ENGINE_FLAGS,
             "--compilation-cache-dir", "off"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        deadline = time.monotonic() + 120
        while "503 until warm-up ends" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]
        text = log.read_text()
        assert "signalled during warm-up: stopping" in text and "ready: serving" not in text
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_drains_and_exits_zero(server, client, prompts):
    """Last test of the module: SIGTERM with a request in flight."""
    target, proc, _ = server
    stream = client.generate(prompts[1], max_tokens=40, ignore_eos=True)
    assert next(stream).HasField("chunk")
    proc.send_signal(signal.SIGTERM)
    rest = list(stream)  # finishes within the grace period (or is aborted): never hangs
    assert rest[-1].HasField("complete")
    assert proc.wait(timeout=60) == 0

