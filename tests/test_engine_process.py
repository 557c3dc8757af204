"""`jaxserve serve` runs its engine in a child process (server/engine_core.py): the front
process never starts a JAX backend, the child dies with the front, and a child that dies
ends every stream and turns the server NOT_SERVING instead of hanging it."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serverproc import running_server
from server.client import Client


def children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        kids += [int(k) for k in open(f"/proc/{pid}/task/{task}/children").read().split()]
    return kids


def engine_of(pid: int) -> int:
    (engine,) = [k for k in children(pid)
                 if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]
    return engine


def thread_names(pid: int) -> set[str]:
    return {open(f"/proc/{pid}/task/{t}/comm").read().strip()
            for t in os.listdir(f"/proc/{pid}/task")}


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5).status


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")


def test_the_engine_runs_in_a_child_that_dies_with_the_server(checkpoints, tmp_path, prompts):
    path, _ = checkpoints("llama")
    with running_server(path, tmp_path / "server.log") as (target, proc):
        engine = engine_of(proc.pid)
        # XLA's CPU client starts its thread pool where a JAX backend starts: the engine.
        assert "tf_XLAEigen" in thread_names(engine)
        assert "tf_XLAEigen" not in thread_names(proc.pid)
        client = Client(target)
        done = list(client.generate(prompts[0], max_tokens=4, ignore_eos=True))
        assert done[-1].complete.usage.completion_tokens == 4
        client.close()
        proc.kill()  # SIGKILL: no drain, no clean-up of ours runs
        proc.wait(10)
        deadline = time.monotonic() + 10
        while alive(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(engine)


def test_a_dead_engine_ends_every_stream_and_turns_not_serving(checkpoints, tmp_path,
                                                               prompts):
    path, _ = checkpoints("llama")
    with running_server(path, tmp_path / "server.log") as (target, proc):
        client = Client(target)
        stream = client.generate(prompts[1], max_tokens=100, ignore_eos=True)
        assert next(stream).HasField("chunk")
        os.kill(engine_of(proc.pid), signal.SIGKILL)
        rest = list(stream)  # ends, never hangs
        assert rest[-1].complete.finish_reason == "abort"
        assert sum(len(m.chunk.token_ids) for m in rest) < 99
        deadline = time.monotonic() + 10
        while health(target) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as e:  # refused, not queued forever
            list(client.generate(prompts[0], max_tokens=4, timeout=20))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 1  # the engine failed: a non-zero exit


def test_a_port_in_use_exits_with_a_clear_error(checkpoints, tmp_path):
    """The HTTP port already taken: the server says so and exits 2 within seconds, its
    engine child stopped (that child ignores SIGTERM once loaded: left alone, the front
    process would wait on it at exit forever)."""
    import socket
    import subprocess
    import sys

    from serverproc import ENGINE_FLAGS, free_port

    path, _ = checkpoints("llama")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "jaxserve", "serve", "--model", str(path),
             "--port", str(free_port()), "--http-port", str(port), *ENGINE_FLAGS],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot bind 127.0.0.1:{port}" in proc.stderr
