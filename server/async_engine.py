"""The engine loop in its own thread, fed and read from asyncio.

The engine is not thread-safe, so only the loop thread touches it: callers put commands
in an inbox, and between steps the thread drains it, so requests and aborts take effect
at the next step. Text never touches that thread: prompts are tokenized in a worker pool
before they are sent, and outputs go, in order, through a detokenizer thread that turns
their tokens into text, checks stop strings (a match ends the request: the engine is told
to stop it) and hands them to the caller's event loop with `call_soon_threadsafe`. A
caller that reads slower than the engine steps gets what piled up as one output (fewer,
larger messages: what a stream costs the event loop is per message); `stream_interval`
holds a stream's outputs back on the detokenizer thread until that many tokens have come
(vLLM's and SGLang's `--stream-interval`), and turns them into text together.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from jaxserve.engine.broadcast import PING_INTERVAL_S
from jaxserve.engine.engine import Engine
from jaxserve.engine.lora import LoRARequest
from jaxserve.engine.output_text import OutputText
from jaxserve.engine.request import check_prompt_length
from jaxserve.outputs import StepOutput
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from server.metrics import Metrics, RequestTimes

log = logging.getLogger(__name__)


# Steps that may fail in a row (each failing its own requests) before the engine loop
# stops and health turns NOT_SERVING.
MAX_STEP_FAILURES = 3
# Bytes of prompt text per token of context allowed before tokenizing: generous (English
# averages ~4 bytes per token), and it bounds the tokenizer's work whatever a client sends.
PROMPT_BYTES_PER_TOKEN = 32


class QueueFullError(Exception):
    """The waiting queue is at its configured limit."""


def default_max_prompt_bytes(max_model_len: int) -> int:
    return PROMPT_BYTES_PER_TOKEN * max_model_len


def _too_big(limit: int) -> str:
    return (f"prompt: the text is over {limit} bytes (--max-prompt-bytes; longer text cannot "
            f"fit the context)")


def _encode(tokenizer, text: str, add_special_tokens: bool, limit: int) -> list[int]:
    if tokenizer is None:
        raise ValueError("prompt: this model has no tokenizer; send token ids")
    if len(text.encode()) > limit:
        raise ValueError(_too_big(limit))
    if not text:
        raise ValueError("prompt is empty")
    return tokenizer.encode(text, add_special_tokens)


def _encode_chat(tokenizer, messages: list[dict], limit: int, template_args: dict) -> list[int]:
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer, so no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template_args)
    return _encode(tokenizer, text, False, limit)


@dataclasses.dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    times: RequestTimes
    params: SamplingParams
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Detokenizer thread only: the request's text, whether its last output was sent, and
    # outputs held back by the stream interval (with their tokens' count; None: none sent).
    text: OutputText | None = None
    done: bool = False
    held: list[StepOutput] = dataclasses.field(default_factory=list)
    num_held: int | None = None


def _deliver(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening
        pass


def _put_each(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


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
                 metrics: Metrics | None = None, max_prompt_bytes: int | None = None,
                 tokenizer_threads: int = 2, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        self.engine = engine
        # A stream's first output goes at once, its last too; the others wait until they
        # hold this many tokens together.
        self.stream_interval = stream_interval
        engine.detokenize = False  # the detokenizer thread does it
        self.metrics = metrics
        self.max_prompt_bytes = max_prompt_bytes or default_max_prompt_bytes(engine.max_model_len)
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            tokenizer_threads, thread_name_prefix="tokenizer")
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._detokenizer = threading.Thread(target=self._run_detokenizer,
                                             name="detokenizer", daemon=True)
        self._stop = threading.Event()
        self.started_at = time.monotonic()
        self.total_generated = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._rate_window = rate_window_s
        self.step_gaps: collections.deque[float] = collections.deque(maxlen=10_000)
        self.step_times: collections.deque[float] = collections.deque(maxlen=10_000)
        self.error: BaseException | None = None
        self._last_ping = time.monotonic()
        # LoRA adapters the servers serve, by name (the event loop's copy; the engine
        # thread owns the engine's): `add_lora` and `remove_lora` keep both.
        loras = engine.loras
        self.adapters: dict[str, LoRARequest] = (
            {name: loras.get(name) for name in loras.names} if loras is not None else {})
        self._lora_ids = itertools.count(max((a.lora_int_id for a in self.adapters.values()),
                                             default=0) + 1)

    # ------------------------------------------------------------ asyncio side

    def start(self) -> None:
        self._detokenizer.start()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)
        self._outbox.put(None)
        self._detokenizer.join(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  lora_request: LoRARequest | None = None) -> AsyncIterator[StepOutput]:
        """Admit the request (under `lora_request`'s adapter, when given; ValueError or
        QueueFullError if it cannot be), then return the stream of its outputs. A text prompt is tokenized, and a structured-output
        constraint compiled, in the worker pool first.

        Leaving the stream before its last output (closing it, or being cancelled while
        reading or while waiting for admission) aborts this call's request, and only it:
        a request that another call started under the same id is left alone."""
        if isinstance(prompt, str):
            prompt = await self.encode(prompt)
        else:  # before any per-id work (the engine checks the rest)
            check_prompt_length(len(prompt), self.engine.max_model_len)
        if params.structured_outputs is not None:  # the engine thread only copies it
            await self.compile_constraint(params.structured_outputs)
        loop = asyncio.get_running_loop()
        times = RequestTimes(arrival=time.monotonic(),
                             lora_name=lora_request.lora_name if lora_request else None)
        stream = _Stream(loop, asyncio.Queue(), times, params)
        admitted = loop.create_future()
        self._inbox.put(("add", request_id, prompt, params, stream, admitted, lora_request))
        try:
            await admitted
        except asyncio.CancelledError:
            self._inbox.put(("abort_stream", request_id, stream))
            raise
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while not finished:
                outs = [await stream.queue.get()]
                while not stream.queue.empty():
                    outs.append(stream.queue.get_nowait())
                out = StepOutput.merge(outs)
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._inbox.put(("abort_stream", request_id, stream))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, computed in the tokenizer pool (never on the event loop or
        the engine thread); ValueError over `max_prompt_bytes`, before any work."""
        if len(text) > self.max_prompt_bytes:  # characters <= bytes: checked for free
            raise ValueError(_too_big(self.max_prompt_bytes))
        return await self._in_pool(_encode, self.engine.tokenizer, text, add_special_tokens,
                                   self.max_prompt_bytes)

    async def encode_chat(self, messages: list[dict], **template_args) -> list[int]:
        """A conversation rendered with the chat template and tokenized, in the tokenizer
        pool (ChatTemplateError, a ValueError, when it cannot be rendered)."""
        return await self._in_pool(_encode_chat, self.engine.tokenizer, messages,
                                   self.max_prompt_bytes, template_args)

    async def compile_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Compile (and check: ValueError) a structured-output constraint in the tokenizer
        pool; compiled constraints are cached, so the engine thread only copies them."""
        if self.engine.grammars is None:
            raise ValueError("structured_outputs: grammars need a tokenizer and this model "
                             "has none")
        await self._in_pool(self.engine.grammars.compile, constraint)

    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def abort_requests(self, request_ids: list[str]) -> int:
        """Abort by id; returns how many were running or waiting (and are now aborted)."""
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(("abort_many", list(request_ids), done))
        return await done

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Read the LoRA adapter at `path` (on a worker thread: the engine keeps stepping)
        and serve it as `name` (put into the engine's host memory between steps);
        ValueError if it cannot be."""
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} is loaded already: unload it first")
        lora = LoRARequest(name, next(self._lora_ids), path)
        adapter = await asyncio.to_thread(self.engine.read_lora, lora)
        await self._call(lambda engine: engine.add_lora(lora, adapter))
        self.adapters[name] = lora
        return lora

    async def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter (requests running under it finish); False if unknown."""
        if self.adapters.pop(name, None) is None:
            return False
        return await self._call(lambda engine: engine.remove_lora(name))

    async def _call(self, fn):
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", fn, done))
        return await done

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
        last_step_end, failures = None, 0
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
                try:
                    outputs = self.engine.step()
                    failures = 0
                except Exception as e:  # noqa: BLE001 - one step's fault, not the server's
                    failures += 1
                    log.exception("engine step failed (%d in a row); failing its requests",
                                  failures)
                    if failures >= MAX_STEP_FAILURES:
                        raise
                    outputs = self.engine.fail_step(e)
                last_step_end = time.monotonic()
                self.step_times.append(last_step_end - start)
                if self.metrics is not None:
                    self.metrics.step.observe(last_step_end - start)
                produced = sum(len(o.new_token_ids) for o in outputs)
                self.total_generated += produced
                self._recent.append((last_step_end, produced))
                while self._recent and last_step_end - self._recent[0][0] > self._rate_window:
                    self._recent.popleft()
                self._send(*outputs)
        except BaseException as e:  # the engine is broken: fail every stream, loudly
            log.exception("engine loop failed")
            self.error = e
            for rid in list(self._streams):
                self._send(self._aborted(rid))

    def _ping_followers(self) -> None:
        """Multi-host: an idle leader still checks its followers are alive (see
        jaxserve/engine/broadcast.py); a dead one raises here and stops the loop."""
        broadcaster = self.engine.broadcaster
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
            _, rid, prompt, params, stream, admitted, lora = cmd
            if self.engine.status().num_waiting >= self.max_waiting:
                _deliver(stream.loop, _settle, admitted, None, QueueFullError(
                    f"the waiting queue is full ({self.max_waiting} requests); retry later"))
                return
            try:
                ids = self.engine.add_request(rid, prompt, params, lora_request=lora)
            except ValueError as e:
                _deliver(stream.loop, _settle, admitted, None, e)
                return
            stream.prompt_token_ids = ids
            self._streams[rid] = stream
            _deliver(stream.loop, _settle, admitted, ids)
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "abort_stream":  # only if the request under this id is that call's
            _, rid, stream = cmd
            if self._streams.get(rid) is stream:
                self._abort(rid)
        elif kind == "stopped":  # the detokenizer found a stop string: end the request
            _, rid, stream = cmd
            if self._streams.get(rid) is stream:
                del self._streams[rid]
                self.engine.abort_request(rid)
        elif kind == "abort_many":
            _, rids, done = cmd
            count = sum(self._abort(rid) for rid in rids)
            _deliver(done.get_loop(), _settle, done, count)
        elif kind == "abort_all":
            for rid in list(self._streams):
                self._abort(rid)
        elif kind == "call":  # fn(engine) on this thread, its result or error to `done`
            _, fn, done = cmd
            try:
                result, error = fn(self.engine), None
            except ValueError as e:
                result, error = None, e
            _deliver(done.get_loop(), _settle, done, result, error)

    def _abort(self, rid: str) -> bool:
        if self.engine.abort_request(rid):
            self._send(self._aborted(rid))
            return True
        return False

    def _aborted(self, rid: str) -> StepOutput:
        stream = self._streams.get(rid)
        return StepOutput(rid, [], "", None, True, "abort",
                          num_prompt_tokens=len(stream.prompt_token_ids) if stream else 0)

    def _send(self, *outputs: StepOutput) -> None:
        """Hand outputs (a step's, together) to the detokenizer thread, as one batch."""
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            batch.append((stream, out))
        if batch:
            self._outbox.put(batch)

    # ------------------------------------------------------------ detokenizer thread

    def _run_detokenizer(self) -> None:
        while (batch := self._outbox.get()) is not None:
            # One wake-up of each caller's event loop per batch, not one per output (a
            # wake-up writes to a socket: 256 streams spent a third of this thread on them).
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for stream, out in batch:
                if stream.done:  # ended by a stop string; the engine sampled on
                    continue
                stream.held.append(out)
                if stream.num_held is not None:
                    stream.num_held += len(out.new_token_ids)
                    if stream.num_held < self.stream_interval and not out.finished:
                        continue
                by_loop.setdefault(stream.loop, []).append(
                    (stream.queue, self._finish_output(stream, StepOutput.merge(stream.held))))
                stream.held, stream.num_held = [], 0
            for loop, items in by_loop.items():
                _deliver(loop, _put_each, items)

    def _finish_output(self, stream: _Stream, out: StepOutput) -> StepOutput:
        """The output as its stream receives it: with its text (an error if that fails)."""
        try:
            out = self._detokenize(stream, out)
        except Exception as e:  # noqa: BLE001 - this request's fault, not the server's
            log.exception("detokenizing %s failed", out.request_id)
            if not out.finished:
                self._inbox.put(("stopped", out.request_id, stream))
            out = StepOutput(out.request_id, [], "", None, True, "error",
                             num_prompt_tokens=out.num_prompt_tokens,
                             error=f"{type(e).__name__}: {e}")
        stream.done = out.finished
        if self.metrics is not None:
            self.metrics.on_output(stream.times, out, time.monotonic())
        return out

    def _detokenize(self, stream: _Stream, out: StepOutput) -> StepOutput:
        """The output with its text; finished with its stop string if one matched (the
        engine is told to stop the request)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return out
        if stream.text is None:
            stream.text = OutputText(tokenizer, stream.prompt_token_ids, stream.params,
                                     self.engine.eos_token_ids)
        finished_by_engine = out.finished
        if stream.text.apply(out) and not finished_by_engine:  # a stop string
            self._inbox.put(("stopped", out.request_id, stream))
        return out
