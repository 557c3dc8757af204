"""The engine loop in its own thread, fed and read from asyncio.

The engine is not thread-safe, so only the loop thread touches it: callers put commands
in an inbox, and the thread hands each request's outputs back to the caller's event loop
with `call_soon_threadsafe`. Between steps the thread drains the inbox, so requests and
aborts take effect at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from jaxserve.engine.broadcast import PING_INTERVAL_S
from jaxserve.engine.engine import Engine
from jaxserve.outputs import StepOutput
from jaxserve.sampling_params import SamplingParams
from server.metrics import Metrics, RequestTimes

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue is at its configured limit."""


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    times: RequestTimes
    num_prompt_tokens: int = 0


def _deliver(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening
        pass


def _settle(fut: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if fut.done():  # the caller went away (cancelled) before the engine answered
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class AsyncEngine:
    """Runs `engine.step()` in a loop thread; `generate` streams StepOutputs to asyncio."""

    def __init__(self, engine: Engine, max_waiting: int = 1024, rate_window_s: float = 10.0,
                 metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stop = threading.Event()
        self.started_at = time.monotonic()
        self.total_generated = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._rate_window = rate_window_s
        self.step_gaps: collections.deque[float] = collections.deque(maxlen=10_000)
        self.step_times: collections.deque[float] = collections.deque(maxlen=10_000)
        self.error: BaseException | None = None
        self._last_ping = time.monotonic()

    # ------------------------------------------------------------ asyncio side

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams
                       ) -> AsyncIterator[StepOutput]:
        """Stream the request's outputs; raises ValueError or QueueFullError before the first."""
        async for out in await self.add(request_id, prompt, params):
            yield out

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams
                  ) -> AsyncIterator[StepOutput]:
        """Admit the request (ValueError or QueueFullError if it cannot be), then return the
        stream of its outputs."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), RequestTimes(arrival=time.monotonic()))
        admitted = loop.create_future()
        self._inbox.put(("add", request_id, prompt, params, stream, admitted))
        await admitted
        return self._outputs(stream)

    @staticmethod
    async def _outputs(stream: _Stream) -> AsyncIterator[StepOutput]:
        while True:
            out = await stream.queue.get()
            yield out
            if out.finished:
                return

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def num_streams(self) -> int:
        return len(self._streams)

    def abort_all(self) -> None:
        self._inbox.put(("abort_all",))

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= self._rate_window]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    def mean_ms(self, samples: collections.deque) -> float:
        values = list(samples)
        return 1e3 * sum(values) / len(values) if values else 0.0

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        last_step_end = None
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if not self.engine.has_unfinished():
                    last_step_end = None
                    self._ping_followers()
                    continue
                start = time.monotonic()
                if last_step_end is not None:
                    self.step_gaps.append(start - last_step_end)
                outputs = self.engine.step()
                last_step_end = time.monotonic()
                self.step_times.append(last_step_end - start)
                if self.metrics is not None:
                    self.metrics.step.observe(last_step_end - start)
                produced = sum(len(o.new_token_ids) for o in outputs)
                self.total_generated += produced
                self._recent.append((last_step_end, produced))
                while self._recent and last_step_end - self._recent[0][0] > self._rate_window:
                    self._recent.popleft()
                for out in outputs:
                    self._send(out)
        except BaseException as e:  # the engine is broken: fail every stream, loudly
            log.exception("engine loop failed")
            self.error = e
            for rid in list(self._streams):
                self._send(self._aborted(rid))

    def _ping_followers(self) -> None:
        """Multi-host: an idle leader still checks its followers are alive (see
        jaxserve/engine/broadcast.py); a dead one raises here and stops the loop."""
        broadcaster = self.engine.runner.broadcaster
        now = time.monotonic()
        if broadcaster is not None and now - self._last_ping >= PING_INTERVAL_S:
            broadcaster.ping()
            self._last_ping = now

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, stream, admitted = cmd
            if self.engine.scheduler.num_waiting >= self.max_waiting:
                _deliver(stream.loop, _settle, admitted, None, QueueFullError(
                    f"the waiting queue is full ({self.max_waiting} requests); retry later"))
                return
            if rid in self._streams:
                _deliver(stream.loop, _settle, admitted, None,
                         ValueError(f"request_id {rid!r} is already running"))
                return
            try:
                ids = self.engine.add_request(rid, prompt, params)
            except ValueError as e:
                _deliver(stream.loop, _settle, admitted, None, e)
                return
            stream.num_prompt_tokens = len(ids)
            self._streams[rid] = stream
            _deliver(stream.loop, _settle, admitted, ids)
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "abort_all":
            for rid in list(self._streams):
                self._abort(rid)

    def _abort(self, rid: str) -> None:
        if self.engine.abort_request(rid):
            self._send(self._aborted(rid))

    def _aborted(self, rid: str) -> StepOutput:
        stream = self._streams.get(rid)
        return StepOutput(rid, [], "", None, True, "abort",
                          num_prompt_tokens=stream.num_prompt_tokens if stream else 0)

    def _send(self, out: StepOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        if self.metrics is not None:
            self.metrics.on_output(stream.times, out, time.monotonic())
        _deliver(stream.loop, stream.queue.put_nowait, out)
