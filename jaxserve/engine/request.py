"""Host-side state of one request while the engine works on it.

A `Sequence` is what the scheduler and the page allocator see: tokens, pages, progress.
A `Request` is that sequence plus what the engine has returned of its output so far
(its text, tokens not yet handed back).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from jaxserve.outputs import Logprob

if TYPE_CHECKING:
    import llguidance

    from jaxserve.engine.output_text import OutputText


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
    page_ids: list[int] = dataclasses.field(default_factory=list)
    data_shard: int = 0  # whose page pool `page_ids` index (data parallelism)
    num_preemptions: int = 0
    finish_reason: str | None = None
    first_scheduled_at: float | None = None  # time.monotonic() when first admitted to run
    # Guessed next tokens for the coming step (speculative decoding; see scheduler.py).
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    # A tree of them: each one's parent (-1: the last token; engine/token_tree.py); None:
    # a chain.
    draft_parents: list[int] | None = None
    # Drafts still on the device (PLACEHOLDERs in draft_token_ids, an EAGLE head's): where
    # each is in the step's `prev_tokens` (BatchBuilder.prev_tokens_size).
    draft_prev_index: list[int] | None = None
    # Leading tokens whose K/V the draft model holds (engine/draft_model.py).
    draft_computed_tokens: int = 0
    # Medusa heads' guesses after the sequence's token number `[0]`: (num_tokens, each
    # head's top tokens).
    medusa_guesses: tuple[int, list[list[int]]] | None = None
    # The most output tokens it may have (max_tokens, or the room left by max_model_len):
    # once its outputs, placeholders of steps in flight included, reach it, nothing is
    # scheduled for it (None: no limit known to the scheduler).
    max_output_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens before the first PLACEHOLDER (those of steps in flight come last)."""
        out, n = self.output_token_ids, len(self.output_token_ids)
        while n and out[n - 1] == PLACEHOLDER:
            n -= 1
        return len(self.prompt_token_ids) + n

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclasses.dataclass(eq=False)
class Request:
    """A sequence and its output as returned so far: `text` streams its text (None when
    the engine does not detokenize); `grammar` matches its output when it has
    structured_outputs; `pending` holds token ids (and their logprobs) sampled but not
    yet handed back."""

    seq: Sequence
    text: OutputText | None
    grammar: llguidance.LLMatcher | None = None
    pending: list[int] = dataclasses.field(default_factory=list)
    pending_logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)

    @property
    def max_tokens(self) -> int:
        """Its output limit: max_tokens, or the room max_model_len leaves."""
        return self.seq.max_output_tokens
