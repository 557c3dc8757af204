"""Beam search as vLLM runs it (its `LLM.beam_search` and `use_beam_search` requests).

Every step, each live beam runs as a one-token request that asks for its 2 x beam_width
most likely next tokens (the beams share their prompt's pages through the prefix cache);
of all the beams' candidates the beam_width best by cumulative log-probability go on, and
a candidate that is an EOS token ends its beam (unless `ignore_eos`). After `max_tokens`
steps (or when no beam is left) the answer is the beam_width best of the ended and the
live beams by cumulative log-probability over length ** length_penalty (the length
counting the prompt, as vLLM's and transformers' scores do; an ending EOS not counted).
With no EOS among the candidates this is transformers' beam search, step for step.

`BeamSearch` is one prompt's search, fed the one-token requests' logprobs by whoever runs
them: `LLM.beam_search` offline, the HTTP server for `use_beam_search`.
"""

from __future__ import annotations

import dataclasses

from jaxserve.outputs import Logprob
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step asks for 2 x beam_width logprobs


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}] (each "
                             f"step asks for 2 x beam_width logprobs, at most "
                             f"{MAX_LOGPROBS}), got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def step_params(self) -> SamplingParams:
        """What each beam's one-token request asks for."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width,
                              temperature=self.temperature, ignore_eos=True,
                              speculative=False)


@dataclasses.dataclass
class BeamSearchSequence:
    """A beam: the prompt's tokens and its own (`tokens`), the cumulative log-probability
    of its own, each step's logprobs, and (once chosen) its text."""

    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" (an EOS), else "length" in the answer
    stop_reason: int | None = None  # the EOS token that ended it
    text: str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


class BeamSearch:
    """One prompt's search: `live` beams to run a step for (`advance` with their
    logprobs) until `done`; then `best()`."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: tuple[int, ...], max_model_len: int | None = None):
        if max_model_len is not None and len(prompt_ids) + params.max_tokens > max_model_len:
            raise ValueError(f"max_tokens: the prompt's {len(prompt_ids)} tokens and "
                             f"max_tokens {params.max_tokens} pass max_model_len "
                             f"{max_model_len}")
        self.prompt_len = len(prompt_ids)
        self.params, self.eos = params, frozenset(eos_token_ids)
        self.live = [BeamSearchSequence(list(prompt_ids))]
        self.ended: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def advance(self, logprobs: list[dict[int, Logprob]]) -> None:
        """A step: each live beam's next-token logprobs (its one-token request's)."""
        if len(logprobs) != len(self.live):
            raise ValueError(f"{len(logprobs)} logprobs for {len(self.live)} live beams")
        candidates = []
        for beam, entries in zip(self.live, logprobs):
            for token, entry in entries.items():
                score = beam.cum_logprob + entry.logprob
                if token in self.eos and not self.params.ignore_eos:
                    self.ended.append(BeamSearchSequence(
                        beam.tokens + [token] if self.params.include_stop_str_in_output
                        else list(beam.tokens), score, beam.logprobs + [entries], "stop",
                        token))
                else:
                    candidates.append((score, token, beam, entries))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep the beams' order
        self.live = [BeamSearchSequence(beam.tokens + [token], score,
                                        beam.logprobs + [entries])
                     for score, token, beam, entries in candidates[:self.params.beam_width]]
        self.steps += 1

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (bool(beam.tokens) and beam.tokens[-1] in self.eos)
        return beam.cum_logprob / (max(length, 1) ** self.params.length_penalty)

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best beams, ended or live, best first (live ones' finish
        reason "length")."""
        for beam in self.live:
            beam.finish_reason = beam.finish_reason or "length"
        beams = sorted(self.ended + self.live, key=self.score, reverse=True)
        return beams[:self.params.beam_width]

    def generated(self, beam: BeamSearchSequence) -> list[int]:
        """A beam's own tokens (without the prompt)."""
        return beam.tokens[self.prompt_len:]


def live_beams(searches: list[BeamSearch]) -> list[tuple[int, BeamSearchSequence]]:
    """(search index, beam) of every live beam of the searches not done: one step's
    one-token requests, in the order `advance_all` takes their logprobs."""
    return [(i, beam) for i, s in enumerate(searches) if not s.done for beam in s.live]


def advance_all(searches: list[BeamSearch], logprobs: list[dict[int, Logprob]]) -> None:
    """A step of every search not done, from its live beams' logprobs (`live_beams`'
    order)."""
    at = 0
    for search in [s for s in searches if not s.done]:
        n = len(search.live)
        search.advance(logprobs[at:at + n])
        at += n
