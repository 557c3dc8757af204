"""Prefill on one mesh, decode on another, in one process (docs/disaggregation.md).

A `DisaggregatedEngine` holds two engines of the same model, each on devices of its own
with its own sharding strategy and KV pool. A request is prefilled by the first
(`remote_decode`: its prompt computed and its first token sampled; its pages read out as
the step computing its last chunk is dispatched), then handed to the second with its
first token and its prompt's K/V, which `jax.device_put` copies to the decode mesh in the
decode cache's layout (kv_transfer.py) while the prefill engine goes on with the next
prompts; the decode engine writes them into pages of its own when it admits the request
and decodes from the second token on. The prefill engine steps on a thread of its own
(`_PrefillLoop`), so the decode engine's steps never wait for a prompt's: long prompts
never stall the decoding streams, and each side is sized and sharded for its own work.

It answers what the servers and the offline `LLM` ask of an `Engine` (add_request, step,
abort_request, status, ...): text and stop strings are made here, over the whole output,
so that they come out as one engine's would.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import weakref
from collections.abc import Callable

from jaxserve.config import EngineConfig, KVTransferConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.kv_transfer import Prefilled
from jaxserve.engine.lora import LoRARequest
from jaxserve.engine.output_text import OutputText
from jaxserve.engine.status import EngineStatus
from jaxserve.outputs import StepOutput
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class _PrefillLoop:
    """The prefill engine, stepped on a thread of its own while it has requests. Other
    threads reach the engine through `call` (under the lock); the thread waits for the
    device outside it, so a call waits for a step's host work only. Each step's outputs
    go to `outputs`. It pauses while `paused()` (the decode side is full)."""

    def __init__(self, engine: Engine, paused: Callable[[], bool]):
        self.engine = engine
        self.outputs: queue.SimpleQueue[list[StepOutput]] = queue.SimpleQueue()
        self._paused = paused
        self._lock = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="prefill-engine", daemon=True)
        self._thread.start()

    def call(self, fn: Callable, *args, **kwargs):
        with self._lock:
            out = fn(*args, **kwargs)
            self._lock.notify()
            return out

    def stop(self) -> None:
        """End the thread and wait for it (at exit too: a thread still running JAX's code
        while the interpreter shuts down aborts the process)."""
        with self._lock:
            self._stopped = True
            self._lock.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                while not self._stopped and (not engine.has_unfinished() or self._paused()):
                    # Paused: the decode side admits requests without telling this thread.
                    self._lock.wait(timeout=0.005 if engine.has_unfinished() else None)
                if self._stopped:
                    return
            engine.wait_for_device()
            with self._lock:
                try:
                    outputs = engine.step()
                except Exception as error:  # its requests fail; the loop goes on
                    log.exception("prefill step failed")
                    outputs = engine.fail_step(error)
            if outputs:
                self.outputs.put(outputs)


@dataclasses.dataclass
class _Request:
    prompt: str | list[int]  # as the decode engine takes it (token ids, unless images)
    images: list  # ImageInputs, prepared once for both engines
    params: SamplingParams
    priority: int
    text: OutputText | None
    lora: LoRARequest | None  # its adapter, on both engines
    cache_salt: str | None  # its prefix cache salt, on both engines
    decoding: bool = False  # handed to the decode engine


class DisaggregatedEngine:
    """A prefill engine and a decode engine of one model, driven as one engine."""

    def __init__(self, prefill: Engine, decode: Engine, seed: int = 0):
        _check_pair(prefill, decode)
        self.prefill, self.decode = prefill, decode
        prefill.detokenize = decode.detokenize = False  # made here, over the whole output
        self.detokenize = True
        self.stream_text = True  # (streamed either way: text is made here, per step)
        self.stream_interval = 1  # (likewise: every token as it comes)
        self.tokenizer = decode.tokenizer
        self.model_config = decode.model_config
        self.config = decode.config
        self.max_model_len = decode.max_model_len
        self.eos_token_ids = decode.eos_token_ids
        self.broadcaster = None
        self.loras = decode.loras  # (the prefill engine registers the same ones)
        self.images = decode.images  # (its preparer serves both engines)
        self._requests: dict[str, _Request] = {}
        self._rng = random.Random(seed)
        self._prefill = _PrefillLoop(prefill, lambda: (decode.num_prefilled_waiting
                                                       >= decode.config.max_num_seqs))
        # The thread holds the engines, not this object: it stops when this goes.
        self.close = weakref.finalize(self, self._prefill.stop)
        self.num_handoffs = 0  # requests handed from prefill to decode
        self.handoff_bytes = 0  # of K/V moved with them

    @classmethod
    def from_config(cls, prefill: EngineConfig, decode: EngineConfig) -> DisaggregatedEngine:
        """Load both engines (`prefill` and `decode` name the same model; their `devices`,
        `mesh` and `sharding` place each; kv_transfer_config is set to their roles)."""
        if prefill.model != decode.model:
            raise ValueError(f"prefill and decode serve one model; got {prefill.model!r} and "
                             f"{decode.model!r}")
        if prefill.devices is None or decode.devices is None:
            log.warning("prefill and decode engines without `devices` share the first "
                        "devices of the process")
        elif set(prefill.devices) & set(decode.devices):
            log.warning("prefill and decode engines share devices %s",
                        sorted(set(prefill.devices) & set(decode.devices)))
        producer = dataclasses.replace(prefill,
                                       kv_transfer_config=KVTransferConfig("kv_producer"))
        consumer = dataclasses.replace(decode,
                                       kv_transfer_config=KVTransferConfig("kv_consumer"))
        return cls(Engine.from_config(producer), Engine.from_config(consumer), decode.seed)

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    lora_request=None, images: list | None = None,
                    cache_salt: str | None = None) -> list[int]:
        """Queue a request on the prefill engine (under `lora_request`'s adapter and with
        `cache_salt` on both engines; with `images`, which the decode engine places alike:
        its M-RoPE positions follow them, and a preemption there recomputes them); returns
        its prompt token ids (ValueError for bad input, as Engine.add_request)."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        params = params or SamplingParams()
        if params.seed is None:  # one stream over both engines
            params = dataclasses.replace(params, seed=self._rng.randrange(2**32))
        images = self.prepare_images(images) if images else []
        token_ids = self._prefill.call(self.prefill.add_request, request_id, prompt, params,
                                       priority, lora_request, images, remote_decode=True,
                                       cache_salt=cache_salt)
        tokenizer = self.tokenizer
        text = (OutputText(tokenizer, token_ids, params, self.eos_token_ids)
                if self.detokenize and tokenizer is not None else None)
        self._requests[request_id] = _Request(prompt if images else token_ids, images, params,
                                              priority, text, lora_request, cache_salt)
        return token_ids

    def prepare_images(self, images: list, names: list[str] | None = None) -> list:
        """Engine.prepare_images (the decode engine's: both take its outputs)."""
        return self.decode.prepare_images(images, names)

    def abort_request(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.decoding:
            self.decode.abort_request(request_id)
        else:  # (one whose first token is on its way is dropped when it lands)
            self._prefill.call(self.prefill.abort_request, request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        return self.prefill.num_waiting + self.decode.num_waiting

    @property
    def num_pages(self) -> int:
        return self.prefill.num_pages + self.decode.num_pages

    @property
    def mesh(self):
        return self.decode.mesh

    def status(self) -> EngineStatus:
        """Both engines' counters, summed (`statuses` has each)."""
        p, d = self.statuses()
        return EngineStatus(**{
            f.name: (getattr(p, f.name) + getattr(d, f.name)
                     if isinstance(getattr(p, f.name), int) else getattr(d, f.name))
            for f in dataclasses.fields(EngineStatus)})

    def statuses(self) -> tuple[EngineStatus, EngineStatus]:
        return self.prefill.status(), self.decode.status()

    def router_statistics(self) -> list:
        return self.decode.router_statistics()

    # ----------------------------------------------------------------- stepping

    def warmup(self, progress: bool = True) -> None:
        self.prefill.warmup(progress)
        self.decode.warmup(progress)

    def step(self) -> list[StepOutput]:
        """The prefill engine's outputs since the last call (first tokens, their requests
        handed to the decode engine), then a step of the decode engine. With nothing to
        decode it waits a little for the prefill side. The prefill engine pauses while
        the decode engine holds a full batch of handed-over requests it has not admitted
        yet (their K/V wait on its devices, outside its pool)."""
        batches = []
        if not self.decode.has_unfinished():
            try:
                batches.append(self._prefill.outputs.get(timeout=0.05))
            except queue.Empty:
                pass
        while not self._prefill.outputs.empty():
            batches.append(self._prefill.outputs.get())
        outputs = [self._handoff(out) if out.kv_pages is not None else self._text(out)
                   for batch in batches for out in batch]
        outputs += [self._text(out) for out in self.decode.step()]
        return outputs

    def fail_step(self, error: BaseException) -> list[StepOutput]:
        """After `step()` raised: the decode engine ends its running requests
        (Engine.fail_step; the prefill engine's steps fail on its own thread alike)."""
        return [self._text(out) for out in self.decode.fail_step(error)]

    def _handoff(self, out: StepOutput) -> StepOutput:
        """A prefilled request's first token: its text made (a stop string in it ends the
        request here), then the request handed to the decode engine."""
        kv, out.kv_pages = out.kv_pages, None
        req = self._requests.get(out.request_id)
        if req is None:
            return out
        out.finished, out.finish_reason = False, None
        if req.text is not None and req.text.apply(out):  # a stop string in its text
            del self._requests[out.request_id]
            return out
        try:
            self.decode.add_request(out.request_id, req.prompt, req.params, req.priority,
                                    req.lora, req.images, prefilled=Prefilled(
                                        out.new_token_ids[0], kv, self.prefill.model_digest,
                                        req.lora.lora_name if req.lora else None),
                                    cache_salt=req.cache_salt)
        except ValueError as e:
            out.finished, out.finish_reason, out.error = True, "error", str(e)
            del self._requests[out.request_id]
            return out
        req.decoding = True
        self.num_handoffs += 1
        self.handoff_bytes += kv.nbytes
        return out

    def _text(self, out: StepOutput) -> StepOutput:
        """`out` with its text; a finished request forgotten (one a stop string ended is
        stopped on its engine)."""
        req = self._requests.get(out.request_id)
        if req is None:
            return out
        ended = out.finished
        if req.text is not None and req.text.apply(out) and not ended:
            (self.decode if req.decoding else self.prefill).abort_request(out.request_id)
        if out.finished:
            del self._requests[out.request_id]
        return out


def _check_pair(prefill: Engine, decode: Engine) -> None:
    """ValueError unless the engines can hand requests over: the roles, one model, and
    pages of one size and dtype."""
    if prefill.kv_transfer is None or not prefill.kv_transfer.produces:
        raise ValueError("the prefill engine needs kv_transfer_config kv_role kv_producer")
    if decode.kv_transfer is None or not decode.kv_transfer.consumes:
        raise ValueError("the decode engine needs kv_transfer_config kv_role kv_consumer")
    if prefill.model_config != decode.model_config:
        raise ValueError("prefill and decode engines serve different models")
    if prefill.config.page_size != decode.config.page_size:
        raise ValueError(f"page_size differs: prefill {prefill.config.page_size}, decode "
                         f"{decode.config.page_size}")
    if prefill.runner.kv_dtype != decode.runner.kv_dtype:
        raise ValueError(f"KV cache dtype differs: prefill {prefill.runner.kv_dtype}, decode "
                         f"{decode.runner.kv_dtype}")
    if prefill.max_model_len != decode.max_model_len:
        raise ValueError(f"max_model_len differs: prefill {prefill.max_model_len}, decode "
                         f"{decode.max_model_len}")
