"""JetStream's Orchestrator API (Decode, HealthCheck) over the same engine.

Semantics as JetStream: a token prompt gets token ids only in its responses, a text
prompt gets text and ids; BOS is prepended unless `has_bos`; every streamed message
carries one sample; decoding is greedy and stops at EOS or `max_tokens`; a full waiting
queue answers RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import uuid

import grpc

from jaxserve.sampling_params import SamplingParams
from server.async_engine import AsyncEngine, QueueFullError
from server.protos.jetstream_proto import jetstream_pb2 as js
from server.protos.jetstream_proto import jetstream_pb2_grpc as js_grpc

Sample = js.DecodeResponse.StreamContent.Sample


class OrchestratorServicer(js_grpc.OrchestratorServicer):
    def __init__(self, async_engine: AsyncEngine, is_accepting):
        self.async_engine = async_engine
        self.info = async_engine.info  # facts that do not change: tokenizer, model config
        self.is_accepting = is_accepting  # callable: False while draining

    async def _prompt(self, request: js.DecodeRequest) -> tuple[list[int], bool]:
        """The prompt token ids and whether responses carry text."""
        tokenizer = self.info.tokenizer
        which = request.WhichOneof("content")
        if which == "text_content":
            if tokenizer is None:
                raise ValueError("text_content: this model has no tokenizer; send token_content")
            if not request.text_content.text:
                raise ValueError("text_content.text is empty")
            ids = await self.async_engine.encode(request.text_content.text, False)
            with_text = True
        elif which == "token_content":
            ids, with_text = list(request.token_content.token_ids), False
        else:
            raise ValueError("content: set text_content or token_content")
        bos = self.info.model_config.bos_token_id
        if tokenizer is not None and tokenizer.bos_token_id is not None:
            bos = tokenizer.bos_token_id
        if not request.has_bos and bos is not None:
            ids = [bos] + ids
        return ids, with_text

    async def Decode(self, request: js.DecodeRequest, context: grpc.aio.ServicerContext):
        if not self.is_accepting():
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the server is not serving (shutting down, or its engine stopped)")
        try:
            if request.num_samples > 1:
                raise ValueError(f"num_samples must be 0 or 1, got {request.num_samples}")
            if request.lora_adapter_id:
                raise ValueError("lora_adapter_id: LoRA adapters are not supported")
            if request.max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {request.max_tokens}")
            ids, with_text = await self._prompt(request)
            params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens or None)
            outputs = await self.async_engine.add(f"jetstream-{uuid.uuid4().hex}", ids, params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        pending_text = ""
        try:
            async for out in outputs:
                if out.finish_reason == "error":
                    await context.abort(grpc.StatusCode.INTERNAL, f"the step failed: {out.error}")
                text = out.new_text if with_text else ""
                if not out.new_token_ids:  # JetStream never sends an empty message
                    pending_text += text
                    if pending_text and out.finished:
                        yield _stream_message(pending_text, [])
                    continue
                yield _stream_message(pending_text + text, out.new_token_ids)
                pending_text = ""
        finally:  # the client left: abort this call's request
            await outputs.aclose()

    async def HealthCheck(self, request, context) -> js.HealthCheckResponse:
        return js.HealthCheckResponse(is_live=self.async_engine.is_alive and self.is_accepting())


def _stream_message(text: str, token_ids: list[int]) -> js.DecodeResponse:
    return js.DecodeResponse(stream_content=js.DecodeResponse.StreamContent(
        samples=[Sample(text=text, token_ids=token_ids)]))
