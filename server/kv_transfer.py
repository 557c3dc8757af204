"""A prefill server's handed-off K/V, moved to a decode server (docs/disaggregation.md):
streamed as bytes over gRPC, or device to device with jax.experimental.transfer.

The prefill server's engine process keeps each handed-off request's prompt K/V
(engine/kv_transfer.py's KVPages: one array per cache entry, all layers) in host memory,
copied off the device as the request's first token comes back, for `kv_hold_seconds`,
under a transfer id it names in the response (`kv_transfer_params`). A decode server's
engine process pulls it by that id from `KVTransfer/Pull` (server streaming): a JSON
header (the first token and what computed the K/V: the prefill engine's model digest,
the request's adapter, the prompt's token ids and its images' hashes; each entry's shape
and dtype), then the entries' bytes in chunks of `kv_chunk_bytes`. A pulled, expired or
unknown id is gone; a pull that breaks off (the prefill server died) raises
KVTransferError on the decode side, whose request fails alone. The bytes travel as stored (int8 / fp8 pages with their
scales): this path works between any two machines; its bandwidth is in
benchmarks/RESULTS.md.

With `kv_connector: "jax"` the K/V stay on the prefill server's device (gathered to one
device of its mesh) in a `jax.experimental.transfer` server, and the gRPC stream carries
the header alone, naming that server and the arrays' number: the decode server pulls them
onto one device of its own (`KVPuller`), device to device where the platform can (TPU,
GPU; on a CPU too), then lays them out on its mesh. K/V never asked for are drained by
pulling them back (the transfer API has no cancel); ones whose header went out stay with
the transfer server until that decode server pulls them.

The service is registered by hand (raw bytes in and out, no generated stubs): a method
with one string in and a stream of byte chunks out needs none.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
import uuid
from concurrent import futures

import grpc
import jax
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


# What a transfer's header says of its K/V besides their arrays (Prefilled's fields).
_SOURCE = ("first_token", "model", "lora", "token_ids", "images")


@dataclasses.dataclass
class _Held:
    prefilled: Prefilled  # its kv's entries copying to the host (started), numpy once pulled
    deadline: float
    number: int | None = None  # its arrays' in the jax transfer server (kv_connector "jax")

    @property
    def kv(self) -> KVPages:
        return self.prefilled.kv


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
                 chunk_bytes: int, connector: str = "grpc"):
        self.hold_seconds, self.chunk_bytes = hold_seconds, chunk_bytes
        self._transfer = None  # kv_connector "jax": the transfer server holding the arrays
        if connector == "jax":
            from jax.experimental import transfer

            self._transfer = transfer.start_transfer_server(
                jax.devices()[0].client, f"{host}:0", [f"{host}:0"])
            port_ = self._transfer.address().rsplit(":", 1)[1]
            self._transfer_address = f"{advertise or host}:{port_}"
            self._drain = self._transfer.connect(self._transfer.address())
            self._numbers = itertools.count(1)
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

    def hold(self, prefilled: Prefilled) -> dict:
        """Keep a request's K/V (device arrays: their copy to the host starts now, or with
        the jax connector their gather to one device) and what computed them for a decode
        server to pull; returns the `kv_transfer_params` that name them."""
        kv, number = prefilled.kv, None
        if self._transfer is None:
            for x in kv.entries:
                x.copy_to_host_async()
        else:
            device = min(kv.entries[0].sharding.device_set, key=lambda d: d.id)
            kv = KVPages(tuple(jax.device_put(x, device) for x in kv.entries), kv.num_tokens)
            number = next(self._numbers)
            self._transfer.await_pull(number, list(kv.entries))
            prefilled = dataclasses.replace(prefilled, kv=kv)
        transfer_id = uuid.uuid4().hex
        with self._lock:
            self._held[transfer_id] = _Held(prefilled, time.monotonic() + self.hold_seconds,
                                            number)
            self.stats.held += 1
            self.stats.held_bytes += kv.nbytes
        moved = kv.nbytes if number is not None else kv.nbytes * _pages(kv) // \
            kv.entries[0].shape[2]
        return {"transfer_id": transfer_id, "remote_address": self.address,
                "first_token": prefilled.first_token, "num_prompt_tokens": kv.num_tokens,
                "num_bytes": moved}

    def release(self, transfer_id: str, expired: bool = False) -> _Held | None:
        """Let go of a held transfer (counted as expired when `expired`): the counts move
        together under the lock, so a reader never sees one released but not counted."""
        with self._lock:
            held = self._held.pop(transfer_id, None)
            if held is not None:
                self.stats.held -= 1
                self.stats.held_bytes -= held.kv.nbytes
                self.stats.expired += expired
            return held

    def stop(self) -> None:
        self._stop.set()
        self._server.stop(0).wait()

    def _header(self, held: _Held, entries) -> dict:
        """What a pull's stream starts with (the module doc), for `entries` to follow."""
        return {**{f: getattr(held.prefilled, f) for f in _SOURCE},
                "num_tokens": held.kv.num_tokens,
                "entries": [{"shape": list(x.shape), "dtype": x.dtype.name} for x in entries]}

    def _pull(self, request: bytes, context: grpc.ServicerContext):
        transfer_id = request.decode("utf-8", "replace")
        held = self.release(transfer_id)
        if held is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no K/V held under transfer id {transfer_id!r}: already pulled, "
                          f"or not pulled within kv_hold_seconds ({self.hold_seconds:g} s)")
        start = time.monotonic()
        if held.number is not None:  # the decode server pulls the arrays from the device
            yield json.dumps({**self._header(held, held.kv.entries), "jax": {
                "address": self._transfer_address, "number": held.number}}).encode()
            self._count_sent(held, start)
            return
        # Only the pages that hold the prompt (the read was padded to a bucket).
        pages = _pages(held.kv)
        entries = [np.ascontiguousarray(np.asarray(x)[:, :, :pages]) for x in held.kv.entries]
        yield json.dumps(self._header(held, entries)).encode()
        for x in entries:
            data = memoryview(x.reshape(-1).view(np.uint8))
            for i in range(0, len(data), self.chunk_bytes):
                if _TEST_CHUNK_DELAY_S:
                    time.sleep(_TEST_CHUNK_DELAY_S)
                yield bytes(data[i:i + self.chunk_bytes])
        # (The puller reads to the end of the stream, so this runs before it adds the
        # request.)
        self._count_sent(held, start)

    def _count_sent(self, held: _Held, start: float) -> None:
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
                held = self.release(transfer_id, expired=True)
                if held is not None:
                    if held.number is not None:  # the transfer server lets go once pulled
                        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                 for x in held.kv.entries]
                        threading.Thread(target=self._drain.pull, args=(held.number, specs),
                                         name="kv-drain", daemon=True).start()
                    log.warning("K/V of transfer %s not pulled within %g s: released",
                                transfer_id, self.hold_seconds)


def _pages(kv: KVPages) -> int:
    """The pages that hold `kv`'s tokens (the rest pad a bucket)."""
    return -(-kv.num_tokens // kv.entries[0].shape[3])


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


class KVPuller:
    """A decode server's side: pulls K/V named by prefill servers' `kv_transfer_params`,
    over gRPC or, when the header says so, through a jax transfer server of its own (made
    at the first such pull) onto `device`."""

    def __init__(self, device):
        self.device = device
        self._transfer = None
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()

    def pull(self, params: dict, timeout: float) -> tuple[Prefilled, float]:
        """A request's K/V (host arrays, or arrays on `device`) with what computed them,
        and the seconds the pull took; KVTransferError when it cannot."""
        address, transfer_id = params["remote_address"], params["transfer_id"]
        start = time.monotonic()
        try:
            with grpc.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
                stream = channel.unary_stream(PULL)(transfer_id.encode(), timeout=timeout)
                header = json.loads(next(stream))
                if "jax" in header:
                    entries = self._pull_devices(header, timeout, transfer_id)
                else:
                    entries = _read_bytes(stream, header, address, transfer_id)
                for _ in stream:  # to its end: the sender counts it sent
                    raise KVTransferError(f"the prefill server at {address} sent more K/V "
                                          f"for transfer {transfer_id} than it announced")
        except grpc.RpcError as e:
            raise KVTransferError(f"pulling the K/V of transfer {transfer_id} from the "
                                  f"prefill server at {address} failed: {e.code().name}: "
                                  f"{e.details()}") from e
        except StopIteration as e:
            raise KVTransferError(f"the prefill server at {address} ended the K/V of "
                                  f"transfer {transfer_id} early") from e
        kv = KVPages(tuple(entries), header["num_tokens"])
        return (Prefilled(kv=kv, **{f: header[f] for f in _SOURCE}),
                time.monotonic() - start)

    def _pull_devices(self, header: dict, timeout: float, transfer_id: str) -> list:
        """The arrays from the prefill server's jax transfer server, on `device` (a
        thread waits for them: a pull from a server that died may never return)."""
        from jax.experimental import transfer

        address = header["jax"]["address"]
        with self._lock:
            if self._transfer is None:
                self._transfer = transfer.start_transfer_server(
                    self.device.client, "0.0.0.0:0", ["0.0.0.0:0"])
            connection = self._connections.get(address)
            if connection is None:
                connection = self._connections[address] = self._transfer.connect(address)
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        specs = [jax.ShapeDtypeStruct(e["shape"], jax.numpy.dtype(e["dtype"]),
                                      sharding=sharding) for e in header["entries"]]
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-jax-pull")
        try:
            arrays = pool.submit(lambda: jax.block_until_ready(
                connection.pull(header["jax"]["number"], specs))).result(timeout)
        except concurrent.futures.TimeoutError as e:
            raise KVTransferError(f"the K/V of transfer {transfer_id} did not arrive from "
                                  f"{address} within {timeout:g} s") from e
        except Exception as e:  # noqa: BLE001 - the transfer library's own errors
            raise KVTransferError(f"pulling the K/V of transfer {transfer_id} from {address} "
                                  f"failed: {type(e).__name__}: {e}") from e
        finally:
            pool.shutdown(wait=False)
        return list(arrays)


def _read_bytes(stream, header: dict, address: str, transfer_id: str) -> list[np.ndarray]:
    """The entries' bytes that follow a header, as host arrays (address and transfer_id:
    for errors)."""
    entries = []
    for spec in header["entries"]:
        x = np.empty(spec["shape"], jax.numpy.dtype(spec["dtype"]))
        data, filled = memoryview(x.reshape(-1).view(np.uint8)), 0
        while filled < len(data):
            chunk = next(stream)
            if filled + len(chunk) > len(data):
                raise KVTransferError(f"the prefill server at {address} sent more K/V for "
                                      f"transfer {transfer_id} than it announced")
            data[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
        entries.append(x)
    return entries
