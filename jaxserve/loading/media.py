"""Images in chat messages: OpenAI's content parts (`{"type": "image_url", "image_url":
{"url": ...}}`; vLLM's `image_pil` and `{"type": "image", "image": ...}`) taken out of the
messages, in order, and left as `{"type": "image"}` parts, which Hugging Face chat
templates render as the model's image placeholder.

Where an image may come from is the caller's policy (`MediaPolicy`): `data:` URLs always;
`http(s)` URLs only from `allowed_domains`, within size and time limits; local files
(`file://` URLs) only under `allowed_local_path`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MAX_IMAGE_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()  # hosts http(s) URLs may name (none: no fetching)
    allowed_local_path: str | None = None  # file:// URLs must lie under it (None: refused)
    max_bytes: int = MAX_IMAGE_BYTES
    timeout: float = 10.0  # seconds to fetch one URL

    def read(self, url: str, what: str) -> bytes:
        """The bytes `url` names, if this policy allows it; ValueError naming `what`."""
        if not isinstance(url, str) or not url:
            raise ValueError(f"{what}: the image URL must be a non-empty string")
        if url.startswith("data:"):
            return _data_url(url, what, self.max_bytes)
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme in ("http", "https"):
            return self._fetch(parsed, url, what)
        if parsed.scheme == "file":
            return self._local(urllib.parse.unquote(parsed.path), what)
        raise ValueError(f"{what}: image URLs must be data:, http(s): or file: URLs, got "
                         f"{url[:40]!r}")

    def allows(self, url: str) -> bool:
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains)

    def _fetch(self, parsed, url: str, what: str) -> bytes:
        if not self.allows(url):
            raise ValueError(f"{what}: fetching images from {parsed.hostname or url[:40]!r} "
                             "is not allowed (the server's --allowed-media-domains)")
        policy = self

        class Redirects(urllib.request.HTTPRedirectHandler):  # only to allowed hosts
            def redirect_request(self, req, fp, code, msg, headers, newurl):
                if not policy.allows(newurl):
                    raise ValueError(f"{what}: the image URL redirects to a host that is not "
                                     "allowed")
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        try:
            with urllib.request.build_opener(Redirects).open(url, timeout=self.timeout) as r:
                data = r.read(self.max_bytes + 1)
        except OSError as e:
            raise ValueError(f"{what}: could not fetch the image: {e}") from None
        if len(data) > self.max_bytes:
            raise ValueError(f"{what}: the image is larger than {self.max_bytes} bytes")
        return data

    def _local(self, path: str, what: str) -> bytes:
        if self.allowed_local_path is None:
            raise ValueError(f"{what}: local image files are not allowed (the server's "
                             "--allowed-local-media-path)")
        root = Path(self.allowed_local_path).resolve()
        file = Path(path).resolve()
        if root != file and root not in file.parents:
            raise ValueError(f"{what}: {path} is outside the allowed local media path")
        if not file.is_file():
            raise ValueError(f"{what}: no file {path}")
        if file.stat().st_size > self.max_bytes:
            raise ValueError(f"{what}: the image is larger than {self.max_bytes} bytes")
        return file.read_bytes()


def _data_url(url: str, what: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError(f"{what}: a data: URL needs a ',' before its payload")
    media_type = header[5:].split(";")[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise ValueError(f"{what}: the data: URL's media type is {media_type!r}, not an image")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise ValueError(f"{what}: the image is larger than {max_bytes} bytes")
    if ";base64" not in header:
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: the data: URL's payload is not valid base64") from None


def take_images(messages: Sequence[Any], policy: MediaPolicy = MediaPolicy()
                ) -> tuple[list, list, list[str]]:
    """(the messages with each image part as `{"type": "image"}`, the images in order:
    image file bytes, or PIL images as given, and where each was: "messages[i].content[j]").
    ValueError naming a bad part."""
    out, images, names = [], [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            what = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(policy.read(url, what))
            elif kind == "image_pil":
                images.append(part.get("image_pil"))
            elif kind == "image" and part.get("image") is not None:
                images.append(part["image"])
            elif kind == "image":  # a template's own part, its image given elsewhere
                raise ValueError(f"{what}: an image part needs its image (image_url)")
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
            names.append(what)
        out.append({**message, "content": parts})
    return out, images, names
