"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from jaxserve import scoring
from jaxserve.beam_search import (BeamSearch, BeamSearchOutput, BeamSearchParams,
                                  advance_all, live_beams)
from jaxserve.config import EngineConfig
from jaxserve.engine.disaggregated import DisaggregatedEngine
from jaxserve.engine.engine import Engine
from jaxserve.engine.lora import LoRARequest
from jaxserve.loading.media import MediaPolicy, take_images
from jaxserve.outputs import (ClassificationOutput, ClassificationRequestOutput,
                              CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                              RequestOutput, ScoringOutput, ScoringRequestOutput)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

# A prompt: text, token ids, or vLLM's dict of either with its images and cache salt:
# {"prompt": str | "prompt_token_ids": list[int], "multi_modal_data": {"image": image | [...]},
#  "cache_salt": str}
Prompt = str | list[int] | dict
Conversation = list[dict]


class LLM:
    """Generate text from a Hugging Face checkpoint directory (the demo model if None).

    Keyword arguments are EngineConfig fields (dtype, max_model_len, page_size,
    max_num_seqs, max_num_batched_tokens, enable_prefix_caching, num_pages, ...);
    `mesh` is a {"data": d, "model": m} mapping and `sharding` a strategy ("tp", "tp+sp",
    "dp", "dp+tp", "dp+tp+sp"). All step buckets compile here. `enable_lora=True`
    (with `max_loras`, `max_lora_rank`, `max_cpu_loras`) serves LoRA adapters, named per
    request by `generate(..., lora_request=LoRARequest(name, int_id, path))`.
    `prefill` and `decode` (EngineConfig fields over the common ones, e.g. `{"devices":
    [0, 1, 2, 3], "mesh": {"model": 4}}`) prefill on one engine and decode on another
    (engine/disaggregated.py).
    """

    def __init__(self, model: str | None = None, *, warmup: bool = True,
                 prefill: dict | None = None, decode: dict | None = None, **engine_args):
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        for args in (engine_args, prefill or {}, decode or {}):
            unknown = sorted(set(args) - known)
            if unknown:
                raise ValueError(f"unknown LLM arguments {unknown}; known: {sorted(known)}")
        if prefill is not None or decode is not None:
            self.engine = DisaggregatedEngine.from_config(
                EngineConfig(model=model, **{**engine_args, **(prefill or {})}),
                EngineConfig(model=model, **{**engine_args, **(decode or {})}))
        else:
            self.engine = Engine.from_config(EngineConfig(model=model, **engine_args))
        # generate returns whole outputs: no text made per step, and a plain request's
        # tokens handed out with its first and its last output only.
        self.engine.stream_text = False
        self.engine.stream_interval = sys.maxsize
        self._ids = itertools.count()
        if warmup:
            self.engine.warmup()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             media: MediaPolicy = MediaPolicy()) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} messages) or several,
        rendered with the model's chat template (or `chat_template`) as transformers'
        `apply_chat_template` renders it; `tools` and `chat_template_kwargs` reach the
        template. Raises ValueError (ChatTemplateError) when a conversation cannot be
        rendered. Each RequestOutput's `prompt` is the rendered text. Image parts
        (`image_url` with a data: URL, or an http(s) / file URL that `media` allows;
        `image_pil`) reach a vision-language model with their placeholders."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        single = not messages or isinstance(messages[0], dict)
        conversations = [take_images(c, media) for c in ([messages] if single else messages)]
        texts = [tokenizer.apply_chat_template(
            c, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, tools=tools,
            **(chat_template_kwargs or {})) for c, _, _ in conversations]
        prompts = [{"prompt_token_ids": tokenizer.encode(
                        self.engine.images.preparer.expand_text(t) if images else t,
                        add_special_tokens=False),
                    "multi_modal_data": {"image": self.engine.prepare_images(images, names)
                                         if images else []}}
                   for t, (_, images, names) in zip(texts, conversations)]
        results = self.generate(prompts, sampling_params, use_tqdm)
        for result, text in zip(results, texts):
            result.prompt = text
        return results

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in the prompts' order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the engine needs `enable_lora=True`."""
        prompts = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))

        results: dict[str, RequestOutput] = {}

        def add(rid: str, i: int, prompt, images: list, salt: str | None) -> None:
            p = params[i]
            ids = self.engine.add_request(rid, prompt, p, priority[i], loras[i], images,
                                          cache_salt=salt)
            results[rid] = RequestOutput(
                rid, prompt if isinstance(prompt, str) else None, ids,
                [CompletionOutput(0, "", [], None, [] if p.logprobs is not None else None)],
                finished=False)

        order = self._add_all(prompts, add)
        bar = tqdm(total=len(order), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for step_out in self.engine.step():
                result = results[step_out.request_id]
                out = result.outputs[0]
                out.token_ids.extend(step_out.new_token_ids)
                out.text += step_out.new_text
                if step_out.new_logprobs is not None:
                    out.logprobs.extend(step_out.new_logprobs)
                if step_out.prompt_logprobs is not None:
                    result.prompt_logprobs = step_out.prompt_logprobs
                if step_out.finished:
                    out.finish_reason = step_out.finish_reason
                    out.stop_reason = step_out.stop_reason
                    result.finished = True
                    result.num_cached_tokens = step_out.num_cached_tokens
                    bar.update()
        bar.close()
        return [results[rid] for rid in order]

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's embedding (`outputs.embedding`, a list of
        floats), the final hidden state at its last token after the last norm (or the
        mean over its tokens, or its first token's, where the checkpoint's
        sentence-transformers modules say so: jaxserve/pooling_params.py), L2-normalized
        unless `pooling_params` or those modules say not, in the prompts' order."""
        pooling = pooling_params or PoolingParams()
        return [EmbeddingRequestOutput(rid, ids, EmbeddingOutput(v.tolist()))
                for rid, ids, v in self._pool(_prompt_list(prompts), pooling, lora_request,
                                              use_tqdm, "embedding")]

    def classify(self, prompts: Prompt | Sequence[Prompt],
                 pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify`: each prompt's class probabilities (`outputs.probs`) from
        the checkpoint's classification head (loading/classifier.py) at its last token;
        raw logits with `PoolingParams(task="classify", use_activation=False)`."""
        pooling = dataclasses.replace(pooling_params or PoolingParams(), task="classify")
        return [ClassificationRequestOutput(rid, ids, ClassificationOutput(v.tolist()))
                for rid, ids, v in self._pool(_prompt_list(prompts), pooling, lora_request,
                                              use_tqdm, "classifying")]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *,
              pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
              lora_request: LoRARequest | None = None, chat_template: str | None = None,
              chat_template_kwargs: dict | None = None, max_tokens_per_query: int = 0,
              max_tokens_per_doc: int = 0) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: a score (`outputs.score`) for each (query, document) pair of
        1:1, 1:N or N:N texts, in `data_2`'s order: a cross-encoder's head output on the
        pair as one prompt, or the cosine similarity of a bi-encoder's two embeddings
        (jaxserve/scoring.py); each query and document first cut to its first
        `max_tokens_per_query` / `max_tokens_per_doc` tokens when given."""
        queries = [data_1] if isinstance(data_1, str) else list(data_1)
        documents = [data_2] if isinstance(data_2, str) else list(data_2)
        pairs = scoring.pairs(queries, documents)
        params = pooling_params or PoolingParams()
        tokenizer = self.engine.tokenizer
        if max_tokens_per_query or max_tokens_per_doc:
            pairs = scoring.cut_pairs(tokenizer, pairs, max_tokens_per_query,
                                      max_tokens_per_doc)
        if scoring.cross_encodes(getattr(self.engine, "classifier", None)):
            prompts = [scoring.pair_prompt(tokenizer, self.engine.classifier, q, d,
                                           chat_template, chat_template_kwargs)
                       for q, d in pairs]
            pooled = self._pool(prompts, dataclasses.replace(params, task="classify"),
                                lora_request, use_tqdm, "scoring")
            return [ScoringRequestOutput(rid, ids, ScoringOutput(float(v[0])))
                    for rid, ids, v in pooled]
        texts = scoring.embedded_texts(pairs)
        pooled = self._pool(texts, params, lora_request, use_tqdm, "scoring")
        ids = dict(zip(texts, (p[1] for p in pooled)))
        scores = scoring.cosine_scores(pairs, [v for _, _, v in pooled])
        return [ScoringRequestOutput(rid, ids[q] + doc_ids, ScoringOutput(score))
                for (q, _), (rid, doc_ids, _), score in zip(pairs, pooled[-len(pairs):],
                                                            scores)]

    def _pool(self, prompts: list[Prompt], pooling: PoolingParams,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
              use_tqdm: bool, desc: str) -> list[tuple[str, list[int], np.ndarray]]:
        """Each prompt's (request id, prompt token ids, pooled vector), in order;
        RuntimeError when a step fails one (the others aborted)."""
        if not isinstance(self.engine, Engine):
            raise ValueError("pooling requests run on one engine, not a prefill/decode pair")
        loras = _per_prompt(lora_request, len(prompts))
        ids: dict[str, list[int]] = {}
        pooled: dict[str, np.ndarray] = {}

        def add(rid: str, i: int, prompt, images: list, salt: str | None) -> None:
            ids[rid] = self.engine.add_request(rid, prompt, None, 0, loras[i], images,
                                               cache_salt=salt, pooling=pooling)

        order = self._add_all(prompts, add)
        bar = tqdm(total=len(order), desc=desc, disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finish_reason == "error":  # the others are aborted: none is left
                    for rid in order:
                        self.engine.abort_request(rid)
                    raise RuntimeError(f"request {out.request_id}: {out.error}")
                if out.finished:
                    pooled[out.request_id] = out.pooled
                    bar.update()
        bar.close()
        return [(rid, ids[rid], pooled[rid]) for rid in order]

    def _add_all(self, prompts: list[Prompt], add) -> list[str]:
        """Queue every prompt with `add(request id, index, text or token ids, images,
        cache salt)`; their request ids in order. A bad one (ValueError) aborts those
        queued before it."""
        order = []
        try:
            for i, prompt in enumerate(prompts):
                rid = str(next(self._ids))
                add(rid, i, *_prompt_parts(prompt))
                order.append(rid)
        except ValueError:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        return order

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search` (jaxserve/beam_search.py): each prompt's
        `params.beam_width` best sequences, best first, each with its `tokens` (the
        prompt's, then its own), `cum_logprob` and `text` (all its tokens decoded). Text
        or token-id prompts (a dict may carry a cache_salt; no images)."""
        parts = [_prompt_parts(p) for p in _prompt_list(prompts)]
        if any(images for _, images, _ in parts):
            raise ValueError("beam search takes text or token-id prompts, without images")
        loras = _per_prompt(lora_request, len(parts))
        step = params.step_params()
        # The first step runs the prompts as given (the engine tokenizes text ones).
        firsts = self.generate([_prompt_dict(p, salt) for p, _, salt in parts], step,
                               lora_request=loras)
        searches = []
        for first in firsts:
            search = BeamSearch(first.prompt_token_ids, params, self.engine.eos_token_ids,
                                self.engine.max_model_len)
            search.advance([first.outputs[0].logprobs[0]])
            searches.append(search)
        bar = tqdm(total=params.max_tokens, desc="beam search", disable=not use_tqdm)
        bar.update()
        while not all(s.done for s in searches):
            beams = live_beams(searches)
            outs = self.generate([_prompt_dict(beam.tokens, parts[i][2]) for i, beam in beams],
                                 step, lora_request=[loras[i] for i, _ in beams])
            advance_all(searches, [o.outputs[0].logprobs[0] for o in outs])
            bar.update()
        bar.close()
        tokenizer = self.engine.tokenizer
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens, params.skip_special_tokens)
            results.append(BeamSearchOutput(best))
        return results


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or several, as a list of prompts."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                n: int) -> list[LoRARequest | None]:
    """Each of `n` prompts' LoRA adapter: one for all, or one per prompt."""
    loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
             else [lora_request] * n)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora_requests for {n} prompts")
    return loras


def _prompt_dict(prompt: str | list[int], cache_salt: str | None) -> dict:
    return {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt,
            **({"cache_salt": cache_salt} if cache_salt else {})}


def _prompt_parts(prompt: Prompt) -> tuple[str | list[int], list, str | None]:
    """A prompt's text or token ids, its images and its cache salt (vLLM's prompt
    dicts)."""
    if not isinstance(prompt, dict):
        return prompt, [], None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt"}
    data = prompt.get("multi_modal_data") or {}
    if unknown or not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError("a prompt dict has 'prompt' or 'prompt_token_ids', and optionally "
                         "'multi_modal_data': {'image': an image or a list of them} and "
                         "'cache_salt'")
    text = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if text is None:
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    images = data.get("image", [])
    return (text, list(images) if isinstance(images, (list, tuple)) else [images],
            prompt.get("cache_salt"))
