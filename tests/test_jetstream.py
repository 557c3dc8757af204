"""JetStream's Orchestrator API, and a full waiting queue, on a server with --max-waiting 1.

The stubs come from server/protos/jetstream_proto/jetstream.proto, written from JetStream's
published field list (package jetstream_proto, service Orchestrator).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from jaxserve import LLM, SamplingParams
from server.client import AsyncClient
from server.jetstream import OrchestratorServicer
from server.protos.jetstream_proto import jetstream_pb2 as js
from server.protos.jetstream_proto import jetstream_pb2_grpc as js_grpc
from serverproc import ENGINE, running_server

BOS = 0  # the tiny checkpoints' BOS id


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    path, _ = checkpoints("llama")
    log = tmp_path_factory.mktemp("jetstream") / "server.log"
    with running_server(path, log, "--max-waiting", "1") as (target, _):
        yield target, path


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server[0])
    yield js_grpc.OrchestratorStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def llm(server):
    return LLM(str(server[1]), **ENGINE)


GREEDY = dict(temperature=0.0)


def decode(stub, **fields) -> list[js.DecodeResponse]:
    return list(stub.Decode(js.DecodeRequest(**fields)))


def test_health_check(stub):
    """Live while serving (the real server); not live while draining or once the engine
    loop has died (a servicer over a stand-in engine, switched into each state)."""
    assert stub.HealthCheck(js.HealthCheckRequest()).is_live

    class Engine:
        info = None
        is_alive = True

    accepting = True
    servicer = OrchestratorServicer(Engine, lambda: accepting)

    def is_live() -> bool:
        return asyncio.run(servicer.HealthCheck(js.HealthCheckRequest(), None)).is_live

    assert is_live()
    accepting = False  # SIGTERM: draining
    assert not is_live()
    accepting, Engine.is_alive = True, False  # the engine thread failed
    assert not is_live()


def test_token_content(stub, llm, prompts):
    msgs = decode(stub, token_content=js.DecodeRequest.TokenContent(token_ids=prompts[1]),
                  max_tokens=12)
    assert msgs and all(len(m.stream_content.samples) == 1 for m in msgs)
    samples = [m.stream_content.samples[0] for m in msgs]
    assert all(s.token_ids and s.text == "" for s in samples)  # token in, token ids out
    want = llm.generate([[BOS] + prompts[1]], SamplingParams(**GREEDY, max_tokens=12))[0]
    assert [t for s in samples for t in s.token_ids] == want.outputs[0].token_ids

    # has_bos: the prompt is taken as it is.
    msgs = decode(stub, token_content=js.DecodeRequest.TokenContent(token_ids=prompts[1]),
                  max_tokens=12, has_bos=True)
    want = llm.generate([prompts[1]], SamplingParams(**GREEDY, max_tokens=12))[0]
    assert [t for m in msgs for t in m.stream_content.samples[0].token_ids] == \
        want.outputs[0].token_ids


def test_text_content(stub, llm):
    msgs = decode(stub, text_content=js.DecodeRequest.TextContent(text="Hello, world"),
                  max_tokens=10, metadata=js.DecodeRequest.Metadata(start_time=1.5))
    samples = [m.stream_content.samples[0] for m in msgs]
    want = llm.generate("Hello, world", SamplingParams(**GREEDY, max_tokens=10))[0]
    assert want.prompt_token_ids[0] == BOS
    assert [t for s in samples for t in s.token_ids] == want.outputs[0].token_ids
    assert "".join(s.text for s in samples) == want.outputs[0].text


def test_bad_requests(stub, prompts):
    tokens = js.DecodeRequest.TokenContent(token_ids=prompts[0])
    for fields, needle in [(dict(token_content=tokens, num_samples=2), "num_samples"),
                           (dict(token_content=tokens, lora_adapter_id="x"), "LoRA"),
                           (dict(max_tokens=4), "content"),
                           (dict(token_content=tokens, max_tokens=500), "max_model_len")]:
        with pytest.raises(grpc.RpcError) as e:
            decode(stub, **fields)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in e.value.details()


def test_full_queue_is_resource_exhausted(server, prompts):
    """4 running + 1 waiting fit; the rest of 30 simultaneous requests are refused, alone."""

    async def jetstream_one(stub):
        try:
            n = 0
            async for m in stub.Decode(js.DecodeRequest(
                    token_content=js.DecodeRequest.TokenContent(token_ids=prompts[0]),
                    max_tokens=30)):
                n += len(m.stream_content.samples[0].token_ids)
            return n
        except grpc.aio.AioRpcError as e:
            return e.code()

    async def ours_one(client):
        try:
            n = 0
            async for m in client.generate(prompts[0], max_tokens=30, ignore_eos=True):
                n += len(m.chunk.token_ids)
            return n
        except grpc.aio.AioRpcError as e:
            return e.code()

    async def main():
        channel = grpc.aio.insecure_channel(server[0])
        client = AsyncClient(server[0])
        try:
            stub = js_grpc.OrchestratorStub(channel)
            return await asyncio.gather(*[jetstream_one(stub) for _ in range(15)],
                                        *[ours_one(client) for _ in range(15)])
        finally:
            await channel.close()
            await client.close()

    results = asyncio.run(main())
    refused = [r for r in results if r == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served = [r for r in results if isinstance(r, int)]
    assert refused and served
    assert len(refused) + len(served) == 30
    # JetStream requests stop at EOS or max_tokens; ours ignore EOS, so they are exact.
    assert all(1 <= n <= 30 for n in results[:15] if isinstance(n, int))
    assert all(n == 30 for n in results[15:] if isinstance(n, int))
