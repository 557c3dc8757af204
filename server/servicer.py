"""The jaxserve.v1.Inference service over the async engine."""

from __future__ import annotations

import time
import uuid

import grpc

from jaxserve.outputs import StepOutput
from jaxserve.sampling_params import SamplingParams
from server.async_engine import AsyncEngine, QueueFullError
from server.protos.jaxserve.v1 import inference_pb2 as pb
from server.protos.jaxserve.v1 import inference_pb2_grpc as pb_grpc


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    """Proto → SamplingParams; proto3 zero values mean "off" (ValueError names bad fields)."""
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p or 1.0,
        top_k=s.top_k if s.top_k != 0 else -1,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        min_tokens=s.min_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        seed=s.seed if s.HasField("seed") else None,
        logprobs=s.logprobs or None,
    )


def chunk_from_output(out: StepOutput) -> pb.Chunk:
    logprobs = []
    for token, entries in zip(out.new_token_ids, out.new_logprobs or []):
        top = [pb.TopLogprob(token_id=t, logprob=e.logprob) for t, e in entries.items()
               if e.rank is not None]
        logprobs.append(pb.TokenLogprobs(token_id=token, logprob=entries[token].logprob, top=top))
    return pb.Chunk(token_ids=out.new_token_ids, text=out.new_text, logprobs=logprobs)


class InferenceServicer(pb_grpc.InferenceServicer):
    """Requests go through the AsyncEngine (its loop thread owns the engine); facts that
    do not change (model, tokenizer) and counters are read from the Engine directly."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, mesh_shape: dict[str, int]):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.model_name = model_name
        self.mesh_shape = mesh_shape
        self.accepting = True
        self.started = time.monotonic()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        rid = request.request_id or uuid.uuid4().hex
        which = request.WhichOneof("prompt")
        if which is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt: set either text or token_ids")
        prompt = request.text if which == "text" else list(request.token_ids.ids)
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        completion, finished = 0, False
        try:
            async for out in self.async_engine.generate(rid, prompt, params):
                completion += len(out.new_token_ids)
                if out.new_token_ids or out.new_text:
                    yield pb.GenerateResponse(request_id=rid, chunk=chunk_from_output(out))
                if out.finished:
                    finished = True
                    stop = out.stop_reason if isinstance(out.stop_reason, str) else ""
                    yield pb.GenerateResponse(request_id=rid, complete=pb.Complete(
                        finish_reason=out.finish_reason, matched_stop=stop,
                        usage=pb.Usage(prompt_tokens=out.num_prompt_tokens,
                                       completion_tokens=completion,
                                       cached_tokens=out.num_cached_tokens)))
        except ValueError as e:
            finished = True  # never admitted
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            finished = True
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:
            if not finished:  # client cancelled, disconnected or ran out of deadline
                self.async_engine.abort(rid)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        for rid in request.request_ids:
            self.async_engine.abort(rid)
        return pb.AbortResponse(num_aborted=len(request.request_ids))

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
        return pb.TokenizeResponse(ids=tokenizer.encode(request.text, request.add_special_tokens))

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        e = self.engine
        cfg = e.model_config
        bos = cfg.bos_token_id if cfg.bos_token_id is not None else -1
        return pb.ModelInfo(
            model=self.model_name, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_context_length=e.max_model_len, eos_token_ids=list(e.eos_token_ids),
            bos_token_id=bos, dtype=e.config.dtype, page_size=e.config.page_size,
            num_kv_pages=e.num_pages, mesh_shape=self.mesh_shape)

    async def GetServerStatus(self, request, context) -> pb.ServerStatus:
        e, a = self.engine, self.async_engine
        sched = e.scheduler
        return pb.ServerStatus(
            running_requests=sched.num_running, waiting_requests=sched.num_waiting,
            kv_pages_used=sched.num_used_pages, kv_pages_total=sched.num_pages,
            prefix_cache_hit_rate=sched.prefix_hit_rate,
            tokens_per_second=a.tokens_per_second(),
            uptime_seconds=time.monotonic() - self.started,
            total_generated_tokens=a.total_generated,
            mean_step_ms=a.mean_ms(a.step_times),
            mean_step_gap_ms=a.mean_ms(a.step_gaps),
            steps=e.num_steps, overlapped_steps=e.num_overlapped_steps)
