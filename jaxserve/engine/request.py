"""Host-side state of one request while the engine works on it.

A `Sequence` is what the scheduler and the page allocator see: tokens, pages, progress.
A `Request` is that sequence plus its output's text as returned so far and the grammar
its output keeps to.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance

    from jaxserve.engine.output_text import OutputText
    from jaxserve.engine.token_filters import TokenFilter


log = logging.getLogger(__name__)

# An output token sampled by a step still running on the device (async scheduling): the
# next step reads its id from the device, the host fills it in when the step's outputs land.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's tokens, KV pages and progress.

    `num_computed_tokens` counts the tokens whose K/V are in the cache. A step schedules
    tokens `[num_computed_tokens, num_computed_tokens + n)`; when that reaches
    `num_tokens`, the step's sampled token is appended to `output_token_ids`.
    Lower `priority` is served first (vLLM's convention).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: Any = None
    priority: int = 0
    arrival: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # Its KV pages, in token order. Grown in place only; any other change assigns a new
    # list (the page allocator's way), which is how BatchBuilder's page table sees it.
    page_ids: list[int] = dataclasses.field(default_factory=list)
    data_shard: int = 0  # whose page pool `page_ids` index (data parallelism)
    num_preemptions: int = 0
    finish_reason: str | None = None
    first_scheduled_at: float | None = None  # time.monotonic() when first admitted to run
    # Speculative decoding's state of this sequence: the speculator's alone
    # (speculative/speculator.py, SeqSpeculation); None until it speculates.
    speculation: Any = None
    # The most output tokens it may have (max_tokens, or the room left by max_model_len):
    # once its outputs, placeholders of steps in flight included, reach it, nothing is
    # scheduled for it (None: no limit known to the scheduler).
    max_output_tokens: int | None = None
    # Its LoRA adapter (engine/lora.py's LoRARequest; None: the base model), the device
    # slot holding it while it runs (0: none) and the root its prefix-cache page hashes
    # chain from (one per adapter, so that two adapters never share KV pages).
    lora: Any = None
    lora_slot: int = 0
    cache_root: bytes = b""
    # Its prompt's images (multimodal/inputs.py's ImageSpans, in prompt order).
    images: list = dataclasses.field(default_factory=list)
    # M-RoPE (Qwen2.5-VL) with images: `[3, prompt tokens]` offsets of each prompt token's
    # time, height and width positions from its position, and the offset of every token
    # after the prompt (None: none, all offsets 0).
    rope_offsets: np.ndarray | None = None
    rope_delta: int = 0
    # Its images are seen whole (Gemma 3: their tokens attend to each other), so a chunk
    # of its prompt never ends inside one (`chunk`).
    whole_images: bool = False
    # Prefill/decode disaggregation (kv_transfer.py). `remote_decode`: the seq ends after
    # its first token and its prompt's K/V are handed out (a prefill engine's). `prefilled`:
    # its prompt's K/V, made elsewhere, written into its pages when it is admitted (then
    # None: after a preemption it computes them itself).
    remote_decode: bool = False
    prefilled: Any = None
    # Every prompt token is computed, none read from the prefix cache (an embedding that
    # averages its prompt or reads its first token).
    whole_prompt: bool = False

    def chunk(self, start: int, n: int) -> int:
        """How many of `n` tokens from `start` a step may compute: all, unless they end
        inside an image seen whole, then those before it (0: none fit yet)."""
        if self.whole_images:
            for span in self.images:
                if span.start < start + n < span.end:
                    return max(0, span.start - start)
        return n

    def rope_offsets_at(self, start: int, n: int) -> np.ndarray:
        """`[3, n]` offsets of tokens [start, start + n)."""
        out = np.full((3, n), self.rope_delta, np.int32)
        if self.rope_offsets is not None:
            prompt = self.rope_offsets[:, start:start + n]
            out[:, :prompt.shape[1]] = prompt
        return out

    def image_key(self, start: int, stop: int) -> bytes:
        """What, beyond token ids, tells tokens [start, stop) apart from others: the hash
        and offset of each image overlapping them (b"" for none). The prefix cache keys
        pages by it, so two images never share K/V."""
        return b"".join(span.image.hash + (start - span.start).to_bytes(8, "little", signed=True)
                        for span in self.images if span.start < stop and span.end > start)

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt tokens are scored (SamplingParams.prompt_logprobs)."""
        return self.params is not None and self.params.prompt_logprobs is not None

    @property
    def num_prefilled_tokens(self) -> int:
        """Tokens whose K/V arrive with the seq (0: none)."""
        return self.prefilled.num_tokens if self.prefilled is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """`token_ids[start:stop]` without concatenating the whole prompt and output."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        if start >= n:
            return output[start - n:stop - n]
        return prompt[start:] + output[:stop - n]

    def token_at(self, i: int) -> int:
        """`token_ids[i]` (0 <= i < num_tokens)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens before the first PLACEHOLDER (those of steps in flight come last)."""
        return len(self.prompt_token_ids) + self.num_known_outputs

    @property
    def num_known_outputs(self) -> int:
        """Outputs before the first PLACEHOLDER."""
        out = self.output_token_ids
        n = len(out)
        while n and out[n - 1] == PLACEHOLDER:
            n -= 1
        return n

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


_GOES_ON = (None, None, None)  # Request.check_stop's answer for a request that goes on


@dataclasses.dataclass(eq=False)
class Request:
    """A sequence and its output as returned so far: `text` streams its text (None when
    the engine does not detokenize); `grammar` matches its output when it has
    structured_outputs."""

    seq: Sequence
    # The token ids that end it once it has min_tokens outputs: its stop_token_ids, and
    # EOS unless it ignores it.
    stop_ids: frozenset[int]
    text: OutputText | None = None
    grammar: llguidance.LLMatcher | None = None
    # Its allowed_token_ids and bad_words as masks (engine/token_filters.py).
    filter: TokenFilter | None = None
    # A remote_decode seq's prompt K/V (kv_transfer.KVPages), read as its prompt is done.
    kv_pages: Any = None
    # An embedding request's (Engine.add_request's `pooling`), and the sum of its pooled
    # tokens' hidden states so far (Engine._pool_segments), until its output hands it out.
    pooling: Any = None
    pooled: Any = None
    # Nothing but its tokens to look at while it runs: no grammar, no logprobs, its text
    # (if any) decoded when it ends, not a remote_decode seq (`Engine._collect` hands it
    # most tokens without `_append`).
    plain: bool = dataclasses.field(init=False)
    # Prompt logprobs (SamplingParams.prompt_logprobs) until its first output hands them
    # out, then None: at each prompt position but the first, (logprob, rank, top ids, top
    # logprobs) of the prompt's token there (None until a step scores it).
    prompt_scores: list | None = dataclasses.field(init=False)
    # The outputs it came with (a decode side's first token, which its prefill made), and
    # its outputs handed out so far (those, then in StepOutputs): a plain request's newer
    # tokens may be held back (Engine.stream_interval) and go out with a later output.
    num_brought: int = dataclasses.field(init=False)
    num_reported: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        seq = self.seq
        self.plain = (self.grammar is None and seq.params.logprobs is None
                      and not seq.scores_prompt and (self.text is None or self.text.deferred)
                      and not seq.remote_decode and self.pooling is None)
        self.prompt_scores = [None] * seq.num_prompt_tokens if seq.scores_prompt else None
        self.num_brought = self.num_reported = len(self.seq.output_token_ids)

    def unreported(self) -> list[int]:
        """Its known outputs in no StepOutput yet (held back by Engine.stream_interval)."""
        return self.seq.output_token_ids[self.num_reported:self.seq.num_known_outputs]

    @property
    def max_tokens(self) -> int:
        """Its output limit: max_tokens, or the room max_model_len leaves."""
        return self.seq.max_output_tokens

    def check_stop(self, token: int, num_outputs: int, eos_token_ids: tuple[int, ...],
                   max_model_len: int) -> tuple[str | None, str | int | None, str | None]:
        """Whether the request ends with `token`, its `num_outputs`-th output: (finish
        reason, stop reason, error); its grammar advances past the token. Stop strings are
        OutputText's to find."""
        seq, grammar = self.seq, self.grammar
        if (grammar is None and token not in self.stop_ids
                and num_outputs < seq.max_output_tokens
                and len(seq.prompt_token_ids) + num_outputs < max_model_len):
            return _GOES_ON  # (most tokens of most requests: nothing more to look at)
        params = seq.params
        if grammar is not None and not grammar.consume_token(token):
            return "error", None, (f"structured output: token {token} breaks the grammar: "
                                   f"{grammar.get_error()}")
        finish, stop_reason = None, None
        if num_outputs >= params.min_tokens:
            if not params.ignore_eos and token in eos_token_ids:
                finish = "stop"
            elif token in params.stop_token_ids:
                finish, stop_reason = "stop", token
        if finish is None and (num_outputs >= self.max_tokens
                               or self.seq.num_prompt_tokens + num_outputs >= max_model_len):
            finish = "length"
        if grammar is not None and finish is None and grammar.is_stopped():
            finish = "stop"  # the grammar is complete and allows nothing more
        elif grammar is not None and finish == "length" and not grammar.is_accepting():
            log.info("request %s: max_tokens reached before its grammar could end; the "
                     "output is incomplete", self.seq.request_id)
        return finish, stop_reason, None

    @property
    def masks_tokens(self) -> bool:
        """Whether the host makes its sampling's token mask (a grammar, token filters)."""
        return self.grammar is not None or self.filter is not None

    @property
    def samples_from_host(self) -> bool:
        """Whether its next sample needs its tokens so far on the host: a grammar,
        penalties, or stop tokens banned until min_tokens (of those the host has)."""
        seq = self.seq
        return (self.grammar is not None or seq.params.needs_history
                or seq.num_known_tokens - seq.num_prompt_tokens < seq.params.min_tokens)


def check_params(params: SamplingParams, vocab_size: int, has_tokenizer: bool) -> None:
    """What SamplingParams cannot check alone (ValueError): stop strings and grammars need
    a tokenizer, token ids must be in the vocabulary."""
    if params.stop and not has_tokenizer:
        raise ValueError("stop: stop strings need a tokenizer and this model has none; "
                         "use stop_token_ids")
    if params.structured_outputs is not None and not has_tokenizer:
        raise ValueError("structured_outputs: grammars need a tokenizer and this model "
                         "has none")
    for field, ids in (("stop_token_ids", params.stop_token_ids),
                       ("logit_bias", params.logit_bias)):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise ValueError(f"{field}: token id {outside[0]} is outside the vocabulary "
                             f"[0, {vocab_size})")


def check_priority(priority: int, policy: str) -> None:
    """A request's priority (lower first) means something only under the priority
    scheduling policy; elsewhere anything but 0 is refused, as vLLM does (ValueError)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority: {priority} asks for priority scheduling, and this "
                         f"engine schedules {policy}; start it with scheduling_policy "
                         "'priority' (--scheduling-policy priority) or send priority 0")


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room for one output token within max_model_len (ValueError)."""
    if num_tokens >= max_model_len:
        raise ValueError(f"prompt has {num_tokens} tokens; max_model_len is {max_model_len}, "
                         f"so at most {max_model_len - 1} fit")


def check_prompt(token_ids, vocab_size: int, max_model_len: int) -> list[int]:
    """`token_ids` as a list, checked (ValueError, saying what to fix): not empty, within
    max_model_len with room for an output, every id an int in the vocabulary."""
    ids = list(token_ids)
    if not ids:
        raise ValueError("prompt is empty")
    check_prompt_length(len(ids), max_model_len)
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t!r} is outside the vocabulary "
                             f"[0, {vocab_size})")
    return ids
