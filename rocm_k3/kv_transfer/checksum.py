"""Checksums of transferred blocks: xxh3-64 when ``xxhash`` imports (the ``pd`` extra), else hashlib blake2b-64."""

from __future__ import annotations

import hashlib

try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the install
    _xxhash = None

ALGORITHM = "xxh3_64" if _xxhash is not None else "blake2b_64"


def digest(payload: bytes) -> str:
    """Hex digest of ``payload`` under ``ALGORITHM``."""
    if _xxhash is not None:
        return _xxhash.xxh3_64_hexdigest(payload)
    return hashlib.blake2b(payload, digest_size=8).hexdigest()


def verify(payload: bytes, expected: str) -> bool:
    """True when ``payload`` hashes to ``expected``."""
    return digest(payload) == expected
