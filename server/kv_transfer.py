"""A prefill server's handed-off K/V, streamed to a decode server over gRPC
(docs/disaggregation.md).

The prefill server's engine process keeps each handed-off request's prompt K/V
(engine/kv_transfer.py's KVPages: one array per cache entry, all layers) in host memory,
copied off the device as the request's first token comes back, for `kv_hold_seconds`,
under a transfer id it names in the response (`kv_transfer_params`). A decode server's
engine process pulls it by that id from `KVTransfer/Pull` (server streaming): a JSON
header (the prompt's token ids, the first token, each entry's shape and dtype), then the
entries' bytes in chunks of `kv_chunk_bytes`. A pulled, expired or unknown id is gone;
a pull that breaks off (the prefill server died) raises KVTransferError on the decode
side, whose request fails alone. The bytes travel as stored (int8 / fp8 pages with their
scales): this path works between any two machines; its bandwidth is in
benchmarks/RESULTS.md.

The service is registered by hand (raw bytes in and out, no generated stubs): a method
with one string in and a stream of byte chunks out needs none.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from concurrent import futures

import grpc
import numpy as np

from jaxserve.engine.kv_transfer import KVPages, Prefilled

log = logging.getLogger(__name__)

SERVICE, METHOD = "jaxserve.v1.KVTransfer", "Pull"
PULL = f"/{SERVICE}/{METHOD}"
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                    ("grpc.max_send_message_length", 64 << 20)]
# Tests slow the stream down to kill a prefill server in the middle of one.
_TEST_CHUNK_DELAY_S = float(os.environ.get("JAXSERVE_TEST_KV_CHUNK_DELAY_S", "0"))


class KVTransferError(RuntimeError):
    """A decode server could not pull a request's K/V (its prefill server is gone, the
    transfer expired, or the stream broke off)."""


@dataclasses.dataclass
class _Held:
    kv: KVPages  # entries copying to the host (started), numpy once pulled
    prompt_token_ids: list[int]
    first_token: int
    deadline: float


@dataclasses.dataclass
class SenderStats:
    held: int = 0  # transfers waiting to be pulled
    held_bytes: int = 0
    sent: int = 0  # pulled to the end
    sent_bytes: int = 0
    send_seconds: float = 0.0
    expired: int = 0  # never pulled in time


class KVSender:
    """A producer's held K/V and the gRPC service its decode servers pull them from."""

    def __init__(self, host: str, port: int, advertise: str | None, hold_seconds: float,
                 chunk_bytes: int):
        self.hold_seconds, self.chunk_bytes = hold_seconds, chunk_bytes
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self.stats = SenderStats()
        self._server = grpc.server(futures.ThreadPoolExecutor(8, thread_name_prefix="kv-send"),
                                   options=_CHANNEL_OPTIONS)
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            METHOD: grpc.unary_stream_rpc_method_handler(self._pull)})
        self._server.add_generic_rpc_handlers((handler,))
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"kv_transfer_config: cannot listen on {host}:{port}")
        self.address = f"{advertise or host}:{bound}"
        self._server.start()
        self._stop = threading.Event()
        threading.Thread(target=self._expire_loop, name="kv-expire", daemon=True).start()

    def hold(self, kv: KVPages, prompt_token_ids: list[int], first_token: int) -> dict:
        """Keep `kv` (device arrays: their copy to the host starts now) for a decode server
        to pull; returns the `kv_transfer_params` that name it."""
        for x in kv.entries:
            x.copy_to_host_async()
        transfer_id = uuid.uuid4().hex
        with self._lock:
            self._held[transfer_id] = _Held(kv, list(prompt_token_ids), first_token,
                                            time.monotonic() + self.hold_seconds)
            self.stats.held += 1
            self.stats.held_bytes += kv.nbytes
        return {"transfer_id": transfer_id, "remote_address": self.address,
                "first_token": first_token, "num_prompt_tokens": kv.num_tokens}

    def release(self, transfer_id: str) -> _Held | None:
        with self._lock:
            held = self._held.pop(transfer_id, None)
            if held is not None:
                self.stats.held -= 1
                self.stats.held_bytes -= held.kv.nbytes
            return held

    def stop(self) -> None:
        self._stop.set()
        self._server.stop(0).wait()

    def _pull(self, request: bytes, context: grpc.ServicerContext):
        transfer_id = request.decode("utf-8", "replace")
        held = self.release(transfer_id)
        if held is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no K/V held under transfer id {transfer_id!r}: already pulled, "
                          f"or not pulled within kv_hold_seconds ({self.hold_seconds:g} s)")
        start = time.monotonic()
        # Only the pages that hold the prompt (the read was padded to a bucket).
        pages = -(-held.kv.num_tokens // held.kv.entries[0].shape[3])
        entries = [np.ascontiguousarray(np.asarray(x)[:, :, :pages]) for x in held.kv.entries]
        header = {"num_tokens": held.kv.num_tokens, "prompt_token_ids": held.prompt_token_ids,
                  "first_token": held.first_token,
                  "entries": [{"shape": list(x.shape), "dtype": x.dtype.name} for x in entries]}
        yield json.dumps(header).encode()
        for x in entries:
            data = memoryview(x.reshape(-1).view(np.uint8))
            for i in range(0, len(data), self.chunk_bytes):
                if _TEST_CHUNK_DELAY_S:
                    time.sleep(_TEST_CHUNK_DELAY_S)
                yield bytes(data[i:i + self.chunk_bytes])
        # (The puller reads to the end of the stream, so this runs before it adds the
        # request.)
        with self._lock:
            self.stats.sent += 1
            self.stats.sent_bytes += held.kv.nbytes
            self.stats.send_seconds += time.monotonic() - start

    def _expire_loop(self) -> None:
        while not self._stop.wait(min(1.0, self.hold_seconds / 4)):
            now = time.monotonic()
            with self._lock:
                late = [t for t, h in self._held.items() if h.deadline < now]
            for transfer_id in late:
                if self.release(transfer_id) is not None:
                    self.stats.expired += 1
                    log.warning("K/V of transfer %s not pulled within %g s: released",
                                transfer_id, self.hold_seconds)


def check_params(kv) -> dict:
    """A request's kv_transfer_params (ValueError saying what is wrong): one of
    {"do_remote_decode": true} (to a prefill server) and a prefill's answer with
    "do_remote_prefill": true (to a decode server)."""
    if not isinstance(kv, dict):
        raise ValueError("kv_transfer_params: must be a JSON object")
    if bool(kv.get("do_remote_decode")) == bool(kv.get("do_remote_prefill")):
        raise ValueError("kv_transfer_params: set one of do_remote_decode (to a prefill "
                         "server) and do_remote_prefill (to a decode server)")
    if kv.get("do_remote_prefill"):
        wrong = [k for k, kind in (("transfer_id", str), ("remote_address", str),
                                   ("first_token", int))
                 if not isinstance(kv.get(k), kind) or isinstance(kv.get(k), bool)]
        if wrong:
            raise ValueError(f"kv_transfer_params: {wrong[0]} missing or of the wrong type; "
                             "pass on a prefill's kv_transfer_params")
    return kv


def pull(params: dict, timeout: float) -> tuple[Prefilled, list[int], float]:
    """Pull a request's K/V named by a prefill server's `kv_transfer_params` (host
    arrays); returns them with the prompt's token ids and the seconds the pull took.
    KVTransferError when it cannot."""
    address, transfer_id = params["remote_address"], params["transfer_id"]
    start = time.monotonic()
    try:
        with grpc.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
            stream = channel.unary_stream(PULL)(transfer_id.encode(), timeout=timeout)
            header = json.loads(next(stream))
            entries = []
            for spec in header["entries"]:
                x = np.empty(spec["shape"], np.dtype(spec["dtype"]))
                data, filled = memoryview(x.reshape(-1).view(np.uint8)), 0
                while filled < len(data):
                    chunk = next(stream)
                    data[filled:filled + len(chunk)] = chunk
                    filled += len(chunk)
                entries.append(x)
            for _ in stream:  # to its end: the sender counts it sent
                raise KVTransferError(f"the prefill server at {address} sent more K/V "
                                      f"bytes for transfer {transfer_id} than it announced")
    except grpc.RpcError as e:
        raise KVTransferError(f"pulling the K/V of transfer {transfer_id} from the prefill "
                              f"server at {address} failed: {e.code().name}: "
                              f"{e.details()}") from e
    except StopIteration as e:
        raise KVTransferError(f"the prefill server at {address} ended the K/V of transfer "
                              f"{transfer_id} early") from e
    kv = KVPages(tuple(entries), header["num_tokens"])
    return (Prefilled(header["first_token"], kv), header["prompt_token_ids"],
            time.monotonic() - start)
