"""The images of a chat request: its ``image_url`` / ``image`` message parts, in order, as image data.

A chat's images come from its messages' content parts, in the order the chat renderer reports their positions
(``RenderedChat.image_positions``): OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` (or the url as
a plain string) and ``{"type": "image", "image": <PIL image or bytes>}`` (the Python API). URLs:

- ``data:image/...;base64,<data>`` is decoded here (at most ``max_bytes`` once decoded);
- ``http(s)://`` is taken from ``remote`` (url -> bytes), which the server fills before rendering by fetching
  :func:`remote_image_urls` in its fetch pool (``--allow-remote-images``, see entrypoints/image_fetch.py);
  ``remote=None`` (the default, and the Python API's) refuses them;
- anything else (``file://``, a bare path) is refused.

Every problem is an :class:`ImageURLError` (a ValueError naming the message and part: the server answers 400).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rocm_k3.formats.chat_base import IMAGE_PARTS

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
REMOTE_SCHEMES = ("http://", "https://")


class ImageURLError(ValueError):
    """An image part that cannot be read (bad data URL, refused or failed fetch, too large)."""


def _image_parts(messages: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(where, part) of every image part of ``messages``, in order."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS:
                yield f"messages[{i}].content[{j}]", part


def _part_url(part: Mapping[str, Any]) -> Any:
    """The URL of an ``image_url`` part (``{"url": ...}`` or a plain string), unchecked."""
    url = part.get("image_url")
    return url.get("url") if isinstance(url, Mapping) else url


def remote_image_urls(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(where, url) of every ``http(s)`` image URL of ``messages``, in order (what the server fetches)."""
    found = []
    for where, part in _image_parts(messages):
        url = _part_url(part) if part.get("type") != "image" else None
        if isinstance(url, str) and url.startswith(REMOTE_SCHEMES):
            found.append((where, url))
    return found


def images_from_messages(messages: Sequence[Mapping[str, Any]], *, remote: Mapping[str, bytes] | None = None,
                         max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> list[Any]:
    """The image data of every image part of ``messages``, in order (bytes, or the PIL image a caller passed);
    ``remote`` holds the fetched bytes of its http(s) URLs (None: they are refused)."""
    out: list[Any] = []
    for where, part in _image_parts(messages):
        if part.get("type") == "image":
            value = part.get("image")
            if value is None:
                raise ImageURLError(f"{where}: an 'image' part needs an 'image' (a PIL image or bytes)")
            out.append(value)
            continue
        url = _part_url(part)
        if not isinstance(url, str) or not url:
            raise ImageURLError(f"{where}.image_url: expected a URL string (or {{'url': ...}})")
        out.append(read_image_url(url, where, remote=remote, max_bytes=max_bytes))
    return out


def read_image_url(url: str, where: str, *, remote: Mapping[str, bytes] | None, max_bytes: int) -> bytes:
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
    if url.startswith(REMOTE_SCHEMES):
        if remote is None:
            raise ImageURLError(f"{where}: remote image URLs are refused (start the server with "
                                "--allow-remote-images to fetch them, or send a data: URL)")
        if url not in remote:
            raise ImageURLError(f"{where}: the image at {url} was not fetched")
        return remote[url]
    raise ImageURLError(f"{where}: unsupported image URL {url[:40]!r}: expected a data: or http(s) URL")
