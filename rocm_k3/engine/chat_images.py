"""The images of a chat request: its ``image_url`` / ``image`` message parts, in order, as image data.

A chat's images come from its messages' content parts, in the order the chat renderer reports their positions
(``RenderedChat.image_positions``): OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` (or the url as
a plain string) and ``{"type": "image", "image": <PIL image or bytes>}`` (the Python API). URLs:

- ``data:image/...;base64,<data>`` is decoded here (at most ``max_bytes`` once decoded);
- ``http(s)://`` is fetched only when ``allow_remote`` (the server's ``--allow-remote-images``), with a timeout
  and the same size limit, read in pieces so a large answer is cut off early;
- anything else (``file://``, a bare path) is refused.

Every problem is an :class:`ImageURLError` (a ValueError naming the message and part: the server answers 400).
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from rocm_k3.formats.chat_base import IMAGE_PARTS

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
_CHUNK = 1 << 16


class ImageURLError(ValueError):
    """An image part that cannot be read (bad data URL, refused or failed fetch, too large)."""


def images_from_messages(messages: Sequence[Mapping[str, Any]], *, allow_remote: bool = False,
                         max_bytes: int = DEFAULT_MAX_IMAGE_BYTES, timeout_s: float = 10.0) -> list[Any]:
    """The image data of every image part of ``messages``, in order (bytes, or the PIL image a caller passed)."""
    out: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") not in IMAGE_PARTS:
                continue
            where = f"messages[{i}].content[{j}]"
            if part.get("type") == "image":
                value = part.get("image")
                if value is None:
                    raise ImageURLError(f"{where}: an 'image' part needs an 'image' (a PIL image or bytes)")
                out.append(value)
                continue
            url = part.get("image_url")
            if isinstance(url, Mapping):
                url = url.get("url")
            if not isinstance(url, str) or not url:
                raise ImageURLError(f"{where}.image_url: expected a URL string (or {{'url': ...}})")
            out.append(read_image_url(url, where, allow_remote=allow_remote, max_bytes=max_bytes,
                                      timeout_s=timeout_s))
    return out


def read_image_url(url: str, where: str, *, allow_remote: bool, max_bytes: int, timeout_s: float) -> bytes:
    """The bytes behind one image URL (see the module docstring)."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise ImageURLError(f"{where}: a data URL must be 'data:<mime>;base64,<data>'")
        if len(payload) > 4 * (max_bytes // 3 + 4):
            raise ImageURLError(f"{where}: the image is larger than the limit of {max_bytes} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageURLError(f"{where}: the data URL is not valid base64 ({exc})") from exc
        if len(data) > max_bytes:
            raise ImageURLError(f"{where}: the image has {len(data)} bytes, more than the limit of {max_bytes}")
        return data
    if url.startswith(("http://", "https://")):
        if not allow_remote:
            raise ImageURLError(f"{where}: remote image URLs are refused (start the server with "
                                "--allow-remote-images to fetch them, or send a data: URL)")
        return _fetch(url, where, max_bytes, timeout_s)
    raise ImageURLError(f"{where}: unsupported image URL {url[:40]!r}: expected a data: or http(s) URL")


def _fetch(url: str, where: str, max_bytes: int, timeout_s: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (http(s) only, checked)
            chunks, size = [], 0
            while chunk := response.read(_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise ImageURLError(f"{where}: the image at {url} is larger than the limit of {max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except ImageURLError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ImageURLError(f"{where}: cannot fetch {url} ({exc})") from exc
