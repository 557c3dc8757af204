"""Multi-host serving with two processes on this machine (2 CPU devices each, one mesh of 4).

Process 0 serves gRPC and broadcasts every step; process 1 runs the same steps. The
greedy tokens must equal one process's offline API, also while a draft model or an EAGLE
head speculates; killing or stopping the follower must turn the server NOT_SERVING with a
clear log (not hang), and a clean SIGTERM stops both.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.engine.broadcast import PING_TIMEOUT_S
from conftest import save_peft_adapter
import test_vision
from test_eagle import make_head, write
from serverproc import ENGINE, ENGINE_FLAGS, free_port, wait_serving
from server.client import Client
from server.protos.jaxserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.slow
llava, qwen = test_vision.llava, test_vision.qwen  # (fixtures: vision-language checkpoints)
PROMPTS = [[5, 9, 200, 31, 17, 8, 99], [44, 45, 46, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def start_job(model_dir, tmp_path, mesh=("--mesh", "model=4"), extra=(),
              http_port: int | None = None):
    """(leader, follower, target): `jaxserve serve` twice, as processes 0 and 1 (gRPC
    only, unless `http_port`)."""
    coordinator, port = f"127.0.0.1:{free_port()}", free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
    procs = []
    for pid in (1, 0):
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model_dir),
               "--port", str(port), *(("--http-port", str(http_port)) if http_port
                                      else ("--no-http",)), *ENGINE_FLAGS, *mesh, *extra,
               "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(pid)]
        with open(tmp_path / f"process{pid}.log", "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
    follower, leader = procs
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, leader)
    except BaseException:
        for p in procs:
            p.kill()
        print((tmp_path / "process0.log").read_text()[-3000:])
        raise
    return leader, follower, target


@contextlib.contextmanager
def running_job(*args, **kw):
    """`start_job`'s processes, killed at the end if a test left them running."""
    leader, follower, target = start_job(*args, **kw)
    try:
        yield leader, follower, target
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()


def stop_cleanly(leader, follower) -> None:
    """SIGTERM to process 0: it tells the follower to stop, and both exit 0."""
    leader.send_signal(signal.SIGTERM)
    assert leader.wait(timeout=60) == 0
    assert follower.wait(timeout=60) == 0


def greedy(client, timeout=None):
    return [client.complete(p, max_tokens=16, temperature=0.0, ignore_eos=True,
                            timeout=timeout)[0] for p in PROMPTS]


def health(target) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.mark.parametrize("mesh", [("--mesh", "model=4"),
                                  ("--mesh", "data=2,model=2", "--sharding", "dp+tp")])
def test_two_processes_serve_one_model(checkpoints, tmp_path, mesh):
    """4-way TP over both processes, or 2 data shards (2-way TP each) over them; prompt
    logprobs (a step that scores its tokens), embeddings (one that returns its rows'
    hidden states) and a bi-encoder's scores through the HTTP API too."""
    path, _ = checkpoints("llama8")
    llm = LLM(str(path), **ENGINE)
    want = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))]
    scored = llm.generate(PROMPTS[1], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    embedded = [o.outputs.embedding for o in llm.embed(PROMPTS)]
    docs = ["first document", "a second one"]
    scores = [o.outputs.score for o in llm.score("a query", docs)]
    http_port = free_port()
    with running_job(path, tmp_path, mesh, http_port=http_port) as (leader, follower, target):
        client = Client(target)
        assert greedy(client) == want
        got = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[1], "max_tokens": 1, "echo": True, "logprobs": 1}).json()
        logprobs = got["choices"][0]["logprobs"]["token_logprobs"][:len(PROMPTS[1])]
        assert logprobs[0] is None and logprobs[1:] == pytest.approx(
            [e[t].logprob for e, t in zip(scored.prompt_logprobs[1:], PROMPTS[1][1:])],
            abs=1e-4)
        got = httpx.post(f"http://127.0.0.1:{http_port}/v1/embeddings", timeout=60,
                         json={"input": PROMPTS, "encoding_format": "float"}).json()
        for d, want_vector in zip(got["data"], embedded):
            assert d["embedding"] == pytest.approx(want_vector, abs=1e-5)
        got = httpx.post(f"http://127.0.0.1:{http_port}/score", timeout=60,
                         json={"text_1": "a query", "text_2": docs}).json()
        assert [d["score"] for d in got["data"]] == pytest.approx(scores, abs=1e-5)
        # A grammar mask goes to every process's devices (a collective both join).
        _, text, done = client.complete(PROMPTS[0], max_tokens=16, structured_outputs=(
            pb.StructuredOutputs(regex="[a-z]{2,4}-[0-9]")))
        assert done.finish_reason == "stop" and re.fullmatch("[a-z]{2,4}-[0-9]", text)
        assert greedy(client) == want
        status = client.status()
        assert status.kv_pages_used == 0 and status.steps > 0
        stop_cleanly(leader, follower)  # told to stop by process 0
        assert "process 0 said stop" in (tmp_path / "process1.log").read_text()


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_two_processes_speculate(checkpoints, tmp_path, method):
    """4-way TP over both processes with speculation: the proposer's program runs on every
    process (one that skipped it would leave the leader waiting in its collectives). The
    target drafting for itself keeps every draft, greedy or sampled (positions, K/V and
    the guesses' distributions right across hosts); a random EAGLE head's drafts are
    verified, the tokens the target's whatever they are."""
    path, model = checkpoints("llama8")
    want = [o.outputs[0].token_ids for o in LLM(str(path), **ENGINE).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))]
    spec = {"model": str(path), "num_speculative_tokens": 3, "disable_by_batch_size": None}
    if method == "eagle":
        head = write(make_head(model, 1, seed=0), model, tmp_path / "head", torch_file=False)
        spec = {**spec, "method": "eagle", "model": str(head)}
    with running_job(path, tmp_path, extra=("--speculative-config", json.dumps(spec))) as (
            leader, follower, target):
        client = Client(target)
        assert greedy(client, timeout=120) == want  # a process left out would hang
        # Sampled guesses: drawn from the draft's distribution, kept by rejection sampling.
        sampled = [client.complete(PROMPTS[1], max_tokens=16, temperature=1.0, seed=7,
                                   ignore_eos=True, timeout=120)[0] for _ in range(2)]
        assert sampled[0] == sampled[1] and len(sampled[0]) == 16
        status = client.status()
        assert status.kv_pages_used == 0
        assert status.speculation.proposed_tokens > 0
        if method == "draft_model":
            assert status.speculation.accepted_tokens == status.speculation.proposed_tokens
        stop_cleanly(leader, follower)


def test_two_processes_serve_lora_adapters(checkpoints, tmp_path):
    """4-way TP over both processes under a PEFT adapter: process 0 reads it and sends its
    arrays to process 1 as it takes a device slot (one the follower never wrote would
    make its shards of the delta zeros); the tokens are one process's under the adapter,
    and the base model's beside it."""
    path, base = checkpoints("llama8")
    adapter = str(tmp_path / "adapter")
    save_peft_adapter(base, adapter)
    llm = LLM(str(path), **ENGINE, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, params, lora_request=LoRARequest("ad", 1, adapter))]
    base_want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert want != base_want
    lora = ("--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"ad={adapter}")
    with running_job(path, tmp_path, extra=lora) as (leader, follower, target):
        client = Client(target)
        assert [client.complete(p, max_tokens=16, temperature=0.0, ignore_eos=True,
                                lora_name="ad")[0] for p in PROMPTS] == want
        assert greedy(client) == base_want
        stop_cleanly(leader, follower)


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_two_processes_serve_images(request, family, tmp_path):
    """4-way TP over both processes on a vision-language model: process 0 prepares each
    image and sends the tower's inputs to process 1, and both run the tower (a process
    left out would hang the collective; one that ran it on other inputs would change the
    tokens). LLaVA's fixed-size images, Qwen2.5-VL's windows and M-RoPE."""
    import io

    from test_vision import IMAGE_PAD, IMAGE_TOKEN, _image, _qwen_prompt

    path = request.getfixturevalue(family)[0]
    images = [_image(3, 60, 80), _image(4, 90, 50)]
    prompts = ([[0, 40, IMAGE_TOKEN, 41, 42], [0, 50, 51, IMAGE_TOKEN, 52]]
               if family == "llava" else [_qwen_prompt([40], 1, [41]), _qwen_prompt([50], 1, [])])
    assert IMAGE_PAD in prompts[0] or family == "llava"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), **ENGINE).generate(
        [{"prompt_token_ids": p, "multi_modal_data": {"image": i}}
         for p, i in zip(prompts, images)], params)]
    with running_job(path, tmp_path) as (leader, follower, target):
        client = Client(target)
        files = []
        for image in images:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            files.append(buffer.getvalue())
        got = [client.complete(p, images=[f], max_tokens=12, temperature=0.0,
                               ignore_eos=True, timeout=120)[0]
               for p, f in zip(prompts, files)]
        assert got == want
        stop_cleanly(leader, follower)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_follower_failure_turns_the_server_not_serving(checkpoints, tmp_path, how):
    """A follower that dies (its connections close: the next ping usually fails at once)
    or stops answering (SIGSTOP: nothing closes, the ping would wait forever) turns the
    server NOT_SERVING within PING_TIMEOUT_S, and SIGTERM then exits without waiting for
    it. A dead follower's ping can also wait for the timeout: gloo (CPU collectives) may
    fail one of process 0's two local participants and leave the other waiting on it
    (seen about once in 15 kills; a stack dump shows the waiting thread in
    gloo::allreduce's receive), so only the stopped follower must be the timeout's."""
    path, _ = checkpoints("llama8")
    leader, follower, target = start_job(path, tmp_path)
    try:
        assert health(target) == health_pb2.HealthCheckResponse.SERVING
        follower.send_signal(how)
        deadline = time.monotonic() + PING_TIMEOUT_S + 10
        while health(target) != health_pb2.HealthCheckResponse.NOT_SERVING:
            if time.monotonic() > deadline:
                print((tmp_path / "process0.log").read_text()[-3000:])
                pytest.fail("still SERVING without its follower")
            time.sleep(0.5)
        log = (tmp_path / "process0.log").read_text()
        assert "a follower process is gone or unreachable" in log
        if how == signal.SIGSTOP:
            assert "did not answer a ping" in log
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 1  # exits, without waiting for the dead peer
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()


def test_a_follower_stopped_mid_step_ends_the_job(checkpoints, tmp_path):
    """A follower that stops answering while process 0 runs a step (no ping timer runs
    then: process 0 waits in the step's collective) ends the job once JAX's heartbeat
    timeout passes (--distributed-heartbeat-timeout): process 0 aborts and the call fails,
    so a supervisor sees a dead process, not a hung one (JAX's default waits 100 s)."""
    path, _ = checkpoints("llama8")
    timeout = 6
    with running_job(path, tmp_path, extra=("--distributed-heartbeat-timeout", str(timeout))
                     ) as (leader, follower, target):
        client = Client(target)
        assert len(client.complete(PROMPTS[0], max_tokens=4, temperature=0.0,
                                   ignore_eos=True)[0]) == 4
        follower.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError):
            client.complete(PROMPTS[1], max_tokens=16, temperature=0.0, ignore_eos=True,
                            timeout=60)
        assert leader.wait(timeout=60) != 0
        assert time.monotonic() - start < PING_TIMEOUT_S + timeout
        assert "stopped sending heartbeats" in (tmp_path / "process0.log").read_text()
