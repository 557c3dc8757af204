"""A gRPC method handler with a check run before its method (used by the API-key
interceptor and by the undecodable-request guard)."""

from __future__ import annotations

import grpc


def checked(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """`handler` whose method first awaits `check(request, context)`, which may abort the
    call (or set context variables the method reads). Unary-unary and unary-stream only."""
    if handler.response_streaming:
        method = handler.unary_stream

        async def stream(request, context):
            await check(request, context)
            responses = method(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()
        return handler._replace(unary_stream=stream)
    unary_method = handler.unary_unary

    async def unary(request, context):
        await check(request, context)
        return await unary_method(request, context)
    return handler._replace(unary_unary=unary)
