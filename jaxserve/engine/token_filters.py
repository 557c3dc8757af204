"""vLLM's per-request token filters: `allowed_token_ids` (only these may be sampled) and
`bad_words` (words the output may not write).

Both are enforced through the grammar's packed mask (structured_output.py: bit t of a row
set = token t allowed), filled on the host before the step samples (a request with a
filter is sampled apart, as a constrained one). A bad word is tokenized as vLLM does:
alone and after a space (the same word at the start and in the middle of a text), each
form's token ids a sequence whose last token is banned wherever the output so far ends
with the ones before it (a one-token word: everywhere).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class TokenFilter:
    """A request's filters as masks: `static` its packed row (the allowed tokens less the
    one-token bad words; None: everything), `sequences` the bad words of more than one
    token (their ids)."""

    static: np.ndarray | None
    sequences: list[list[int]]

    def restrict(self, row: np.ndarray, output: list[int]) -> None:
        """Clear, in `row` (a packed mask row, in place), the bits of the tokens it may
        not sample after `output` (its tokens so far)."""
        if self.static is not None:
            row &= self.static
        for ids in self.sequences:
            prefix = ids[:-1]
            if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
                clear(row, ids[-1])


def bad_word_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token id sequences (vLLM's rule: the word with leading spaces
    stripped, and after one space where that gives other tokens of the same count);
    ValueError for a word that is no tokens."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad_words: {word!r} is no tokens")
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def token_filter(params: SamplingParams, tokenizer: Tokenizer | None,
                 vocab_size: int) -> TokenFilter | None:
    """The filters `params` ask for (None: none); ValueError for a bad word without a
    tokenizer or an allowed id outside the vocabulary."""
    if params.allowed_token_ids is None and not params.bad_words:
        return None
    width = (int(vocab_size) + 31) // 32  # int32 words of a packed mask row
    static = None
    if params.allowed_token_ids is not None:
        outside = [t for t in params.allowed_token_ids if t >= vocab_size]
        if outside:
            raise ValueError(f"allowed_token_ids: token id {outside[0]} is outside the "
                             f"vocabulary [0, {vocab_size})")
        static = pack(params.allowed_token_ids, width)
    sequences = []
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words: need a tokenizer and this model has none")
        for ids in bad_word_ids(tokenizer, params.bad_words):
            if len(ids) == 1:
                static = np.full(width, -1, np.int32) if static is None else static
                clear(static, ids[0])
            else:
                sequences.append(ids)
    if static is not None and not static.any():
        raise ValueError("bad_words: they ban every token of allowed_token_ids")
    return TokenFilter(static, sequences)


def pack(token_ids, width: int) -> np.ndarray:
    """A packed mask row `[width]` int32 allowing exactly `token_ids`."""
    bits = np.zeros(width * 32, np.uint8)
    bits[np.fromiter(token_ids, np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32).copy()


def clear(row: np.ndarray, token: int) -> None:
    """Clear token `token`'s bit in a packed mask row (in place)."""
    row.view(np.uint32)[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
