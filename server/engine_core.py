"""The engine loop, and where it runs: on a thread of the server's process, or in a process
of its own.

`EngineCore` owns the Engine. Between steps it reads commands from its inbox; it writes
events to its outbox: a request admitted (with its prompt's token ids) or refused, each
step's outputs with the step's times, answers to calls, and "ready" once warm. Commands
and events are plain tuples of picklable values (no asyncio objects: a request's caller is
known by a number, its `call`), so the same loop runs on a thread (`EngineThread`: tests,
multi-host's process 0) or in a child process (`EngineProcess`, `jaxserve serve`'s default,
as vLLM V1's EngineCore), where the engine's Python work no longer shares one GIL with the
servers' event loop, gRPC's callbacks and the text work; the servers' process then never
starts a JAX backend.

Commands (front -> core):
    ("add", rid, call, prompt_ids, params, options, kv_transfer_params)
                                options: Engine.add_request's keyword arguments
                                (lora_request, images, priority, cache_salt);
                                kv_transfer_params (None: an ordinary request):
                                {"do_remote_decode": true}: prefill only, its K/V held for
                                a decode server (its last output's kv_transfer_params name
                                them); {"do_remote_prefill": true, ...a prefill's}: pulled
                                on a thread first, then added ("prefilled")
    ("abort", rid, call)        call None: whichever call runs `rid`; the caller gets an
                                "abort" output
    ("stopped", rid, call)      the front found a stop string: end it, no output
    ("abort_many", rids, reply) ("abort_all",)
    ("add_lora", lora, reply)   read on a worker thread, added between steps
    ("remove_lora", name, reply) ("snapshot", reply) ("stop",)
    ("start",)                  a child process, loaded: warm up, then step
Events (core -> front):
    ("info", EngineInfo)        a child process: loaded
    ("ready",)                  warm: steps from now on
    ("admitted", call, prompt_ids | None, error | None)
    ("outputs", [StepOutput], step)   step: (start, end, gap since the last one) or None
    ("reply", reply, result, error)
    ("failed", error)           the loop (or loading) failed; nothing more comes
    ("exit",)                   the loop stopped when told to
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import multiprocessing
import operator
import pickle
import queue
import signal
import threading
import time

from jaxserve.config import EngineConfig, KVTransferConfig, ModelConfig
from jaxserve.engine.broadcast import PING_INTERVAL_S, PING_TIMEOUT_S
from jaxserve.engine.engine import Engine
from jaxserve.engine.kv_transfer import Prefilled
from jaxserve.engine.lora import LoRARequest
from jaxserve.engine.multimodal.inputs import ImagePreparer
from jaxserve.engine.status import EngineStatus
from jaxserve.loading.classifier import Classifier
from jaxserve.outputs import StepOutput
from server.kv_transfer import KVPuller, KVSender, KVTransferError

log = logging.getLogger(__name__)

# Steps that may fail in a row (each failing its own requests) before the engine loop
# stops and health turns NOT_SERVING.
MAX_STEP_FAILURES = 3


class QueueFullError(Exception):
    """The waiting queue is at its configured limit."""


@dataclasses.dataclass
class EngineInfo:
    """What the servers know of the engine without asking it: facts fixed at load."""

    tokenizer: object  # jaxserve.loading.tokenizer.Tokenizer, or None
    model_config: ModelConfig
    config: EngineConfig
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_pages: int
    mesh_shape: dict[str, int]
    lora_enabled: bool
    adapters: dict[str, LoRARequest]  # served at load (--lora-modules)
    multi_host: bool
    images: ImagePreparer | None = None  # a vision-language model's (None: text only)
    classifier: Classifier | None = None  # its classification head (loading/classifier.py)

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        loras = engine.loras
        return cls(engine.tokenizer, engine.model_config, engine.config, engine.max_model_len,
                   engine.eos_token_ids, engine.num_pages,
                   {k: int(v) for k, v in engine.mesh.shape.items()}, loras is not None,
                   {name: loras.get(name) for name in loras.names} if loras is not None else {},
                   engine.broadcaster is not None,
                   engine.images.preparer if engine.images is not None else None,
                   getattr(engine, "classifier", None))


@dataclasses.dataclass
class EngineSnapshot:
    """The engine's counters at one moment, as /metrics and GetServerStatus report them."""

    status: EngineStatus
    routers: list  # Engine.router_statistics(): (layer, tokens per expert, imbalance)
    kv: KVStats | None = None  # prefill/decode disaggregation's transfers (None: off)

    @classmethod
    def of(cls, engine: Engine, kv: KVStats | None = None) -> EngineSnapshot:
        return cls(engine.status(), engine.router_statistics(), kv)

    @classmethod
    def idle(cls, info: EngineInfo) -> EngineSnapshot:
        """Before the loop runs (warm-up): nothing running, no page used."""
        return cls(EngineStatus(0, 0, 0, info.num_pages, 0, 0, 0, 0, 0, 0, None,
                                {} if info.lora_enabled else None), [])


def build_engine(config: EngineConfig, random_weights: str | None = None,
                 lora_modules: list[tuple[str, str]] = (), broadcaster=None) -> Engine:
    """`jaxserve serve`'s engine: the checkpoint (or random weights of a preset), with the
    LoRA adapters of --lora-modules read into host memory."""
    engine = Engine.from_config(config, random_weights, broadcaster)
    for i, (name, path) in enumerate(lora_modules):
        engine.add_lora(LoRARequest(name, i + 1, path))
    return engine


@dataclasses.dataclass(eq=False)
class _Call:
    """A request the core runs for a caller: the caller's number, and outputs held back by
    the stream interval (their tokens' count; None until its first output went)."""

    call: int
    num_prompt_tokens: int
    held: list[StepOutput] = dataclasses.field(default_factory=list)
    num_held: int | None = None
    # A remote_decode request's prompt, adapter name and images' hashes (sent with its
    # K/V: what computed them).
    prompt_ids: list[int] | None = None
    lora: str | None = None
    images: list[str] | None = None


@dataclasses.dataclass
class KVStats:
    """A decode server's pulls of K/V (and a prefill server's sends, SenderStats)."""

    pulled: int = 0
    pulled_bytes: int = 0
    pull_seconds: float = 0.0
    failed: int = 0
    sender: object = None  # server/kv_transfer.py's SenderStats of a producer


class EngineCore:
    """Runs the engine: steps while it has requests, handling commands between steps.
    `stream_interval`: a request's outputs are sent when they hold that many tokens (its
    first and last at once), merged into one: a plain request's tokens are held back by the
    engine itself (Engine.stream_interval: no StepOutput made for each), the others' here."""

    def __init__(self, engine: Engine, send, max_waiting: int = 1024, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        self.engine = engine
        engine.detokenize = False  # the front makes the text
        engine.stream_interval = stream_interval
        self.send = send  # one event to the front
        self.max_waiting = max_waiting
        self.stream_interval = stream_interval
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[str, _Call] = {}  # by request id
        self._stopping = False
        self._last_ping = time.monotonic()
        # Prefill/decode disaggregation: a producer's held K/V and their service; the
        # requests whose K/V a consumer is pulling (rid -> call).
        role: KVTransferConfig | None = engine.kv_transfer
        self.kv_stats = KVStats() if role is not None else None
        self.kv_sender = (KVSender(role.kv_host, role.kv_port, role.kv_advertise_host,
                                   role.kv_hold_seconds, role.kv_chunk_bytes,
                                   role.kv_connector)
                          if role is not None and role.produces else None)
        self.kv_puller = (KVPuller(engine.mesh.devices.flat[0])
                          if role is not None and role.consumes else None)
        if self.kv_sender is not None:
            self.kv_stats.sender = self.kv_sender.stats
            log.info("K/V transfers served on %s", self.kv_sender.address)
        self._pulling: dict[str, int] = {}

    def run(self, warmup: bool, freeze_heap: bool = False) -> None:
        """Warm up if asked, then step until stopped. `freeze_heap` (a process of its own):
        then `freeze_heap_now()`."""
        try:
            if warmup:
                self.engine.warmup()
            if freeze_heap:
                freeze_heap_now()
            self.send(("ready",))
            self._loop()
        except BaseException as e:  # the engine is broken: the front fails every stream
            log.exception("engine loop failed")
            self.send(("failed", e))
            return
        broadcaster = self.engine.broadcaster
        if broadcaster is not None:
            broadcaster.stop()  # the followers exit too
        self.send(("exit",))

    def _loop(self) -> None:
        last_step_end, failures = None, 0
        while not self._stopping:
            self._drain(block=not self.engine.has_unfinished())
            if self._stopping:
                return
            if not self.engine.has_unfinished():
                last_step_end = None
                self._ping_followers()
                continue
            start = time.monotonic()
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
            end = time.monotonic()
            self._send_outputs(outputs, (start, end, None if last_step_end is None
                                         else start - last_step_end))
            last_step_end = end

    def _ping_followers(self) -> None:
        """Multi-host: an idle leader still checks its followers are alive (see
        jaxserve/engine/broadcast.py); a dead one raises here and stops the loop. One that
        has not answered in PING_TIMEOUT_S fails the loop from a timer: this thread still
        waits in the collective, and stops if the ping ever returns."""
        broadcaster = self.engine.broadcaster
        now = time.monotonic()
        if broadcaster is None or now - self._last_ping < PING_INTERVAL_S:
            return
        timer = threading.Timer(PING_TIMEOUT_S, self._ping_timed_out)
        timer.daemon = True
        timer.start()
        try:
            broadcaster.ping()
        finally:
            timer.cancel()
        self._last_ping = now

    def _ping_timed_out(self) -> None:
        self._stopping = True
        self.send(("failed", TimeoutError(
            f"the follower processes did not answer a ping in {PING_TIMEOUT_S:.0f} s")))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(*cmd[1:])
        elif kind == "prefilled":
            self._add_prefilled(*cmd[1:])
        elif kind == "abort":
            self._abort(cmd[1], cmd[2])
        elif kind == "stopped":
            _, rid, call = cmd
            entry = self._calls.get(rid)
            if entry is not None and entry.call == call:
                del self._calls[rid]
                self.engine.abort_request(rid)
        elif kind == "abort_many":
            _, rids, reply = cmd
            self.send(("reply", reply, sum(self._abort(rid, None) for rid in rids), None))
        elif kind == "abort_all":
            for rid in list(self._calls):
                self._abort(rid, None)
        elif kind == "add_lora":
            threading.Thread(target=self._read_lora, args=cmd[1:], name="lora-reader",
                             daemon=True).start()
        elif kind == "lora_read":
            _, lora, adapter, error, reply = cmd
            if error is None:
                try:
                    self.engine.add_lora(lora, adapter)
                except ValueError as e:
                    error = e
            self.send(("reply", reply, None, error))
        elif kind == "remove_lora":
            _, name, reply = cmd
            self.send(("reply", reply, self.engine.remove_lora(name), None))
        elif kind == "snapshot":
            self.send(("reply", cmd[1], EngineSnapshot.of(self.engine, self.kv_stats), None))
        elif kind == "stop":
            self._stopping = True
            if self.kv_sender is not None:
                self.kv_sender.stop()
        else:
            raise ValueError(f"unknown engine command {kind!r}")

    def _add(self, rid: str, call: int, prompt: list[int], params, options: dict,
             kv: dict | None = None) -> None:
        if self.engine.num_waiting >= self.max_waiting:
            self.send(("admitted", call, None, QueueFullError(
                f"the waiting queue is full ({self.max_waiting} requests); retry later")))
            return
        remote_decode = bool(kv and kv.get("do_remote_decode"))
        if kv and kv.get("do_remote_prefill"):
            if self.kv_puller is None:
                self.send(("admitted", call, None, ValueError(
                    "kv_transfer_params: this server is not a kv_consumer")))
                return
            self._pulling[rid] = call
            threading.Thread(target=self._pull,
                             args=(rid, call, prompt, params, options, kv),
                             name="kv-pull", daemon=True).start()
            return
        try:
            ids = self.engine.add_request(rid, prompt, params, remote_decode=remote_decode,
                                          **options)
        except ValueError as e:
            self.send(("admitted", call, None, e))
            return
        self._calls[rid] = _Call(call, len(ids))
        if remote_decode:
            entry, lora = self._calls[rid], options.get("lora_request")
            entry.prompt_ids, entry.lora = ids, lora.lora_name if lora else None
            entry.images = [i.hash.hex() for i in options.get("images", ())]
        self.send(("admitted", call, ids, None))

    def _pull(self, rid: str, call: int, prompt: list[int], params, options: dict,
              kv: dict) -> None:
        """A worker thread: pull a request's K/V from its prefill server (the engine keeps
        stepping), then hand it to the loop."""
        try:  # (the fronts checked the params: server/kv_transfer.py's check_params)
            result = self.kv_puller.pull(kv, self.engine.kv_transfer.kv_pull_timeout)
        except (KVTransferError, ValueError) as e:
            result = e
        self.inbox.put(("prefilled", rid, call, prompt, params, options, result))

    def _add_prefilled(self, rid: str, call: int, prompt: list[int], params, options: dict,
                       result) -> None:
        """Add a request whose K/V were pulled (or fail it with why they were not)."""
        if self._pulling.pop(rid, None) != call:
            return  # aborted while pulling: its K/V are dropped
        stats = self.kv_stats
        if isinstance(result, Exception):
            stats.failed += 1
            self.send(("admitted", call, None, result))
            return
        prefilled, seconds = result
        try:
            ids = self.engine.add_request(rid, prompt, params, prefilled=prefilled, **options)
        except ValueError as e:
            stats.failed += 1
            self.send(("admitted", call, None, e))
            return
        stats.pulled += 1
        stats.pulled_bytes += prefilled.kv.nbytes
        stats.pull_seconds += seconds
        self._calls[rid] = _Call(call, len(ids))
        self.send(("admitted", call, ids, None))

    def _abort(self, rid: str, call: int | None) -> bool:
        """Abort `rid` (only if `call` runs it, unless None); its caller gets an output."""
        if rid in self._pulling and call in (None, self._pulling[rid]):
            self.send(("admitted", self._pulling.pop(rid), None,
                       ValueError("aborted while its K/V were pulled")))
            return True
        entry = self._calls.get(rid)
        if entry is None or (call is not None and entry.call != call):
            return False
        del self._calls[rid]
        held = self.engine.held_tokens(rid)
        self.engine.abort_request(rid)
        aborted = StepOutput(rid, held, "", None, True, "abort",
                             num_prompt_tokens=entry.num_prompt_tokens)
        self.send(("outputs", [StepOutput.merge(entry.held + [aborted])], None))
        return True

    def _send_outputs(self, outputs: list[StepOutput], step: tuple) -> None:
        if self.stream_interval > 1:
            outputs = self._grouped(outputs)
        for out in outputs:
            if out.kv_pages is not None:  # held here until its decode server pulls it
                entry = self._calls[out.request_id]
                out.kv_transfer_params = self.kv_sender.hold(Prefilled(
                    out.new_token_ids[0], out.kv_pages, self.engine.model_digest, entry.lora,
                    entry.prompt_ids, entry.images))
                out.kv_pages = None
            if out.finished:
                self._calls.pop(out.request_id, None)
        self.send(("outputs", outputs, step))

    def _grouped(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """What goes now: a request's first and last output at once, the others merged
        once they hold `stream_interval` tokens (a stream costs the servers per message)."""
        sent = []
        for out in outputs:
            entry = self._calls[out.request_id]
            if entry.num_held is None:
                entry.num_held = 0
                sent.append(out)
                continue
            entry.held.append(out)
            entry.num_held += len(out.new_token_ids)
            if entry.num_held >= self.stream_interval or out.finished:
                sent.append(StepOutput.merge(entry.held))
                entry.held, entry.num_held = [], 0
        return sent

    def _read_lora(self, lora: LoRARequest, reply: int) -> None:
        """A worker thread: read the adapter from disk (the engine keeps stepping)."""
        try:
            adapter, error = self.engine.read_lora(lora), None
        except ValueError as e:
            adapter, error = None, e
        self.inbox.put(("lora_read", lora, adapter, error, reply))


class EngineThread:
    """The loop on a thread of this process (tests, multi-host's process 0). `warmup`:
    compile the step's programs before the first step."""

    def __init__(self, engine: Engine, max_waiting: int = 1024, warmup: bool = False,
                 stream_interval: int = 1):
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.core = EngineCore(engine, self._post, max_waiting, stream_interval)
        self._thread = threading.Thread(target=self.core.run, args=(warmup,),
                                        name="engine-loop", daemon=True)
        self._loop = self._handler = None

    def attach(self, loop: asyncio.AbstractEventLoop, handler) -> None:
        """Events are handled by `handler(event)`, on `loop`."""
        self._loop, self._handler = loop, handler

    def _post(self, event: tuple) -> None:
        try:
            self._loop.call_soon_threadsafe(self._handler, event)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass

    def start(self) -> None:
        self._thread.start()

    def send(self, cmd: tuple) -> None:
        self.core.inbox.put(cmd)

    def stop(self, timeout: float) -> None:
        self.send(("stop",))
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()


# A StepOutput crosses the pipe as a tuple of its fields: pickling 256 dataclasses took
# ~340 us a step, their tuples ~30 us.
_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(StepOutput)))


def _encode(event: tuple) -> tuple:
    if event[0] == "outputs":
        return ("outputs", [_FIELDS(o) for o in event[1]], event[2])
    return event


def _decode(event: tuple) -> tuple:
    if event[0] == "outputs":
        return ("outputs", [StepOutput(*row) for row in event[1]], event[2])
    return event


class EngineProcess:
    """The loop in a child process of its own: it loads the model, warms up and steps;
    commands and events cross two pipes. Once loaded, the child ignores SIGINT and SIGTERM
    (the server drains, then stops it), and it is killed when this process dies."""

    def __init__(self, config: EngineConfig, random_weights: str | None = None,
                 lora_modules: list[tuple[str, str]] = (), max_waiting: int = 1024,
                 stream_interval: int = 1):
        context = multiprocessing.get_context("spawn")  # never fork a process running JAX
        commands, self._commands = context.Pipe(duplex=False)
        self._events, events = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_child, name="jaxserve-engine", daemon=True,
            args=(commands, events, config, random_weights, list(lora_modules), max_waiting,
                  stream_interval, logging.getLogger().getEffectiveLevel()))
        self._child_ends = (commands, events)
        self._lock = threading.Lock()  # the event loop and the tokenizer pool both send
        self._gone = False  # the child sent "exit" or "failed", or its pipe closed
        self._loop: asyncio.AbstractEventLoop | None = None
        self.info: EngineInfo | None = None

    def load(self) -> EngineInfo:
        """Start the child and wait until it has loaded the model; raises what loading
        raised. Once loaded, returns at once."""
        if self.info is not None:
            return self.info
        self._process.start()
        for end in self._child_ends:
            end.close()
        event = self._receive()
        if event[0] != "info":
            self._process.join(10)
            raise event[1]
        self.info = event[1]
        return self.info

    def start(self) -> None:
        """Warm up (compile the step's programs), then step: the servers' ports are open
        by now, so probes see the warm-up as not ready."""
        self.load()
        self.send(("start",))

    def send(self, cmd: tuple) -> None:
        with self._lock:
            try:
                self._commands.send(cmd)
            except (BrokenPipeError, OSError):  # the child is gone: the reader says so
                pass

    def attach(self, loop: asyncio.AbstractEventLoop, handler) -> None:
        """Events are handled by `handler(event)`, on `loop`, as they arrive."""
        self._loop = loop
        loop.add_reader(self._events.fileno(), self._readable, handler)

    def _readable(self, handler) -> None:
        while not self._gone:
            handler(self._receive())
            if not self._events.poll():
                break
        if self._gone:
            self._loop.remove_reader(self._events.fileno())

    def _receive(self) -> tuple:
        try:
            event = _decode(self._events.recv())
        except (EOFError, OSError):
            self._gone = True
            self._process.join(5)
            return ("failed", RuntimeError(
                f"the engine process exited (code {self._process.exitcode})"))
        self._gone = event[0] in ("exit", "failed")
        return event

    def stop(self, timeout: float) -> None:
        if self._loop is not None and not self._gone:
            self._loop.remove_reader(self._events.fileno())
            self._gone = True
        self.send(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)
        self._commands.close()

    @property
    def is_alive(self) -> bool:
        return self._process.is_alive()


def _child(commands, events, config: EngineConfig, random_weights: str | None,
           lora_modules: list[tuple[str, str]], max_waiting: int, stream_interval: int,
           log_level: int) -> None:
    """The engine process: load, tell the front what it loaded, then run the loop."""
    _die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s "
                                                "(engine process): %(message)s")

    def send(event: tuple) -> None:
        try:
            events.send(_encode(event))
        except (pickle.PicklingError, TypeError, AttributeError):  # an error that won't pickle
            error = event[-1]
            events.send((*event[:-1], RuntimeError(f"{type(error).__name__}: {error}")))

    try:
        engine = build_engine(config, random_weights, lora_modules)
    except BaseException as e:  # noqa: BLE001 - the front raises it
        log.exception("loading the engine failed")
        send(("failed", e))
        return
    # Ctrl-C, systemd and `timeout` signal the whole process group: the server drains and
    # then stops this process. (Set after loading: JAX installs handlers of its own.)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    core = EngineCore(engine, send, max_waiting, stream_interval)
    send(("info", EngineInfo.of(engine)))
    try:
        if commands.recv() != ("start",):
            raise EOFError
    except (EOFError, OSError):  # the server went away before it started the engine
        return
    threading.Thread(target=_forward, args=(commands, core.inbox), name="commands",
                     daemon=True).start()
    core.run(warmup=True, freeze_heap=True)


def freeze_heap_now() -> None:
    """Collects, then moves every object alive (the model, the programs, the libraries)
    out of the garbage collector's sight (`gc.freeze`, as vLLM's engine core does), for a
    long-lived process once it is ready: a full collection then scans what came after,
    not the whole heap (the engine process of the tiny host-loop model: ~360k objects,
    one full collection 330 ms, a stall of every stream; frozen, ~5k objects and 2-7 ms).
    Not for a process whose objects may become garbage later (the offline LLM's caller's)."""
    gc.collect()
    gc.freeze()


def _forward(commands, inbox: queue.SimpleQueue) -> None:
    """The child's command reader: the pipe into the core's inbox; the front gone: stop."""
    while True:
        try:
            cmd = commands.recv()
        except (EOFError, OSError):
            inbox.put(("stop",))
            return
        inbox.put(cmd)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a killed server leaves no engine
    holding the accelerator)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
