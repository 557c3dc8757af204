"""gRPC services whose requests that do not decode get INVALID_ARGUMENT.

grpcio answers a request its deserializer rejects (a string field that is not valid UTF-8,
truncated bytes) with UNKNOWN and a traceback in the log. `add_servicer` registers a
servicer through its generated `add_XServicer_to_server`, but with deserializers that
hand such a request to the method as an `Undecodable`, which the method's wrapper answers
with INVALID_ARGUMENT and the decoder's reason.
"""

from __future__ import annotations

import dataclasses

import grpc
from google.protobuf.message import DecodeError

from server.rpc_checks import checked


@dataclasses.dataclass
class Undecodable:
    reason: str


def _lenient(deserialize):
    def decode(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as e:
            return Undecodable(str(e) or "malformed message")
    return decode


async def _refuse_undecodable(request, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request does not decode ({request.reason}); strings must be "
                            f"valid UTF-8")


def _guarded(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_streaming:  # none of ours: leave as generated
        return handler
    lenient = handler._replace(request_deserializer=_lenient(handler.request_deserializer))
    return checked(lenient, _refuse_undecodable)


class _Registrar:
    """Stands in for the server while a generated `add_XServicer_to_server` runs."""

    def __init__(self, server: grpc.aio.Server):
        self.server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the registered handlers below serve every method

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        guarded = {name: _guarded(h) for name, h in handlers.items()}
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, guarded),))
        self.server.add_registered_method_handlers(service, guarded)


def add_servicer(add_to_server, servicer, server: grpc.aio.Server) -> None:
    """`add_to_server(servicer, server)` (a generated `add_XServicer_to_server`), with
    undecodable requests answered INVALID_ARGUMENT."""
    add_to_server(servicer, _Registrar(server))
