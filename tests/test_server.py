"""End-to-end: a real `jaxserve serve` process on a free localhost port."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve import LLM, SamplingParams
from server.client import AsyncClient, Client
from server.protos.jaxserve.v1 import inference_pb2 as pb

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "128", "--page-size", "4",
                "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    channel = grpc.insecure_channel(target)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    seen_not_serving = False
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited during start-up"
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                channel.close()
                assert seen_not_serving, "health was never NOT_SERVING during warm-up"
                return
            seen_not_serving = True
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not become SERVING")


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    path, _ = checkpoints("llama")
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(path), "--port",
             str(port), "--max-waiting", "500", "--grace", "5", *ENGINE_FLAGS],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, proc)
    except BaseException:
        proc.kill()
        print(log.read_text())
        raise
    yield target, proc, path
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    c = Client(server[0])
    yield c
    c.close()


def wait_idle(client: Client, timeout: float = 10) -> pb.ServerStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = client.status()
        if (status.running_requests == 0 and status.waiting_requests == 0) or \
                time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def test_reflection_lists_services(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)

    channel = grpc.insecure_channel(server[0])
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    channel.close()
    assert {"jaxserve.v1.Inference", "grpc.health.v1.Health"} <= services


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


def test_abort_and_cancel_free_every_page(server, client, prompts):
    long = dict(max_tokens=80, ignore_eos=True, temperature=0.0)
    stream = client.generate(prompts[3], request_id="to-abort", **long)
    assert next(stream).HasField("chunk")
    assert client.status().kv_pages_used > 0
    client.abort("to-abort", "no-such-request")
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
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(prompts[3], timeout=0.05, max_tokens=80, ignore_eos=True))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    status = wait_idle(client)
    assert (status.running_requests, status.kv_pages_used) == (0, 0)


BAD = [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=1000), "max_model_len"),
    (dict(logprobs=99), "logprobs"),
]


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
    ]:
        with pytest.raises(grpc.RpcError) as e:
            list(client.stub.Generate(request))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in e.value.details()
    ids, _, done = client.complete(prompts[0], max_tokens=3, ignore_eos=True)
    assert len(ids) == 3 and done.finish_reason == "length"


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
    assert 1 in info.eos_token_ids and info.num_kv_pages >= 32
    assert dict(info.mesh_shape) == {"data": 1, "model": 1}


def test_sigterm_drains_and_exits_zero(server, client, prompts):
    """Last test of the module: SIGTERM with a request in flight."""
    target, proc, _ = server
    stream = client.generate(prompts[1], max_tokens=40, ignore_eos=True)
    assert next(stream).HasField("chunk")
    proc.send_signal(signal.SIGTERM)
    rest = list(stream)  # finishes within the grace period (or is aborted): never hangs
    assert rest[-1].HasField("complete")
    assert proc.wait(timeout=60) == 0
