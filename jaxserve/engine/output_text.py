"""The text of one request's output: detokenized an output (one or more tokens) at a time,
checked for stop strings.

The engine only decides what ends a request at the token level (EOS, stop token ids,
length). Turning tokens into text is host work with no part in the next step, so it can
run anywhere: `Engine` runs it inline for the offline `LLM`, and the servers run it on
their event loop (server/async_engine.py), out of the engine's process. Both call
`OutputText.apply` on each output, so text and stop strings come out the same either way.
A caller that wants only the whole text (the offline `LLM`) has a request without stop
strings (or logprobs) decoded once, when it ends (`stream` False).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxserve.outputs import Logprob, StepOutput
from jaxserve.sampling_params import SamplingParams


class OutputText:
    """Streams a request's text; `add` says when a stop string ends it.

    Text that could be the start of a stop string is held back until it cannot be, so no
    text is ever retracted. `text` is everything decoded so far (cut at the stop string
    once one matched); `emitted` characters of it have been handed back.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 params: SamplingParams, eos_token_ids: Sequence[int], stream: bool = True):
        self._tokenizer = tokenizer
        self._params = params
        # Not streamed, and nothing to look for in the text (no stop string, no logprobs to
        # name): decoded once, when the request ends (`apply_whole`).
        self.deferred = not stream and not params.stop and params.logprobs is None
        self._eos = frozenset(eos_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                             params.skip_special_tokens)
        # Text held back while it could still be a stop string's start (none when a stop
        # string stays in the output: include_stop_str_in_output).
        self._hold = (0 if params.include_stop_str_in_output
                      else max(map(len, params.stop), default=1) - 1)
        self.text = ""
        self.emitted = 0
        self.num_tokens = 0

    def apply(self, out: StepOutput) -> bool:
        """Give `out`, one engine output of this request, its text (in place). A stop
        string found in it ends the request there: the tokens (and logprobs) after the one
        that completed it are dropped, and it is finished with that stop string. Returns
        whether one did (the caller tells the engine to stop the request, if the engine has
        not ended it)."""
        if not out.new_token_ids:
            return False
        out.new_text, stop, used = self.add(out.new_token_ids,
                                            out.finish_reason if out.finished else None,
                                            out.stop_reason)
        if stop is not None:
            del out.new_token_ids[used:]
            if out.new_logprobs is not None:
                del out.new_logprobs[used:]
            out.finished, out.finish_reason, out.stop_reason, out.error = True, "stop", stop, None
        if out.new_logprobs:
            self.decode_logprobs(out.new_logprobs)
        return stop is not None

    def skip(self, token_ids: Sequence[int]) -> None:
        """Tokens of the output whose text was handed back elsewhere (the first token of a
        request prefilled on another engine, whose text was made as an unfinished
        request's: `apply_unfinished`): decoded, so that the text after them comes out
        right, and not handed back again."""
        self.add(token_ids, None)

    def apply_unfinished(self, out: StepOutput) -> bool:
        """`apply` for a request that goes on elsewhere (a prefill engine's, handed to a
        decode engine): its text as if it had not finished, so that text held back (the
        start of a UTF-8 character or of a stop string) is the decode side's to emit.
        Returns whether a stop string ended it after all."""
        finished = out.finished
        out.finished = False
        stopped = self.apply(out)
        out.finished = finished or stopped
        return stopped

    def apply_whole(self, out: StepOutput, token_ids: Sequence[int]) -> None:
        """A deferred request's end: `out`, its last output, gets the text of its whole
        output `token_ids` (in place), decoded at once: two decodes for the request
        instead of two per token. As `add`, a last token that ended it as EOS or a stop
        token id adds no text."""
        stop_token = self._ends_in_stop_token(token_ids, out.finish_reason, out.stop_reason)
        self.num_tokens = len(token_ids)
        self.text = self._detok.finish(token_ids[:-1] if stop_token else token_ids)
        self.emitted = len(self.text)
        out.new_text = self.text

    def add(self, token_ids: Sequence[int], finish_reason: str | None,
            stop_reason: str | int | None = None) -> tuple[str, str | None, int]:
        """Append one output's tokens; `finish_reason` and `stop_reason` are the engine's
        if they end the request. Returns the text to hand back now, the stop string that
        ends the request with them (None if none) and how many of the tokens it took (up
        to the one that completed the stop string). A last token that ended it as EOS or
        a stop token id adds no text (vLLM's rule, so special-token text kept with
        skip_special_tokens=False does not end in EOS) and is not matched against the
        stop strings, unless include_stop_str_in_output."""
        stop_token = self._ends_in_stop_token(token_ids, finish_reason, stop_reason)
        texts = token_ids[:-1] if stop_token else token_ids  # the tokens that add text
        # Decoded together (two decodes, not two per token). The text only grows, so a stop
        # string that one of the tokens completes is in the group's text: then the tokens go
        # again one by one, to find the one that completes it.
        mark = self._detok.checkpoint() if self._params.stop else None
        text = self.text + self._detok.extend(texts) if texts else self.text
        stop, used = None, len(token_ids)
        if (texts and self.num_tokens + len(texts) >= self._params.min_tokens
                and _first_stop(self._params.stop, text, len(self.text)) is not None):
            self._detok.rewind(mark)
            for i, token in enumerate(texts):
                self.num_tokens += 1
                since = len(self.text)
                self.text += self._detok.add(token)
                stop = self._find_stop(since)
                if stop is not None:
                    used = i + 1
                    break
            else:
                self.num_tokens += len(token_ids) - len(texts)
        else:
            self.text = text
            self.num_tokens += len(token_ids)
        if stop is None and finish_reason is not None:
            self.text += self._detok.flush()
        ended = stop is not None or finish_reason is not None
        upto = len(self.text) if ended else len(self.text) - self._hold
        new_text = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return new_text, stop, used

    def _ends_in_stop_token(self, token_ids: Sequence[int], finish_reason: str | None,
                            stop_reason: str | int | None) -> bool:
        """Whether the last of `token_ids` ended the request as EOS or a stop token id
        and its text is left out (not include_stop_str_in_output)."""
        if self._params.include_stop_str_in_output:
            return False
        return finish_reason == "stop" and bool(token_ids) and (
            token_ids[-1] == stop_reason or token_ids[-1] in self._eos)

    def _find_stop(self, since: int) -> str | None:
        """The first stop string that ends in the text after its first `since` characters
        (the text of the token just added), once min_tokens are out; the text cut there
        (after it with include_stop_str_in_output)."""
        if self.num_tokens < self._params.min_tokens:
            return None
        found = _first_stop(self._params.stop, self.text, since)
        if found is None:
            return None
        stop, idx = found
        self.text = self.text[:idx + len(stop) * self._params.include_stop_str_in_output]
        return stop

    def decode_logprobs(self, logprobs: list[dict[int, Logprob]]) -> None:
        """Fill in each candidate's `decoded_token`."""
        for top in logprobs:
            for token, lp in top.items():
                lp.decoded_token = self._tokenizer.decode([token], skip_special_tokens=False)


def _first_stop(stops: Sequence[str], text: str, since: int) -> tuple[str, int] | None:
    """The first of `stops` (in their order) that ends in `text` after its first `since`
    characters, and where it starts; None if none does."""
    for stop in stops:
        idx = text.find(stop, max(0, since - len(stop) + 1))
        if idx >= 0:
            return stop, idx
    return None
