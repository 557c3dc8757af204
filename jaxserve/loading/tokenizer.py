"""Tokenizers loaded from a Hugging Face model directory, and streaming detokenization.

Three formats are read: `tokenizer.json` (the Hugging Face `tokenizers` library; preferred,
because its normalizer, pre-tokenizer, decoder and post-processor state exactly how the model
was trained), Kimi K2's `tiktoken.model` (tiktoken_files.py: made a `tokenizers` BPE) and,
failing those, `tokenizer.model` (a sentencepiece model, Llama-1/2 style).
They sit behind a small backend interface, so `Tokenizer` owns the rules they share: which
ids are special, how BOS/EOS are found, the chat template.

`IncrementalDetokenizer` turns a stream of sampled ids into text chunks the way vLLM does:
decode a short window of recent tokens with and without the new one and emit the
difference, holding back while the text ends in an incomplete UTF-8 character.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from jaxserve.loading.chat_template import ChatTemplate, ChatTemplateError

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
MODEL_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"

# Keys naming one special token in tokenizer_config.json / special_tokens_map.json.
_NAMED_SPECIAL_KEYS = (
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
)
# Keys holding several (transformers 4 and 5 spellings; a list, or in 5 also a dict).
_EXTRA_SPECIAL_KEYS = ("additional_special_tokens", "extra_special_tokens")

_REPLACEMENT_CHAR = "\ufffd"


# --------------------------------------------------------------------------------------
# Backends: the file-format-specific part.
# --------------------------------------------------------------------------------------


class _Backend(Protocol):
    """What `Tokenizer` needs from a tokenizer file format.

    `decode` renders every id it is given, special ones as their token text. Skipping
    special tokens happens once, in `Tokenizer.decode`, so that "special" means the same
    set of ids for `all_special_ids`, `decode` and the detokenizer.
    """

    @property
    def vocab_size(self) -> int: ...
    @property
    def special_ids(self) -> set[int]: ...
    @property
    def default_bos_id(self) -> int | None: ...  # what the model file itself says, if anything
    @property
    def default_eos_id(self) -> int | None: ...
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def encode_pair(self, text: str, pair: str) -> list[int]: ...
    def offsets(self, text: str) -> list[tuple[int, int]]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    def token_to_id(self, token: str) -> int | None: ...
    def mark_special(self, tokens: Iterable[str]) -> None: ...
    def tokenizer_json(self) -> str | None: ...
    def token_bytes(self) -> list[bytes]: ...
    def set_bos_eos(self, bos_id: int | None, eos_id: int | None,
                    add_bos: bool | None, add_eos: bool | None) -> None: ...


def gpt2_byte_table() -> dict[int, str]:
    """Byte-level BPE's byte -> printable character table (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class _HFBackend:
    """A `tokenizers.Tokenizer` read from tokenizer.json and used as the file says (or one
    built from another format: tiktoken_files.py)."""

    def __init__(self, source):
        from tokenizers import Tokenizer as HFTokenizer

        if isinstance(source, HFTokenizer):
            self._tok = source
        else:
            try:
                self._tok = HFTokenizer.from_file(str(source))
            except Exception as e:  # the Rust side raises plain Exception subclasses
                raise ValueError(f"could not read {source}: {e}") from e
        # Some tokenizer.json files carry training-time truncation or fixed-length padding;
        # a server must see the whole prompt and nothing added to it.
        self._tok.no_truncation()
        self._tok.no_padding()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> set[int]:
        return {i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}

    # tokenizer.json does not say which token is BOS or EOS; the configs do.
    default_bos_id: int | None = None
    default_eos_id: int | None = None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """The post-processor's pair template (transformers' `tokenizer(text, pair)`)."""
        return self._tok.encode(text, pair, add_special_tokens=True).ids

    def offsets(self, text: str) -> list[tuple[int, int]]:
        return self._tok.encode(text, add_special_tokens=False).offsets

    def decode(self, ids: Sequence[int]) -> str:
        # Ids past the vocabulary (padded embedding rows) are dropped by `tokenizers`.
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def tokenizer_json(self) -> str:
        """tokenizer.json itself (as loaded): grammar engines read it whole."""
        return self._tok.to_str()

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes: <0xNN> is that byte, a token that decodes to whole
        characters is their UTF-8, and a byte-level token that does not (part of a
        character) maps back through GPT-2's byte table."""
        byte_of = {c: b for b, c in gpt2_byte_table().items()}
        out = []
        for i in range(self.vocab_size):
            token = self._tok.id_to_token(i) or ""
            text = self._tok.decode([i], skip_special_tokens=False)
            if match := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token):
                out.append(bytes([int(match.group(1), 16)]))
            elif "\ufffd" in text and token and all(c in byte_of for c in token):
                out.append(bytes(byte_of[c] for c in token))
            else:
                out.append(text.encode())
        return out

    def mark_special(self, tokens: Iterable[str]) -> None:
        """Flags named special tokens (from tokenizer_config.json) that the file did not.

        transformers does the same on load, so text containing them is split on them and
        decoding can skip them. Tokens absent from the vocabulary are not added: the model
        has no embedding for them.
        """
        from tokenizers import AddedToken

        flagged = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        missing = [t for t in tokens if t not in flagged and self.token_to_id(t) is not None]
        if missing:
            added = [AddedToken(t, special=True, normalized=False) for t in missing]
            self._tok.add_special_tokens(added)

    def set_bos_eos(self, bos_id: int | None, eos_id: int | None,
                    add_bos: bool | None, add_eos: bool | None) -> None:
        """Nothing to do: tokenizer.json's post-processor decides what encode adds.

        transformers 5 likewise drops add_bos_token / add_eos_token from
        tokenizer_config.json whenever a tokenizer.json is present.
        """


class _SentencePieceBackend:
    """A sentencepiece model (tokenizer.model), with the Hugging Face conventions on top.

    sentencepiece itself never parses special tokens out of text and always drops control
    tokens when decoding. Chat templates put "<s>" etc. into the text, so, like
    transformers, we split the text on special tokens first and render them when asked.
    """

    def __init__(self, path: Path, legacy: bool):
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:
            raise ValueError(f"could not read sentencepiece model {path}: {e}") from e
        self._size = self._sp.get_piece_size()
        self._special = {
            i for i in range(self._size) if self._sp.is_control(i) or self._sp.is_unknown(i)
        }
        # transformers' `legacy=True` prepends the dummy "▁" to text after a special token too.
        self._legacy = legacy
        self._unk_id = self._sp.unk_id()
        self._unk_piece_ids = self._sp.encode(self._sp.id_to_piece(self._unk_id))
        self._unk_text = self._sp.decode([self._unk_id])
        self._bos_id: int | None = None
        self._eos_id: int | None = None
        self._add_bos = True
        self._add_eos = False
        self._split_re = self._special_split_regex()

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def special_ids(self) -> set[int]:
        return set(self._special)

    @property
    def default_bos_id(self) -> int | None:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def default_eos_id(self) -> int | None:
        return self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def token_to_id(self, token: str) -> int | None:
        token_id = self._sp.piece_to_id(token)  # answers unk_id for unknown pieces
        return token_id if self._sp.id_to_piece(token_id) == token else None

    def id_to_token(self, token_id: int) -> str | None:
        return self._sp.id_to_piece(token_id) if 0 <= token_id < self._size else None

    def tokenizer_json(self) -> None:
        return None

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes: "▁" is a space, <0xNN> pieces are that byte, control and
        unknown pieces stand for nothing."""
        out = []
        for i in range(self._size):
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                out.append(bytes([int(piece[3:5], 16)]))
            elif self._sp.is_control(i) or self._sp.is_unknown(i):
                out.append(b"")
            else:
                out.append(piece.replace("\u2581", " ").encode())
        return out

    def mark_special(self, tokens: Iterable[str]) -> None:
        ids = {self.token_to_id(t) for t in tokens} - {None}
        if not ids <= self._special:
            self._special |= ids
            self._split_re = self._special_split_regex()

    def set_bos_eos(self, bos_id: int | None, eos_id: int | None,
                    add_bos: bool | None, add_eos: bool | None) -> None:
        """Llama-style defaults: BOS is added unless the config says not to; EOS only if asked."""
        self._bos_id, self._eos_id = bos_id, eos_id
        self._add_bos = True if add_bos is None else add_bos
        self._add_eos = bool(add_eos)

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Each encoded with its specials, one after the other (LlamaTokenizer's pairs)."""
        return self.encode(text, True) + self.encode(pair, True)

    def offsets(self, text: str) -> list[tuple[int, int]]:
        raise ValueError("cutting text by tokens needs the model's tokenizer.json (this one "
                         "is a sentencepiece model)")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        # With a capturing group, even parts are text and odd parts are special tokens.
        parts = self._split_re.split(text) if self._split_re else [text]
        for index, part in enumerate(parts):
            if index % 2:
                ids.append(self._sp.piece_to_id(part))
            elif part:
                if index == 0 or self._legacy:
                    ids.extend(self._sp.encode(part))
                else:
                    ids.extend(self._encode_continuation(part))
        if add_special_tokens and self._add_bos and self._bos_id is not None:
            ids.insert(0, self._bos_id)
        if add_special_tokens and self._add_eos and self._eos_id is not None:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if not 0 <= token_id < self._size:
                continue  # ids past the vocabulary (padded embeddings) have no text
            if token_id in self._special:
                self._flush_run(run, parts)
                parts.append(self._sp.id_to_piece(token_id))
            else:
                run.append(token_id)
        self._flush_run(run, parts)
        return "".join(parts)

    def _flush_run(self, run: list[int], parts: list[str]) -> None:
        """Decodes a run of ordinary pieces; only the text's very start drops its dummy space.

        sentencepiece strips the leading "▁" of whatever it decodes; after a special token
        that space is real text (transformers renders "<s> hello"), so decode it behind an
        <unk> and cut the <unk>'s surface off.
        """
        if not run:
            return
        if parts:
            parts.append(self._sp.decode([self._unk_id, *run])[len(self._unk_text):])
        else:
            parts.append(self._sp.decode(run))
        run.clear()

    def _encode_continuation(self, text: str) -> list[int]:
        """Encodes text that follows a special token, without sentencepiece's dummy "▁".

        The transformers (non-legacy) trick: encode "<unk>" + text and drop the pieces of
        "<unk>". Falls back to a plain encode if a piece straddles the seam.
        """
        ids = self._sp.encode(self._sp.id_to_piece(self._unk_id) + text)
        head = self._unk_piece_ids
        return ids[len(head):] if ids[: len(head)] == head else self._sp.encode(text)

    def _special_split_regex(self) -> re.Pattern[str] | None:
        tokens = sorted({self._sp.id_to_piece(i) for i in self._special}, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, tokens)) + ")") if tokens else None


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one model, plus the special ids and chat template it declares.

    Build it with `Tokenizer.from_pretrained(model_dir)`.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        # Every id that ends generation: the tokenizer's EOS and generation_config.json's list
        # (Llama 3 instruct stops on <|eot_id|> and <|end_of_text|>).
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys([*([eos_token_id] if eos_token_id is not None else []), *eos_token_ids])
        )
        self.chat_template = chat_template
        # {"bos_token": "<s>", ...}: the named special tokens a chat template may print.
        self.special_tokens = dict(special_tokens or {})
        named = {i for i in (bos_token_id, eos_token_id) if i is not None}
        self._special_ids = frozenset(backend.special_ids | named)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """Loads the tokenizer of a Hugging Face model directory.

        Prefers tokenizer.json over tokenizer.model. BOS/EOS come from tokenizer_config.json,
        then special_tokens_map.json, then the sentencepiece model, then
        generation_config.json / config.json.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise ValueError(
                f"tokenizer directory {str(directory)!r} does not exist or is not a directory"
            )
        config = _read_json(directory / TOKENIZER_CONFIG)
        token_sources = (config, _read_json(directory / SPECIAL_TOKENS_MAP))
        model_configs = _model_configs(directory)

        backend = _load_backend(directory, config)
        backend.mark_special(_named_special_tokens(token_sources))
        bos_id = _resolve_token_id("bos", backend, token_sources, model_configs)
        eos_id = _resolve_token_id("eos", backend, token_sources, model_configs)
        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
        backend.set_bos_eos(bos_id, eos_id, add_bos, add_eos)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            eos_token_ids=[i for c in model_configs for i in _config_ids(c, "eos_token_id")],
            chat_template=_read_chat_template(directory, config),
            special_tokens=_special_token_strings(token_sources),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._backend.vocab_size

    @property
    def all_special_ids(self) -> set[int]:
        """The ids that `decode(..., skip_special_tokens=True)` drops."""
        return set(self._special_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens)

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """A text pair (a query and a document for a cross-encoder), special tokens as
        the tokenizer places them around pairs."""
        return self._backend.encode_pair(text, pair)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_offsets(self, text: str) -> list[tuple[int, int]]:
        """Each of `text`'s tokens' (start, end) characters (no special tokens added)."""
        return self._backend.offsets(text)

    def tokenizer_json(self) -> str | None:
        """tokenizer.json's text (None for a sentencepiece model), for grammar engines."""
        return self._backend.tokenizer_json()

    def token_bytes(self) -> list[bytes]:
        """The bytes each token id stands for (special tokens: their text)."""
        return self._backend.token_bytes()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and not self._special_ids.isdisjoint(ids):  # a C loop
            ids = [i for i in ids if i not in self._special_ids]
        return self._backend.decode(ids)

    def get_chat_template(self, chat_template: str | None = None) -> ChatTemplate:
        """The model's chat template, or `chat_template` (a Jinja string) in its place."""
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ChatTemplateError(
                "this model has no chat template (no chat_template.jinja, and none in "
                "tokenizer_config.json or chat_template.json): pass one as chat_template, or "
                "send a plain prompt")
        return ChatTemplate(source, self.special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *,
                            chat_template: str | None = None, tokenize: bool = True,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool = False,
                            tools: Sequence[dict[str, Any]] | None = None,
                            **template_kwargs) -> list[int] | str:
        """A conversation as prompt token ids (or text with `tokenize=False`), rendered and
        tokenized as transformers' `apply_chat_template` does; ChatTemplateError (a
        ValueError) when it cannot be."""
        text = self.get_chat_template(chat_template).render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> list[str]:
        ids = [ids] if isinstance(ids, int) else list(ids)
        tokens = [self._backend.id_to_token(i) for i in ids]
        unknown = [i for i, t in zip(ids, tokens) if t is None]
        if unknown:
            raise ValueError(
                f"token ids {unknown[:10]} are outside the vocabulary (size {self.vocab_size})"
            )
        return tokens  # type: ignore[return-value]


def _load_backend(directory: Path, config: dict[str, Any]) -> _Backend:
    """tokenizer.json if present: it states the whole pipeline; else a tiktoken file (Kimi's,
    tiktoken_files.py); else the sentencepiece model."""
    from jaxserve.loading import tiktoken_files

    if (directory / TOKENIZER_JSON).is_file():
        return _HFBackend(directory / TOKENIZER_JSON)
    if tiktoken_files.is_tiktoken(directory, config):
        return _HFBackend(tiktoken_files.tiktoken_tokenizer(directory, config))
    if (directory / SENTENCEPIECE_MODEL).is_file():
        legacy = bool(config.get("legacy", False))
        return _SentencePieceBackend(directory / SENTENCEPIECE_MODEL, legacy=legacy)
    present = sorted(p.name for p in directory.iterdir())
    raise ValueError(
        f"no tokenizer in {str(directory)!r}: expected {TOKENIZER_JSON} (Hugging Face tokenizers) "
        f"or {SENTENCEPIECE_MODEL} (sentencepiece); found {present[:20] or 'an empty directory'}"
    )


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file is absent (all of these are optional)."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {path}: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} should hold a JSON object, not {type(value).__name__}")
    return value


def _model_configs(directory: Path) -> list[dict[str, Any]]:
    """generation_config.json, config.json and a nested text_config, most specific first."""
    model_config = _read_json(directory / MODEL_CONFIG)
    text_config = model_config.get("text_config")
    configs = [_read_json(directory / GENERATION_CONFIG), model_config]
    return configs + ([text_config] if isinstance(text_config, dict) else [])


def _token_content(value: Any) -> str | None:
    """A special token as configs write it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_special_tokens(sources: Sequence[dict[str, Any]]) -> list[str]:
    """Every token the configs call special: the ones transformers skips when decoding."""
    tokens: list[str | None] = []
    for source in sources:
        tokens += [_token_content(source.get(key)) for key in _NAMED_SPECIAL_KEYS]
        for key in _EXTRA_SPECIAL_KEYS:
            extra = source.get(key) or []
            extra = extra.values() if isinstance(extra, dict) else extra
            tokens += [_token_content(v) for v in extra]
        decoder = source.get("added_tokens_decoder") or {}
        tokens += [
            _token_content(v) for v in decoder.values() if isinstance(v, dict) and v.get("special")
        ]
    return [t for t in dict.fromkeys(tokens) if t is not None]


def _special_token_strings(sources: Sequence[dict[str, Any]]) -> dict[str, str]:
    """{"bos_token": "<s>", ...}: each named special token from the first file naming it."""
    found: dict[str, str] = {}
    for source in sources:
        for key in _NAMED_SPECIAL_KEYS:
            content = _token_content(source.get(key))
            if content is not None:
                found.setdefault(key, content)
    return found


def _resolve_token_id(
    name: str,
    backend: _Backend,
    token_sources: Sequence[dict[str, Any]],
    model_configs: Sequence[dict[str, Any]],
) -> int | None:
    """The id of the `name` ("bos"/"eos") token: the tokenizer's files first, model configs last."""
    for source in token_sources:
        content = _token_content(source.get(f"{name}_token"))
        if content is not None and (token_id := backend.token_to_id(content)) is not None:
            return token_id
    default = backend.default_bos_id if name == "bos" else backend.default_eos_id
    if default is not None:
        return default
    for model_config in model_configs:
        if ids := _config_ids(model_config, f"{name}_token_id"):
            return ids[0]
    return None


def _config_ids(model_config: dict[str, Any], key: str) -> list[int]:
    """An id or list of ids from a model config (generation_config's eos may be a list)."""
    value = model_config.get(key)
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _read_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja wins (transformers 5 saves it there), then the configs.

    A list of named templates (older format) yields the one named "default".
    """
    jinja = directory / CHAT_TEMPLATE_JINJA
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _read_json(directory / CHAT_TEMPLATE_JSON).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# --------------------------------------------------------------------------------------
# Incremental detokenization
# --------------------------------------------------------------------------------------

# Prompt tokens kept in front of the first output token, so that it decodes in context
# (sentencepiece-style decoders drop the leading space of whatever starts a decode).
_PREFIX_WINDOW = 5
# A UTF-8 character has at most 4 bytes, so it spans at most 4 tokens.
_MAX_CHAR_TOKENS = 4
# How far back to look for prompt text when the prompt ends in skipped special tokens.
_MAX_PREFIX_LOOKBACK = 64


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one token at a time.

    Keeps two offsets into the token list (vLLM's scheme): tokens[prefix_offset:read_offset]
    were emitted already and are decoded again only as context; tokens[read_offset:] are
    pending. Each `add` decodes the window with and without the pending tokens and emits the
    difference, unless the text ends in U+FFFD (a character whose remaining bytes are still
    to come). The cost per token is O(window), not O(length).

    The text is what decode(prompt + output) adds to decode(prompt). When the prompt ends
    inside a character, that character is output: it is emitted whole by the token that
    completes it, after the text of the prompt's complete characters.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._tokens = list(prompt_token_ids)
        self._read_offset = len(self._tokens)
        # `_boundary` is where complete text ends; the next window starts there, so a window
        # never starts inside a character.
        self._prefix_offset, self._boundary = self._initial_window()
        self._text = ""

    @property
    def text(self) -> str:
        """All output text so far: the concatenation of what `add` returned."""
        return self._text

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text it made final ("" if none yet)."""
        return self.extend((token_id,))

    def extend(self, token_ids: Sequence[int], one_by_one: bool = True) -> str:
        """Appends generated tokens; returns the text they made final ("" if none yet).
        Several at once cost two decodes, as one does, unless they end inside a character:
        then (`one_by_one`) they go one by one, so that the text before that character is
        not held back with it."""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._tokens))
        start = _common_prefix_length(prefix_text, full_text)
        if self._boundary < self._read_offset:
            # The prompt ends inside a character: what the prompt's complete characters
            # decode to is not output, even where its decode above came out as U+FFFDs.
            complete = self._decode(self._prefix_offset, self._boundary)
            if full_text.startswith(complete):
                start = max(start, len(complete))
        if start == len(full_text) or full_text.endswith(_REPLACEMENT_CHAR):
            # Nothing new (e.g. a skipped special token), or a character still incomplete:
            # keep the window, so the next token is decoded in the same context.
            if one_by_one and len(token_ids) > 1 and start < len(full_text):
                del self._tokens[len(self._tokens) - len(token_ids):]
                return "".join([self.extend((token,)) for token in token_ids])
            return ""
        new_text = full_text[start:]
        self._prefix_offset = self._boundary
        self._read_offset = self._boundary = len(self._tokens)
        self._text += new_text
        return new_text

    def finish(self, token_ids: Sequence[int]) -> str:
        """The last tokens: `extend` then `flush`, in two decodes (or four)."""
        return self.extend(token_ids, one_by_one=False) + self.flush()

    def checkpoint(self) -> tuple[int, int, int, int, int]:
        """The state, for `rewind`."""
        return (len(self._tokens), self._prefix_offset, self._read_offset, self._boundary,
                len(self._text))

    def rewind(self, mark: tuple[int, int, int, int, int]) -> None:
        """Back to the state `checkpoint` returned: the tokens added since forgotten."""
        n, self._prefix_offset, self._read_offset, self._boundary, chars = mark
        del self._tokens[n:]
        self._text = self._text[:chars]

    def flush(self) -> str:
        """At the end of generation: the held-back bytes of an unfinished character, as U+FFFD.

        After this, `text` equals the full decode of the output (as far as the prompt
        boundary allows), like a non-streaming decode would give.
        """
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._tokens))
        new_text = full_text[_common_prefix_length(prefix_text, full_text):]
        self._prefix_offset = self._read_offset = self._boundary = len(self._tokens)
        self._text += new_text
        return new_text

    def _decode(self, start: int, stop: int) -> str:
        ids = self._tokens[start:stop]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _initial_window(self) -> tuple[int, int]:
        """The prompt tokens that give the first output token its context: (start, end).

        Both ends must sit between characters. A window starting inside a character decodes
        its stray bytes as U+FFFD, and tokenizers' ByteFallback decoder then spoils the whole
        run of byte tokens after them. A prompt ending inside a character (its end decodes
        as U+FFFD) has the window end before that character, so the output that completes it
        emits all of it. A UTF-8 character has at most 4 bytes, which bounds both searches.
        """
        n = len(self._tokens)
        for end in range(n, max(n - _MAX_CHAR_TOKENS + 1, 0) - 1, -1):
            first_start = max(end - _PREFIX_WINDOW, 0)
            for start in range(first_start, max(first_start - _MAX_CHAR_TOKENS, -1), -1):
                text = self._decode(start, end)
                clean_start = start == 0 or not text.startswith(_REPLACEMENT_CHAR)
                if clean_start and not text.endswith(_REPLACEMENT_CHAR):
                    return self._reach_back_to_text(start, end), end
        return max(n - _PREFIX_WINDOW, 0), n  # invalid bytes, not a split character

    def _reach_back_to_text(self, start: int, end: int) -> int:
        """Moves `start` back until the window holds some text (past skipped special tokens).

        Were the context only skipped special tokens, the first output token would decode
        as the start of a text, and sentencepiece-style decoders would drop its leading space.
        """
        while start > 0 and end - start < _MAX_PREFIX_LOOKBACK:
            text = self._decode(start, end)
            if text and not text.startswith(_REPLACEMENT_CHAR):
                break
            start -= 1
        return start


def _common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix: all of `a` but while the prompt ends badly."""
    if b.startswith(a):
        return len(a)
    return len(os.path.commonprefix([a, b]))
