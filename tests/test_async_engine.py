"""The AsyncEngine around a real engine.

Text is made off the engine thread, and comes out as the offline engine makes it inline.
A step that fails (injected) fails its own requests with finish_reason "error", returns
their pages, and the engine serves on with correct tokens; failures in a row stop the loop.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from jaxserve import LLM, SamplingParams
from server.async_engine import AsyncEngine
from server.engine_core import MAX_STEP_FAILURES

ENGINE = dict(dtype="float32", max_model_len=128, page_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(16, 64))
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints("llama")[0]), **ENGINE)


def inject(engine, times: int, consume_kv_cache: bool):
    """The next `times` steps' dispatches raise (after deleting the KV cache, as a step
    that had taken its donated buffers would leave it)."""
    runner, left = engine.runner, [times]
    names = ("dispatch", "dispatch_forward", "dispatch_steps")

    def failing(*_):
        left[0] -= 1
        if left[0] == 0:
            for name in names:  # the class's methods again
                delattr(runner, name)
        if consume_kv_cache:
            for layer in runner.kv_caches:
                for x in layer:
                    x.delete()
        raise RuntimeError("injected device fault")

    for name in names:
        setattr(runner, name, failing)


async def collect(outputs):
    return [out async for out in outputs]


def test_text_and_stop_strings_are_made_off_the_engine_thread(llm, prompts):
    """Stop strings, held-back text, logprobs' decoded tokens and a stop string that ends a
    request while the engine samples on: the event loop's thread gives the offline engine's
    text and token ids, the engine thread never decodes, and the pages all come back."""
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, seed=7)]
    texts = [o.outputs[0].text for o in llm.generate(prompts, free[0])]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2,
                             stop=[text[5:7], text[12:16]], min_tokens=2) for text in texts]
    params.append(SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=3,
                                 stop=["\n", texts[0][9:11]]))
    # A stop token id adds no text (vLLM's rule), even with special tokens kept.
    stop_id = llm.generate([prompts[1]], free[0])[0].outputs[0].token_ids[6]
    params.append(SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id],
                                 skip_special_tokens=False))
    batch = [*prompts, prompts[0], prompts[1]]
    want = llm.generate(batch, params)
    stopped = want[-1].outputs[0]
    assert stopped.stop_reason == stop_id and stopped.token_ids[-1] == stop_id
    assert stopped.text == tokenizer.decode(stopped.token_ids[:-1], skip_special_tokens=False)
    assert sum(o.outputs[0].finish_reason == "stop" for o in want) >= 4
    decoders = set()
    decode = tokenizer.decode

    def recording_decode(*args, **kwargs):
        decoders.add(threading.current_thread().name)
        return decode(*args, **kwargs)

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            streams = [await async_engine.add(f"s{i}", p, sp)
                       for i, (p, sp) in enumerate(zip(batch, params))]
            return await asyncio.gather(*map(collect, streams))
        finally:
            for _ in range(100):  # the stop-string requests' aborts reach the engine
                if not engine.has_unfinished():
                    break
                await asyncio.sleep(0.05)
            async_engine.stop()

    tokenizer.decode = recording_decode
    try:
        got = asyncio.run(main())
    finally:
        del tokenizer.decode
    assert decoders == {threading.main_thread().name}  # asyncio.run's, never "engine-loop"
    for outs, w in zip(got, want):
        w = w.outputs[0]
        assert "".join(o.new_text for o in outs) == w.text
        assert [t for o in outs for t in o.new_token_ids] == w.token_ids
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == (w.finish_reason, w.stop_reason)
        lps = [lp for o in outs for lp in o.new_logprobs or []]
        assert [{t: e.decoded_token for t, e in d.items()} for d in lps] == (
            [{t: e.decoded_token for t, e in d.items()} for d in w.logprobs or []])
    assert not engine.has_unfinished() and engine.scheduler.num_used_pages == 0
    engine.detokenize = True  # as the offline LLM (the next tests) has it


def test_a_stream_that_fell_behind_reads_what_piled_up_as_one_output(llm, prompts):
    """A caller that reads only after its request has finished gets one output, its steps'
    tokens, text and logprobs joined, as the offline engine made them."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    want = llm.generate([prompts[0]], params)[0].outputs[0]

    async def main():
        async_engine = AsyncEngine(llm.engine)
        async_engine.start()
        try:
            stream = await async_engine.add("late", prompts[0], params)
            while async_engine.num_streams():  # until the last output is in its queue
                await asyncio.sleep(0.01)
            return await collect(stream)
        finally:
            async_engine.stop()

    outs = asyncio.run(main())
    llm.engine.detokenize = True
    assert len(outs) == 1
    out = outs[0]
    assert out.finished and out.finish_reason == want.finish_reason == "length"
    assert out.new_token_ids == want.token_ids and out.new_text == want.text
    assert [list(d) for d in out.new_logprobs] == [list(d) for d in want.logprobs]
    for got_lp, want_lp in zip(out.new_logprobs, want.logprobs):
        assert [e.logprob for e in got_lp.values()] == pytest.approx(
            [e.logprob for e in want_lp.values()], abs=1e-5)


def test_a_stream_interval_sends_tokens_in_groups_with_the_offline_text(llm, prompts):
    """`stream_interval` 4: after a stream's first output, outputs of at least 4 tokens,
    the last whatever is left; a stop string inside a held group ends the text and
    the tokens where the offline engine does."""
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = llm.generate([prompts[1]], free)[0].outputs[0].text
    params = [SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[text[9:12]])]
    want = [o.outputs[0] for o in llm.generate([prompts[0], prompts[1]], params)]
    assert want[1].finish_reason == "stop" and len(want[1].token_ids) < 24

    async def main():
        async_engine = AsyncEngine(llm.engine, stream_interval=4)
        async_engine.start()
        try:
            streams = [await async_engine.add(f"g{i}", p, sp)
                       for i, (p, sp) in enumerate(zip(prompts[:2], params))]
            return await asyncio.gather(*map(collect, streams))
        finally:
            for _ in range(100):  # the stop string's abort reaches the engine
                if not llm.engine.has_unfinished():
                    break
                await asyncio.sleep(0.05)
            async_engine.stop()

    got = asyncio.run(main())
    llm.engine.detokenize = True
    for outs, w in zip(got, want):
        # (the first may hold more: a caller that reads late gets what piled up)
        assert all(len(o.new_token_ids) >= 4 for o in outs[1:-1])
        assert "".join(o.new_text for o in outs) == w.text
        assert [t for o in outs for t in o.new_token_ids] == w.token_ids
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == (w.finish_reason, w.stop_reason)
    assert len(got[0]) < 23 // 4 + 3  # not one output per token
    assert llm.engine.scheduler.num_used_pages == 0


def test_an_aborted_stream_gets_the_tokens_the_engine_held_back(llm, prompts, monkeypatch):
    """With a stream interval the engine holds a plain request's newest tokens back; an
    abort sends them with the "abort" output: the caller gets every token made before it
    (a prefix of what the request would have made)."""
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    want = llm.generate([prompts[2]], params)[0].outputs[0].token_ids
    made = []  # the request's known outputs when the abort reaches the engine
    abort = llm.engine.abort_request

    def recording_abort(request_id):
        if (req := llm.engine._requests.get(request_id)) is not None:
            made.append(req.seq.num_known_outputs)
        return abort(request_id)

    monkeypatch.setattr(llm.engine, "abort_request", recording_abort)

    async def main():
        async_engine = AsyncEngine(llm.engine, stream_interval=8)
        async_engine.start()
        try:
            stream = await async_engine.add("held", prompts[2], params)
            outs = [await anext(stream), await anext(stream)]  # its first, then 8
            async_engine.abort("held")
            return outs + await collect(stream)
        finally:
            async_engine.stop()

    outs = asyncio.run(main())
    tokens = [t for o in outs for t in o.new_token_ids]
    first, second = (len(o.new_token_ids) for o in outs[:2])
    # The first token at once, then 8 an output; a reader that fell behind (a loaded CI
    # machine) gets several outputs merged into one (AsyncEngine._outputs), the first too:
    # 1 and whole blocks of 8.
    assert first % 8 == 1 and second >= 8 and second % 8 == 0, (first, second)
    assert outs[-1].finish_reason == "abort" and len(made) == 1
    assert first + second <= made[0] < 90 and tokens == want[:made[0]]
    assert llm.engine.scheduler.num_used_pages == 0


@pytest.mark.parametrize("consume_kv_cache", [True, False])
def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(llm, prompts,
                                                                 consume_kv_cache):
    engine = llm.engine
    want = llm.generate([prompts[1]], GREEDY)[0].outputs[0].token_ids
    # A cached prefix, which must not be reused if the KV cache is lost.
    assert llm.generate([prompts[3]], GREEDY)[0].outputs[0].token_ids

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            running = await async_engine.add("victim", prompts[2], SamplingParams(
                temperature=0.0, max_tokens=60, ignore_eos=True))
            first = await anext(running)
            inject(engine, 1, consume_kv_cache)
            rest = await collect(running)
            after = await collect(await async_engine.add("after", prompts[1], GREEDY))
            again = await collect(await async_engine.add("again", prompts[3], GREEDY))
            return first, rest, after, again, async_engine.is_alive
        finally:
            async_engine.stop()

    first, rest, after, again, alive = asyncio.run(main())
    assert not first.finished
    assert rest[-1].finish_reason == "error" and "injected device fault" in rest[-1].error
    assert sum(len(o.new_token_ids) for o in [first, *rest]) < 60
    assert alive
    assert [t for o in after for t in o.new_token_ids] == want  # the KV cache works again
    assert again[-1].finish_reason == "length"
    assert (again[-1].num_cached_tokens == 0) == consume_kv_cache  # lost cache forgotten
    assert not engine.has_unfinished() and engine.scheduler.num_used_pages == 0


def test_failures_in_a_row_stop_the_loop(llm, prompts):
    engine = llm.engine

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            inject(engine, MAX_STEP_FAILURES, consume_kv_cache=False)
            ends = []
            for i in range(MAX_STEP_FAILURES):
                outputs = await collect(await async_engine.add(f"r{i}", prompts[0], GREEDY))
                ends.append(outputs[-1].finish_reason)
            await asyncio.sleep(0.2)
            return ends, async_engine.is_alive, async_engine.error
        finally:
            async_engine.stop()

    ends, alive, error = asyncio.run(main())
    assert ends == ["error"] * (MAX_STEP_FAILURES - 1) + ["abort"]
    assert not alive and "injected device fault" in str(error)
    # The engine itself is intact: the offline API still runs it.
    engine.fail_step(error)
    assert llm.generate([prompts[0]], GREEDY)[0].outputs[0].finish_reason == "length"


def test_a_failed_step_is_internal_over_grpc_and_500_over_http(llm, prompts):
    """The servers' mapping of a failed step, on the real server stack in this process:
    gRPC INTERNAL with the exception, HTTP 500 (and an error event mid-stream), and both
    serve the next request."""
    import grpc
    import httpx

    from server.app import SERVER_OPTIONS
    from server.http_server import HTTPServer
    from server.metrics import Metrics
    from server.client import AsyncClient
    from server.protos.jaxserve.v1 import inference_pb2_grpc as pb_grpc
    from server.servicer import InferenceServicer
    from server.undecodable import add_servicer

    engine = llm.engine

    async def main():
        async_engine = AsyncEngine(engine, metrics=Metrics("m"))
        http = HTTPServer(async_engine, "m", async_engine.metrics, max_body_bytes=2**20)
        http.ready = True
        server = grpc.aio.server(options=SERVER_OPTIONS)
        add_servicer(pb_grpc.add_InferenceServicer_to_server,
                     InferenceServicer(async_engine, "m", {}), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async_engine.start()
        grpc_client = AsyncClient(f"127.0.0.1:{port}")
        web = httpx.AsyncClient(transport=httpx.ASGITransport(app=http.app),
                                base_url="http://test")
        results = {}
        try:
            body = {"prompt": prompts[1], "max_tokens": 8, "ignore_eos": True}

            async def ok():  # a good step between faults (3 failed steps in a row stop all)
                after = await web.post("/v1/completions", json=body)
                results.setdefault("after", []).append(
                    after.status_code == 200 and after.json()["usage"]["completion_tokens"])

            inject(engine, 1, consume_kv_cache=False)
            results["http"] = await web.post("/v1/completions", json=body)
            await ok()
            inject(engine, 1, consume_kv_cache=False)
            results["sse"] = (await web.post("/v1/completions",
                                             json={**body, "stream": True})).text
            await ok()
            inject(engine, 1, consume_kv_cache=False)
            try:
                async for _ in grpc_client.generate(prompts[1], max_tokens=8, timeout=60):
                    pass
            except grpc.aio.AioRpcError as e:
                results["grpc"] = (e.code(), e.details())
            results["grpc_after"] = [m async for m in grpc_client.generate(
                prompts[1], max_tokens=8, ignore_eos=True, timeout=60)][-1].complete.finish_reason
        finally:
            await web.aclose()
            await grpc_client.close()
            await server.stop(None)
            async_engine.stop()
        return results

    r = asyncio.run(main())
    assert r["http"].status_code == 500 and "injected device fault" in r["http"].text
    assert r["http"].json()["error"]["type"] == "internal_error"
    assert '"error"' in r["sse"] and "injected device fault" in r["sse"]
    assert r["sse"].rstrip().endswith("data: [DONE]")
    assert r["grpc"][0] == grpc.StatusCode.INTERNAL and "injected device fault" in r["grpc"][1]
    assert r["after"] == [8, 8]
    assert r["grpc_after"] == "length"
    assert not engine.has_unfinished() and engine.scheduler.num_used_pages == 0
    engine.detokenize = True
