"""The servers' face of the engine: requests in, streams of outputs out, on asyncio.

The engine loop runs apart (server/engine_core.py: in a process of its own, or on a
thread of this one); this side sends it commands, and reads its events on the event loop
that started it (as vLLM V1's AsyncLLM does: no thread of ours between the engine and the
callers, so no hand-over of the GIL or wake-up per batch). Text never touches the engine:
prompts are tokenized in a worker pool before they are sent; outputs are turned into
text here, in order, with stop strings checked (a match ends the request: the engine is
told to stop it), and put in their callers' queues. A caller that reads slower than the
engine steps gets what piled up as one output (fewer, larger messages: what a stream
costs the event loop is per message); the engine's `stream_interval` sends a stream's
tokens in groups of that many (vLLM's and SGLang's `--stream-interval`), each turned into
text at once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

from jaxserve import scoring
from jaxserve.engine.engine import Engine
from jaxserve.engine.lora import LoRARequest
from jaxserve.engine.multimodal.inputs import ImageInput, ImagePreparer, place_images
from jaxserve.engine.output_text import OutputText
from jaxserve.engine.request import check_prompt_length
from jaxserve.engine.structured_output import GrammarCompiler
from jaxserve.loading.media import MediaPolicy, take_images
from jaxserve.outputs import StepOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from server.engine_core import QueueFullError  # noqa: F401 - the servers catch it
from server.engine_core import EngineInfo, EngineProcess, EngineSnapshot, EngineThread
from server.metrics import Metrics, RequestTimes

log = logging.getLogger(__name__)


# Bytes of prompt text per token of context allowed before tokenizing: generous (English
# averages ~4 bytes per token), and it bounds the tokenizer's work whatever a client sends.
PROMPT_BYTES_PER_TOKEN = 32


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


def _encode_pair(tokenizer, classifier, query: str, document: str, chat_template: str | None,
                 template_kwargs: dict, limit: int) -> list[int]:
    if len(query.encode()) + len(document.encode()) > limit:
        raise ValueError(_too_big(limit))
    return scoring.pair_prompt(tokenizer, classifier, query, document, chat_template,
                               template_kwargs)


def _encode_chat(tokenizer, messages: list[dict], limit: int, add_special_tokens: bool,
                 template_args: dict, media: MediaPolicy, images: ImagePreparer | None
                 ) -> tuple[list[int], list[ImageInput]]:
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer, so no chat template")
    messages, raw, names = take_images(messages, media)
    if raw and images is None:
        raise ValueError("messages: this model takes no images (it is not a "
                         "vision-language model)")
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template_args)
    ids = _encode(tokenizer, images.expand_text(text) if raw else text, add_special_tokens,
                  limit)
    if not raw:
        return ids, []
    prepared = images(raw, names)
    return place_images(ids, prepared, images.cfg)[0], prepared  # placeholders expanded


@dataclasses.dataclass(eq=False)
class _Stream:
    request_id: str
    call: int  # this call's number: the engine ends the request only for its own call
    admitted: asyncio.Future
    queue: asyncio.Queue
    times: RequestTimes
    params: SamplingParams
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    text: OutputText | None = None  # the request's text so far
    first_token: int | None = None  # prefilled elsewhere: its first token (text made there)


def _settle(fut: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if fut.done():  # the caller went away (cancelled) before the engine answered
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class EngineStoppedError(RuntimeError):
    """The engine loop has stopped (failed): nothing more is served."""


class AsyncEngine:
    """Streams the engine's outputs to asyncio callers. `core`: where the engine loop runs
    (server/engine_core.py: an EngineProcess, loaded; an EngineThread; or an Engine, run on
    a thread, with `max_waiting` and `stream_interval`)."""

    def __init__(self, core: EngineProcess | EngineThread | Engine, max_waiting: int = 1024,
                 rate_window_s: float = 10.0, metrics: Metrics | None = None,
                 max_prompt_bytes: int | None = None, tokenizer_threads: int = 2,
                 stream_interval: int = 1, media: MediaPolicy = MediaPolicy()):
        if isinstance(core, Engine):
            core = EngineThread(core, max_waiting, stream_interval=stream_interval)
        self.core = core
        self.info: EngineInfo = core.info
        # Constraints are checked (compiled) here, in the tokenizer pool, so a bad one
        # fails before it is queued; an engine on a thread shares this cache and only copies
        # them, an engine process compiles them again (its own cache).
        info, self._grammars = self.info, None
        if isinstance(core, EngineThread):
            self._grammars = core.engine.grammars
        elif info.tokenizer is not None:
            self._grammars = GrammarCompiler(info.tokenizer, info.model_config.vocab_size,
                                             info.eos_token_ids)
        self.metrics = metrics
        self.max_prompt_bytes = max_prompt_bytes or default_max_prompt_bytes(
            self.info.max_model_len)
        self.media = media  # where chat messages' images may come from
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            tokenizer_threads, thread_name_prefix="tokenizer")
        self._call_ids = itertools.count(1)
        self._pending: dict[int, _Stream] = {}  # calls sent, not yet admitted or refused
        self._streams: dict[str, _Stream] = {}  # admitted, not ended
        self._replies: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the one `start` ran on
        self._ready = asyncio.Event()
        self.started_at = time.monotonic()
        self.total_generated = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._rate_window = rate_window_s
        self.step_gaps: collections.deque[float] = collections.deque(maxlen=10_000)
        self.step_times: collections.deque[float] = collections.deque(maxlen=10_000)
        self.error: BaseException | None = None
        # LoRA adapters the servers serve, by name (the engine keeps its own copy):
        # `add_lora` and `remove_lora` keep both.
        self.adapters: dict[str, LoRARequest] = dict(self.info.adapters)
        self._lora_ids = itertools.count(max((a.lora_int_id for a in self.adapters.values()),
                                             default=0) + 1)

    # ------------------------------------------------------------ asyncio side

    def start(self) -> None:
        """Start the engine loop; its events are handled on the running event loop, which
        every call must run on."""
        self._loop = asyncio.get_running_loop()
        self.core.attach(self._loop, self._on_event)
        self.core.start()

    async def wait_ready(self) -> None:
        """Until the engine is warm (raises what failed instead)."""
        await self._ready.wait()
        if self.error is not None:
            raise self.error

    def stop(self, timeout: float = 10.0) -> None:
        self.core.stop(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self.core.is_alive

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  lora_request: LoRARequest | None = None, images: list[ImageInput] = (),
                  kv_transfer_params: dict | None = None, priority: int = 0,
                  cache_salt: str | None = None, pooling: PoolingParams | None = None
                  ) -> AsyncIterator[StepOutput]:
        """Admit the request (under `lora_request`'s adapter, when given; with `images`,
        `encode_chat`'s, for its placeholders; with `kv_transfer_params`, one side of
        prefill/decode disaggregation: engine_core.py; `priority`, `cache_salt` and
        `pooling` (an embedding) as Engine.add_request's; ValueError, QueueFullError or
        KVTransferError if it cannot be), then return the stream of its outputs. A text
        prompt is tokenized, and a structured-output constraint compiled, in the worker
        pool first.

        Leaving the stream before its last output (closing it, or being cancelled while
        reading or while waiting for admission) aborts this call's request, and only it:
        a request that another call started under the same id is left alone."""
        if isinstance(prompt, str):
            prompt = await self.encode(prompt)
        else:  # before any per-id work (the engine checks the rest)
            check_prompt_length(len(prompt), self.info.max_model_len)
        if params.structured_outputs is not None:
            await self.compile_constraint(params.structured_outputs)
        times = RequestTimes(arrival=time.monotonic(),
                             lora_name=lora_request.lora_name if lora_request else None)
        self._check_running()
        stream = _Stream(request_id, next(self._call_ids), self._future(), asyncio.Queue(),
                         times, params)
        if kv_transfer_params and kv_transfer_params.get("do_remote_prefill"):
            stream.first_token = kv_transfer_params["first_token"]
        self._pending[stream.call] = stream
        options = dict(lora_request=lora_request, images=list(images), priority=priority,
                       cache_salt=cache_salt, pooling=pooling)
        self.core.send(("add", request_id, stream.call, prompt, params, options,
                        kv_transfer_params))
        try:
            await stream.admitted
        except asyncio.CancelledError:
            self.core.send(("abort", request_id, stream.call))
            raise
        return self._outputs(stream)

    def _future(self) -> asyncio.Future:
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("AsyncEngine: call it on the event loop that started it")
        return self._loop.create_future()

    def _check_running(self) -> None:
        """EngineStoppedError if the loop failed (then nothing would answer). The engine's
        events are handled on this loop too, so nothing registered after this check can be
        missed by `_on_failed`."""
        if self.error is not None:
            raise EngineStoppedError(f"the engine loop stopped: {self.error}")

    async def _outputs(self, stream: _Stream) -> AsyncIterator[StepOutput]:
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
                self.core.send(("abort", stream.request_id, stream.call))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, computed in the tokenizer pool (never on the event loop or
        the engine thread); ValueError over `max_prompt_bytes`, before any work."""
        if len(text) > self.max_prompt_bytes:  # characters <= bytes: checked for free
            raise ValueError(_too_big(self.max_prompt_bytes))
        return await self._in_pool(_encode, self.info.tokenizer, text, add_special_tokens,
                                   self.max_prompt_bytes)

    async def scoring_prompts(self, queries: list[str], documents: list[str],
                              chat_template: str | None = None,
                              template_kwargs: dict | None = None,
                              use_activation: bool | None = None,
                              max_tokens_per_query: int = 0, max_tokens_per_doc: int = 0
                              ) -> tuple[PoolingParams, list[list[int]], Callable]:
        """What scores (query, document) pairs of 1:1, 1:N or N:N texts (jaxserve/
        scoring.py; each query and document first cut to `max_tokens_per_query` /
        `max_tokens_per_doc` tokens when given), tokenized in the tokenizer pool: the
        pooling to run (a cross-encoder's with `use_activation`), its prompts, and the
        function from their pooled vectors to the pairs' scores. ValueError when the
        inputs or the model cannot be scored so."""
        pairs = scoring.pairs(queries, documents)
        if max_tokens_per_query or max_tokens_per_doc:
            pairs = await self._in_pool(scoring.cut_pairs, self.info.tokenizer, pairs,
                                        max_tokens_per_query, max_tokens_per_doc)
        if scoring.cross_encodes(self.info.classifier):
            prompts = [await self._in_pool(_encode_pair, self.info.tokenizer,
                                           self.info.classifier, q, d, chat_template,
                                           template_kwargs or {}, self.max_prompt_bytes)
                       for q, d in pairs]
            return (PoolingParams(task="classify", use_activation=use_activation), prompts,
                    lambda vectors: [float(v[0]) for v in vectors])
        prompts = [await self.encode(t) for t in scoring.embedded_texts(pairs)]
        return PoolingParams(), prompts, lambda vectors: scoring.cosine_scores(pairs, vectors)

    async def encode_chat(self, messages: list[dict], add_special_tokens: bool = False,
                          **template_args) -> tuple[list[int], list[ImageInput]]:
        """A conversation rendered with the chat template and tokenized (each image's
        placeholder standing for its tokens; `add_special_tokens`: BOS etc. on top of
        what the template writes), and its images (read as `media` allows, decoded and
        processed for the vision tower), in the tokenizer pool; ValueError
        (ChatTemplateError, a bad image) when it cannot be."""
        return await self._in_pool(_encode_chat, self.info.tokenizer, messages,
                                   self.max_prompt_bytes, add_special_tokens, template_args,
                                   self.media, self.info.images)

    async def prepare_images(self, images: list) -> list[ImageInput]:
        """Images (file bytes) decoded and processed for the vision tower, in the
        tokenizer pool; ValueError for a bad one, or for a model that takes none."""
        if self.info.images is None:
            raise ValueError("images: this model takes no images (it is not a "
                             "vision-language model)")
        return await self._in_pool(self.info.images, images)

    async def compile_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Compile (and check: ValueError) a structured-output constraint in the tokenizer
        pool."""
        if self._grammars is None:
            raise ValueError("structured_outputs: grammars need a tokenizer and this model "
                             "has none")
        await self._in_pool(self._grammars.compile, constraint)

    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def abort(self, request_id: str) -> None:
        self.core.send(("abort", request_id, None))

    async def abort_requests(self, request_ids: list[str]) -> int:
        """Abort by id; returns how many were running or waiting (and are now aborted)."""
        return await self._call("abort_many", list(request_ids))

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Read the LoRA adapter at `path` (on a worker thread of the engine's: it keeps
        stepping) and serve it as `name`; ValueError if it cannot be."""
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} is loaded already: unload it first")
        lora = LoRARequest(name, next(self._lora_ids), path)
        await self._call("add_lora", lora)
        self.adapters[name] = lora
        return lora

    async def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter (requests running under it finish); False if unknown."""
        if self.adapters.pop(name, None) is None:
            return False
        return await self._call("remove_lora", name)

    async def snapshot(self) -> EngineSnapshot:
        """The engine's counters now (between two steps); before warm-up ends, or after
        the loop stopped, an idle engine's."""
        if not self._ready.is_set() or self.error is not None:
            return EngineSnapshot.idle(self.info)
        try:
            return await self._call("snapshot")
        except EngineStoppedError:
            return EngineSnapshot.idle(self.info)

    async def _call(self, kind: str, *args):
        """A command the engine answers between steps: its result (or its ValueError)."""
        self._check_running()
        reply = next(self._call_ids)
        done = self._replies[reply] = self._future()
        self.core.send((kind, *args, reply))
        return await done

    def num_streams(self) -> int:
        return len(self._streams)

    def abort_all(self) -> None:
        self.core.send(("abort_all",))

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

    # ------------------------------------------------------------ the engine's events

    def _on_event(self, event: tuple) -> None:
        kind = event[0]
        if kind == "outputs":
            self._on_outputs(*event[1:])
        elif kind == "admitted":
            self._on_admitted(*event[1:])
        elif kind == "reply":
            _, reply, result, error = event
            done = self._replies.pop(reply, None)
            if done is not None:
                _settle(done, result, error)
        elif kind == "ready":
            self._ready.set()
        elif kind == "failed":
            self._on_failed(event[1])

    def _on_admitted(self, call: int, ids: list[int] | None, error) -> None:
        stream = self._pending.pop(call)
        if error is None:
            stream.prompt_token_ids = ids
            self._streams[stream.request_id] = stream
        _settle(stream.admitted, ids, error)

    def _on_outputs(self, outputs: list[StepOutput], step: tuple | None) -> None:
        if step is not None:
            self._count_step(outputs, *step)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # ended by a stop string; the engine sampled on
                continue
            out = self._finish_output(stream, out)
            if out.finished:
                del self._streams[stream.request_id]
            stream.queue.put_nowait(out)

    def _count_step(self, outputs: list[StepOutput], start: float, end: float,
                    gap: float | None) -> None:
        self.step_times.append(end - start)
        if gap is not None:
            self.step_gaps.append(gap)
        if self.metrics is not None:
            self.metrics.step.observe(end - start)
        produced = sum(len(o.new_token_ids) for o in outputs)
        self.total_generated += produced
        self._recent.append((end, produced))
        while self._recent and end - self._recent[0][0] > self._rate_window:
            self._recent.popleft()

    def _on_failed(self, error: BaseException) -> None:
        """The loop stopped: every stream ends ("abort"), every caller waiting is told."""
        if self.error is not None:
            return
        self.error = error
        self._ready.set()
        self._on_outputs([StepOutput(s.request_id, [], "", None, True, "abort",
                                     num_prompt_tokens=len(s.prompt_token_ids))
                          for s in list(self._streams.values())], None)
        stopped = EngineStoppedError(f"the engine loop stopped: {error}")
        for call in list(self._pending):
            stream = self._pending.pop(call)
            _settle(stream.admitted, None, stopped)
        for reply in list(self._replies):
            done = self._replies.pop(reply)
            _settle(done, None, stopped)

    def _finish_output(self, stream: _Stream, out: StepOutput) -> StepOutput:
        """The output as its stream receives it: with its text (an error if that fails)."""
        try:
            out = self._detokenize(stream, out)
        except Exception as e:  # noqa: BLE001 - this request's fault, not the server's
            log.exception("detokenizing %s failed", out.request_id)
            if not out.finished:
                self.core.send(("stopped", stream.request_id, stream.call))
            out = StepOutput(out.request_id, [], "", None, True, "error",
                             num_prompt_tokens=out.num_prompt_tokens,
                             error=f"{type(e).__name__}: {e}")
        if self.metrics is not None:
            self.metrics.on_output(stream.times, out, time.monotonic())
        return out

    def _detokenize(self, stream: _Stream, out: StepOutput) -> StepOutput:
        """The output with its text; finished with its stop string if one matched (the
        engine is told to stop the request)."""
        tokenizer = self.info.tokenizer
        if tokenizer is None:
            return out
        if stream.text is None:
            stream.text = OutputText(tokenizer, stream.prompt_token_ids, stream.params,
                                     self.info.eos_token_ids)
            if stream.first_token is not None:
                stream.text.skip([stream.first_token])
        finished_by_engine = out.finished
        if out.kv_transfer_params is not None:  # its text goes on on the decode server
            if stream.text.apply_unfinished(out):  # a stop string ended it here
                out.kv_transfer_params = None
        elif stream.text.apply(out) and not finished_by_engine:  # a stop string
            self.core.send(("stopped", stream.request_id, stream.call))
        return out
