"""tiktoken-format tokenizers (Kimi K2's and Moonlight's `tiktoken.model`, which their
remote-code `TikTokenTokenizer` reads) as a Hugging Face `tokenizers.Tokenizer`, so they
load without running a checkpoint's Python.

`tiktoken.model` holds one `base64(token bytes) rank` line per token; the rank is the id
and the merge order. The equivalent byte-level BPE: each token's bytes as GPT-2's
byte-to-unicode characters, the merges recovered from the ranks (a token's two parts are
what BPE over lower ranks leaves of it), whole-word lookups first (`ignore_merges`, as
tiktoken encodes a piece that is itself a token directly), and the pre-tokenizer's split
pattern, which lives in the remote code: Kimi's (`KIMI_PATTERN`, from tokenization_kimi.py)
for a `TikTokenTokenizer`. The special tokens take the ids after the ranks (256 of them,
named by tokenizer_config.json's `added_tokens_decoder`, the rest
`<|reserved_token_{i}|>`), as that tokenizer numbers them. Recovering the merges is
Python over every token: ~5 s for 164k tokens of 19 bytes on average on a 2-core VM
(Kimi's are shorter), once at start.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

TIKTOKEN_MODEL = "tiktoken.model"
NUM_RESERVED_SPECIAL_TOKENS = 256
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def is_tiktoken(directory: Path, config: dict[str, Any]) -> bool:
    """A tiktoken file that a remote-code TikTokenTokenizer (Kimi's) reads."""
    auto = (config.get("auto_map") or {}).get("AutoTokenizer") or []
    classes = [config.get("tokenizer_class"), *(auto if isinstance(auto, list) else [auto])]
    return ((directory / TIKTOKEN_MODEL).is_file()
            and any(str(c).endswith("TikTokenTokenizer") for c in classes if c))


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _parts(ranks: dict[bytes, int], token: bytes) -> list[bytes]:
    """What byte-pair merging of lower ranks than `token`'s leaves of it."""
    limit, parts = ranks[token], [bytes([b]) for b in token]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def tiktoken_tokenizer(directory: Path, config: dict[str, Any]):
    """The `tokenizers.Tokenizer` of `directory`'s tiktoken.model and tokenizer_config."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from jaxserve.loading.tokenizer import gpt2_byte_table

    ranks = read_ranks(directory / TIKTOKEN_MODEL)
    table = gpt2_byte_table()

    def chars(b: bytes) -> str:
        return "".join(table[x] for x in b)

    merges = []
    for token, rank in ranks.items():
        if len(token) > 1:
            parts = _parts(ranks, token)
            if len(parts) != 2:
                raise ValueError(f"{directory / TIKTOKEN_MODEL}: token {token!r} (rank {rank}) "
                                 "is not a merge of two lower-ranked tokens")
            merges.append((rank, chars(parts[0]), chars(parts[1])))
    vocab = {chars(token): rank for token, rank in ranks.items()}
    tok = Tokenizer(models.BPE(vocab, [(a, b) for _, a, b in sorted(merges)],
                               ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    base = len(ranks)
    named = {int(i): t["content"] for i, t in (config.get("added_tokens_decoder") or {}).items()}
    tok.add_special_tokens([
        AddedToken(named.get(base + i, f"<|reserved_token_{i}|>"), special=True,
                   normalized=False) for i in range(NUM_RESERVED_SPECIAL_TOKENS)])
    return tok
