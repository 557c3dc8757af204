"""Chat templates: a checkpoint's Jinja template rendered as transformers' `apply_chat_template`.

The environment is the one transformers builds (the template is untrusted code from a model
repository): an immutable sandbox with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, a `{% generation %}` block tag (rendered as its body), `raise_exception`,
`strftime_now`, a `tojson` filter that keeps non-ASCII text and takes indent / separators /
sort_keys, and guarded `dict` and `namespace` globals. Rendering follows it too: keys whose
value is None are dropped from messages, the template sees `messages`, `tools`, `documents`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...) and
any extra keyword arguments, and `continue_final_message` cuts the text right after the last
message's content so the model continues it. The rendered text is tokenized without adding
special tokens (the template writes them).

Message content may be a string or a list of parts (`{"type": "text", "text": ...}`, as
OpenAI's API sends). A template that loops over a message's content gets the list; any other
gets the text parts joined with newlines (vLLM's rule), so string-only templates serve
clients that send parts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: no template, a template error, or a message the
    template rejects (its `raise_exception`)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    serving renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
            lineno)

    def _render(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` without underscore attributes (no reach into Python internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)`, nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> tuple[jinja2.Template, bool]:
    """(the compiled template, whether it loops over a message's content)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_Dict(), namespace=_Namespace)
    try:
        template = env.from_string(source)
        loops_over_content = any(
            _names_content(node.iter) for node in env.parse(source).find_all(jinja2.nodes.For))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e} (line {e.lineno})") from e
    return template, loops_over_content


def _names_content(node: jinja2.nodes.Node) -> bool:
    """Whether an expression is `x.content` or `x['content']` (possibly filtered)."""
    if isinstance(node, jinja2.nodes.Filter):
        return _names_content(node.node)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False


def _plain(value: Any) -> Any:
    """Only JSON-like data reaches the sandbox (dataclasses and pydantic models as dicts)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    for base in (str, int, float):  # subclasses (enums, numpy scalars) as their base type
        if isinstance(value, base):
            return getattr(base, f"__{base.__name__}__")(value)
    raise ChatTemplateError(f"chat messages hold JSON-like data only, got {type(value).__name__}")


def _text_of(parts: list) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type", "text") != "text" or not isinstance(
                part.get("text"), str):
            raise ChatTemplateError(
                f"content parts must be {{'type': 'text', 'text': str}} for this model, got "
                f"{part!r}")
        texts.append(part["text"])
    return "\n".join(texts)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    source: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _compile(self.source)  # a template that does not parse fails here, at load

    @property
    def takes_content_parts(self) -> bool:
        """Whether the template loops over a message's content (takes a list of parts)."""
        return _compile(self.source)[1]

    def render(self, messages: Sequence[Message], *, tools: Sequence[Mapping] | None = None,
               documents: Sequence[Mapping] | None = None, add_generation_prompt: bool = False,
               continue_final_message: bool = False, **kwargs) -> str:
        """The conversation as the prompt text the model was trained on."""
        if not messages:
            raise ChatTemplateError("messages: a conversation needs at least one message")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt are exclusive: continue the "
                "last message, or start a new assistant turn")
        chat = [self._message(i, m) for i, m in enumerate(messages)]
        tag_fields = ()
        if continue_final_message:
            final = chat[-1].get("content")
            if isinstance(final, list):
                text_parts = [p for p in final if isinstance(p, dict) and "text" in p]
                if not text_parts:
                    raise ChatTemplateError("continue_final_message: the last message has no text")
                final = text_parts[-1]["text"]
                text_parts[-1]["text"] = final + _CONTINUE_TAG
            elif isinstance(final, str):
                chat[-1]["content"] = final + _CONTINUE_TAG
            else:
                raise ChatTemplateError("continue_final_message: the last message has no content")
            tag_fields = (final,)
        template, _ = _compile(self.source)
        variables = {**self.special_tokens, **_plain(kwargs)}
        try:
            text = template.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from e
        if tag_fields:
            (final,) = tag_fields
            if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise ChatTemplateError(
                    "continue_final_message: the chat template drops part of the last message, "
                    "so it cannot be continued")
            at = text.rindex(_CONTINUE_TAG.strip())
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG \
                else text[:at].rstrip()
        return text

    def _message(self, index: int, message: Any) -> dict:
        message = _plain(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{index}] must be an object, got {message!r}")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{index}].role must be a string")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list) and not self.takes_content_parts:
            message["content"] = _text_of(content)
        elif content is not None and not isinstance(content, (str, list)):
            raise ChatTemplateError(
                f"messages[{index}].content must be a string or a list of parts")
        return message
