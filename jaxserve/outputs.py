"""What the engine hands back: per-step deltas and, offline, whole results (vLLM-shaped)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when outside the returned top-N
    decoded_token: str | None = None


def top_logprobs(entries: dict[int, Logprob], n: int) -> list[tuple[int, float]]:
    """The `n` best ranked of a token's logprob entries, (token id, logprob), best first."""
    ranked = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank is not None)
    return [(t, lp) for _, t, lp in ranked[:n]]


@dataclasses.dataclass
class StepOutput:
    """New tokens of one request after one engine step (what a stream sends)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, Logprob]] | None
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_scheduled_at: float | None = None  # time.monotonic() when it first ran (queue time)
    error: str | None = None  # finish_reason "error": what failed
    # A prefill engine's request that decodes elsewhere (Engine.add_request's
    # remote_decode): its prompt's K/V (engine/kv_transfer.py's KVPages), on its last output.
    kv_pages: Any = None
    # A server's: where a decode server pulls those K/V from (server/kv_transfer.py).
    kv_transfer_params: dict | None = None
    # SamplingParams.prompt_logprobs, on the request's first output: None, then an entry
    # per prompt token after the first (RequestOutput.prompt_logprobs).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # A pooling request's (Engine.add_request's `pooling`), float32: an embedding
    # `[dimensions]`, or a classification's `[num_labels]` probabilities (or logits).
    pooled: Any = None

    @staticmethod
    def merge(outputs: list[StepOutput]) -> StepOutput:
        """Consecutive outputs of one request as one (a stream that fell behind sends what
        piled up in one message, as vLLM's output collector does): the deltas joined, the
        rest from the last."""
        if len(outputs) == 1:
            return outputs[0]
        last = outputs[-1]
        logprobs = None
        if any(o.new_logprobs is not None for o in outputs):
            logprobs = [lp for o in outputs for lp in o.new_logprobs or ()]
        return dataclasses.replace(
            last, new_token_ids=[t for o in outputs for t in o.new_token_ids],
            new_text="".join(o.new_text for o in outputs), new_logprobs=logprobs,
            prompt_logprobs=outputs[0].prompt_logprobs)


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: str | int | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: None for the first prompt token, then each token's
    # log-probability given those before it (with its rank) and the N most likely there.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt (vLLM's)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]  # per label (raw logits when use_activation is False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput:
    """`LLM.classify`'s result for one prompt (vLLM's)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result for one pair (vLLM's): a cross-encoder's pair prompt, or a
    bi-encoder's query tokens then document tokens."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
