"""The prefix-cache key of a prompt with images: its ids with each image's pads salted by the image's hash.

The prefix index matches exact id tuples, so two prompts with the same text and different images would share the
KV of their ``<|media_pad|>`` positions if it matched on the ids. It matches on :func:`prefix_cache_key` instead:
every pad of an image becomes ``MEDIA_KEY_BASE + int(content_hash, 16)``, an integer above every token id that
differs between images (sha256 of the preprocessed pixels and grid), so equal text with different images never
shares a cache entry past the first pad and identical image prompts do. Plain integers (the control plane's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

MEDIA_KEY_BASE = 1 << 32  # prefix-cache key ids for image pads start here: above every token id


class SaltedSpan(Protocol):
    """What :func:`prefix_cache_key` reads of an image: a prompt ``ImageSlot`` or a step-contract ``ImageInput``."""

    content_hash: str  # sha256 hex

    @property
    def pad_positions(self) -> range: ...


def prefix_cache_key(token_ids: Sequence[int], slots: Sequence[SaltedSpan]) -> list[int]:
    """The ids to match in the prefix cache: image pads replaced by ``MEDIA_KEY_BASE + int(content_hash)``."""
    key = list(token_ids)
    for slot in slots:
        salt = MEDIA_KEY_BASE + int(slot.content_hash, 16)
        for p in slot.pad_positions:
            key[p] = salt
    return key
