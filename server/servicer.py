"""The jaxserve.v1.Inference service over the async engine."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import grpc

from jaxserve.engine.speculative.stats import SpeculationStats
from jaxserve.engine.status import EngineStatus
from jaxserve.engine.lora import LoRARequest
from jaxserve.outputs import Logprob, StepOutput, top_logprobs
from jaxserve.pooling_params import EMBEDDING_PARAMS, PoolingParams
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from server.async_engine import AsyncEngine, QueueFullError
from server.kv_transfer import KVTransferError, check_params
from server.security import Security, caller_key
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
        logit_bias=dict(s.logit_bias),
        structured_outputs=(structured_from_proto(s.structured_outputs)
                            if s.HasField("structured_outputs") else None),
        speculative=s.speculative if s.HasField("speculative") else True,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=s.include_stop_str_in_output,
        allowed_token_ids=list(s.allowed_token_ids) or None,
        bad_words=list(s.bad_words),
    )


def structured_from_proto(so: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = so.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs: set one of json_schema, json_object, regex, "
                         "choice, grammar")
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    return StructuredOutputsParams(**{"json" if kind == "json_schema" else kind: value},
                                   disable_any_whitespace=not so.allow_any_whitespace)


def _json_field(value: str, field: str, kind: type, of: str = "messages."):
    """An optional JSON-encoded field (of a Chat message unless `of` says; ValueError
    naming it)."""
    if not value:
        return None
    try:
        decoded = json.loads(value)
    except ValueError as e:
        raise ValueError(f"{of}{field}: not valid JSON ({e})") from e
    if not isinstance(decoded, kind):
        raise ValueError(f"{of}{field}: must be a JSON {kind.__name__}")
    return decoded


def chat_from_proto(chat: pb.Chat) -> tuple[list[dict], dict]:
    """A Chat prompt as (messages, chat template arguments); ValueError names a bad field."""
    messages = []
    for m in chat.messages:
        message = {"role": m.role, "content": [
            {"type": "text", "text": p.text} if p.WhichOneof("part") == "text" else
            {"type": "image", "image": p.image} for p in m.parts] if m.parts else m.content}
        if m.name:
            message["name"] = m.name
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls_json:
            message["tool_calls"] = _json_field(m.tool_calls_json, "tool_calls_json", list)
        messages.append(message)
    kwargs = _json_field(chat.chat_template_kwargs_json, "chat_template_kwargs_json", dict) or {}
    return messages, dict(kwargs, chat_template=chat.chat_template or None,
                          add_generation_prompt=not chat.continue_final_message,
                          continue_final_message=chat.continue_final_message,
                          tools=_json_field(chat.tools_json, "tools_json", list))


def token_logprobs(token: int, entries: dict[int, Logprob], n: int) -> pb.TokenLogprobs:
    """A token's logprob and rank, and the `n` most likely tokens with theirs."""
    return pb.TokenLogprobs(token_id=token, logprob=entries[token].logprob,
                            rank=entries[token].rank or 0,
                            top=[pb.TopLogprob(token_id=t, logprob=lp)
                                 for t, lp in top_logprobs(entries, n)])


def chunk_from_output(out: StepOutput, params: SamplingParams,
                      prompt: list[int] | None = None) -> pb.Chunk:
    """A StepOutput as a Chunk (`params`: its request's); with the request's `prompt` ids,
    its prompt logprobs too, on the output carrying them."""
    logprobs = [token_logprobs(t, e, params.logprobs)
                for t, e in zip(out.new_token_ids, out.new_logprobs or [])]
    scored = []
    if out.prompt_logprobs is not None and prompt is not None:
        scored = [token_logprobs(t, e, params.prompt_logprobs)
                  for t, e in zip(prompt[1:], out.prompt_logprobs[1:])]
    return pb.Chunk(token_ids=out.new_token_ids, text=out.new_text, logprobs=logprobs,
                    prompt_logprobs=scored)


MAX_EMBED_INPUTS = 2048  # an Embed call's inputs (OpenAI's limit on /v1/embeddings')


async def _last(stream) -> StepOutput:
    """A request's last output."""
    async for out in stream:
        if out.finished:
            return out
    raise RuntimeError("the request's stream ended before its last output")


class InferenceServicer(pb_grpc.InferenceServicer):
    """Requests go through the AsyncEngine; facts that do not change (model, tokenizer)
    are its EngineInfo, counters a snapshot the engine takes between steps."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, mesh_shape: dict[str, int],
                 security: Security | None = None):
        self.async_engine = async_engine
        self.security = security or Security()
        self.owners: dict[str, str | None] = {}  # running request id -> the key that sent it
        self.info = async_engine.info
        self.model_name = model_name
        self.mesh_shape = mesh_shape
        self.accepting = True
        self.started = time.monotonic()

    async def _check_up(self, context: grpc.aio.ServicerContext) -> None:
        """UNAVAILABLE while shutting down or once the engine stopped."""
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if not self.async_engine.is_alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the engine stopped ({self.async_engine.error})")

    async def _lora(self, name: str, context: grpc.aio.ServicerContext) -> LoRARequest | None:
        """The served adapter `name` names (None for ""); NOT_FOUND if none is."""
        if not name:
            return None
        lora = self.async_engine.adapters.get(name)
        if lora is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"lora_name: no LoRA adapter named {name!r} is served "
                                f"(have: {sorted(self.async_engine.adapters)})")
        return lora

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await self._check_up(context)
        rid = request.request_id or uuid.uuid4().hex
        which = request.WhichOneof("prompt")
        if which is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt: set one of text, token_ids or messages")
        lora = await self._lora(request.lora_name, context)
        try:
            params = sampling_from_proto(request.sampling)
            kv = (check_params(_json_field(request.kv_transfer_params_json,
                                           "kv_transfer_params_json", dict, ""))
                  if request.kv_transfer_params_json else None)
            images = list(request.images)
            if which == "messages":
                if images:
                    raise ValueError("images: a chat prompt carries its images in its "
                                     "messages' parts")
                messages, template_args = chat_from_proto(request.messages)
                prompt, images = await self.async_engine.encode_chat(messages, **template_args)
            else:
                if images:
                    images = await self.async_engine.prepare_images(images)
                text = request.text
                if images and which == "text":  # Gemma 3: its image markers written out
                    text = self.info.images.expand_text(text)
                prompt = (await self.async_engine.encode(text) if which == "text"
                          else list(request.token_ids.ids))
            outputs = await self.async_engine.add(rid, prompt, params, lora, images, kv,
                                                  request.priority, request.cache_salt or None)
        except ValueError as e:  # never admitted
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except KVTransferError as e:  # its prefill server went away, or its K/V expired
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        completion = 0
        self.owners[rid] = caller_key.get()
        try:
            async for out in outputs:
                if out.finish_reason == "error":  # the engine step failed; the server goes on
                    await context.abort(grpc.StatusCode.INTERNAL, f"the step failed: {out.error}")
                completion += len(out.new_token_ids)
                if out.new_token_ids or out.new_text:
                    yield pb.GenerateResponse(request_id=rid,
                                              chunk=chunk_from_output(out, params, prompt))
                if out.finished:
                    stop = out.stop_reason if isinstance(out.stop_reason, str) else ""
                    kv_out = (json.dumps(out.kv_transfer_params)
                              if out.kv_transfer_params is not None else "")
                    yield pb.GenerateResponse(request_id=rid, complete=pb.Complete(
                        finish_reason=out.finish_reason, matched_stop=stop,
                        usage=pb.Usage(prompt_tokens=out.num_prompt_tokens,
                                       completion_tokens=completion,
                                       cached_tokens=out.num_cached_tokens),
                        kv_transfer_params_json=kv_out))
        finally:  # the client cancelled, left or ran out of deadline: abort this call's request
            self.owners.pop(rid, None)
            await outputs.aclose()

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        """Every input admitted as an embedding request (all or none), then their
        embeddings; a client that leaves aborts them all."""
        pooling = PoolingParams(
            request.dimensions if request.HasField("dimensions") else None,
            request.normalize if request.HasField("normalize") else None)
        prompts = await self._checked(context, self._inputs(request))
        outputs = await self._pool(request, context, "embd", pooling, prompts)
        return pb.EmbedResponse(embeddings=[
            pb.Embedding(values=out.pooled.tolist(), prompt_tokens=len(p))
            for out, p in zip(outputs, prompts)])

    async def Classify(self, request: pb.ClassifyRequest, context) -> pb.ClassifyResponse:
        """Every input's class probabilities from the model's head (run as Embed runs)."""
        pooling = PoolingParams(task="classify", use_activation=request.use_activation
                                if request.HasField("use_activation") else None)
        prompts = await self._checked(context, self._inputs(request))
        outputs = await self._pool(request, context, "classify", pooling, prompts)
        labels = self.info.classifier.labels
        return pb.ClassifyResponse(classifications=[
            pb.Classification(probs=out.pooled.tolist(), prompt_tokens=len(p),
                              label=labels[int(out.pooled.argmax())] or "")
            for out, p in zip(outputs, prompts)])

    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        """The (query, document) pairs' scores (jaxserve/scoring.py; run as Embed runs)."""
        pooling, prompts, to_scores = await self._checked(context, self._scoring(request))
        outputs = await self._pool(request, context, "score", pooling, prompts)
        scores = to_scores([out.pooled for out in outputs])
        return pb.ScoreResponse(scores=[  # (a bi-encoder's prompts: its queries', then these)
            pb.Score(score=x, prompt_tokens=len(p))
            for x, p in zip(scores, prompts[-len(scores):])])

    async def _checked(self, context: grpc.aio.ServicerContext, work):
        """What `work` (a coroutine preparing a request) returns, once the server is up;
        INVALID_ARGUMENT with its message for a ValueError."""
        await self._check_up(context)
        try:
            return await work
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _inputs(self, request) -> list[list[int]]:
        """An Embed or Classify request's inputs as token ids."""
        if not 1 <= len(request.inputs) <= MAX_EMBED_INPUTS:
            raise ValueError(f"inputs: give 1 to {MAX_EMBED_INPUTS}, got "
                             f"{len(request.inputs)}")
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        prompts = []
        for i, item in enumerate(request.inputs):
            which = item.WhichOneof("input")
            prompt = (await self.async_engine.encode(item.text, special) if which == "text"
                      else list(item.token_ids.ids) if which == "token_ids" else [])
            if not prompt:
                raise ValueError(f"inputs[{i}]: empty; give text or token_ids")
            prompts.append(prompt)
        return prompts

    async def _scoring(self, request: pb.ScoreRequest):
        """A Score request's pooling, prompts and scoring function (AsyncEngine's)."""
        if not 1 <= len(request.documents) <= MAX_EMBED_INPUTS:
            raise ValueError(f"documents: give 1 to {MAX_EMBED_INPUTS}, got "
                             f"{len(request.documents)}")
        if not all(request.queries) or not all(request.documents):
            raise ValueError("queries, documents: a text must not be empty")
        if min(request.max_tokens_per_query, request.max_tokens_per_doc) < 0:
            raise ValueError("max_tokens_per_query, max_tokens_per_doc: must not be negative")
        try:
            kwargs = json.loads(request.chat_template_kwargs_json or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"chat_template_kwargs_json: not JSON ({e})") from None
        if not isinstance(kwargs, dict):
            raise ValueError("chat_template_kwargs_json: give a JSON object")
        return await self.async_engine.scoring_prompts(
            list(request.queries), list(request.documents), request.chat_template or None,
            kwargs, request.use_activation if request.HasField("use_activation") else None,
            request.max_tokens_per_query, request.max_tokens_per_doc)

    async def _pool(self, request, context: grpc.aio.ServicerContext, kind: str,
                    pooling: PoolingParams, prompts: list[list[int]]) -> list[StepOutput]:
        """Every prompt admitted as a pooling request (all or none; under the request's
        adapter, priority and cache salt), then their last outputs; a client that leaves
        aborts them all."""
        lora = await self._lora(request.lora_name, context)
        rid = uuid.uuid4().hex
        streams = []
        try:
            added = await asyncio.gather(
                *(self.async_engine.add(f"{kind}-{rid}-{i}", p, EMBEDDING_PARAMS, lora,
                                        priority=request.priority,
                                        cache_salt=request.cache_salt or None, pooling=pooling)
                  for i, p in enumerate(prompts)), return_exceptions=True)
            streams = [a for a in added if not isinstance(a, BaseException)]
            errors = [a for a in added if isinstance(a, BaseException)]
            if errors:
                raise errors[0]
            outputs = await asyncio.gather(*(_last(s) for s in streams))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:  # the client left, or one was refused: none runs on
            for stream in streams:
                await stream.aclose()
        for out in outputs:
            if out.finish_reason == "error":  # the engine step failed; the server goes on
                await context.abort(grpc.StatusCode.INTERNAL, f"the step failed: {out.error}")
        return outputs

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        ids = list(request.request_ids)
        if self.security.auth:  # only the caller's own requests, unless it holds an admin key
            key = caller_key.get()
            if not self.security.is_admin(key):
                ids = [rid for rid in ids if rid in self.owners and self.owners[rid] == key]
        aborted = await self.async_engine.abort_requests(ids)
        return pb.AbortResponse(num_aborted=aborted)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        tokenizer = self.info.tokenizer
        if tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
        try:
            ids = await self.async_engine.encode(request.text, request.add_special_tokens)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(ids=ids)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        e = self.info
        cfg = e.model_config
        bos = cfg.bos_token_id if cfg.bos_token_id is not None else -1
        return pb.ModelInfo(
            model=self.model_name, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_context_length=e.max_model_len, eos_token_ids=list(e.eos_token_ids),
            bos_token_id=bos, dtype=e.config.dtype, page_size=e.config.page_size,
            num_kv_pages=e.num_pages, mesh_shape=self.mesh_shape)

    async def GetServerStatus(self, request, context) -> pb.ServerStatus:
        a = self.async_engine
        snapshot = await a.snapshot()
        status = snapshot.status
        return pb.ServerStatus(
            running_requests=status.num_running, waiting_requests=status.num_waiting,
            kv_pages_used=status.num_used_pages, kv_pages_total=status.num_pages,
            prefix_cache_hit_rate=status.prefix_hit_rate,
            tokens_per_second=a.tokens_per_second(),
            uptime_seconds=time.monotonic() - self.started,
            total_generated_tokens=a.total_generated,
            mean_step_ms=a.mean_ms(a.step_times),
            mean_step_gap_ms=a.mean_ms(a.step_gaps),
            steps=status.num_steps, overlapped_steps=status.num_overlapped_steps,
            expert_load=[pb.ExpertLoad(layer=layer, tokens=tokens.tolist(),
                                       imbalance=imbalance)
                         for layer, tokens, imbalance in snapshot.routers],
            speculation=speculation_status(status.speculation),
            host_kv_cache=host_kv_status(status))


def host_kv_status(status: EngineStatus) -> pb.HostKVCache | None:
    """GetServerStatus's host KV tier counters (None without one)."""
    if not status.host_capacity:
        return None
    return pb.HostKVCache(capacity_pages=status.host_capacity, pages_held=status.host_pages,
                          pages_stored=status.pages_offloaded,
                          prefix_hit_tokens=status.host_hits)


def speculation_status(stats: SpeculationStats | None) -> pb.Speculation | None:
    """GetServerStatus's speculative decoding counters (None when it is off)."""
    if stats is None:
        return None
    return pb.Speculation(
        method=stats.method, num_speculative_tokens=stats.num_speculative_tokens,
        active=stats.active, verify_steps=stats.steps, proposed_tokens=stats.num_proposed,
        accepted_tokens=stats.num_accepted, acceptance_rate=stats.acceptance_rate,
        acceptance_by_position=stats.acceptance_by_position)
