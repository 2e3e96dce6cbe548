"""JSON-schema rewrites applied before xgrammar sees a schema (the output still satisfies the original).

xgrammar 0.2.9 turns a string with ``minLength``/``maxLength`` (and no ``pattern``/``format``) into
``"\\"" [^"\\\\\\r\\n]{min,max} "\\""``, which admits raw control characters: invalid JSON (test
``test_xgrammar_length_bug_is_worked_around`` shows it). Such strings are rewritten into the equivalent
``pattern`` ``[^"\\\\\\x00-\\x1f]{min,max}`` (no escapes: a subset of the valid strings of that length).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # values that are data, not schemas
_PLAIN_CHARS = r'[^"\\\x00-\x1f\ud800-\udfff]'


def _length_bound(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"json schema: {name} must be a non-negative integer, got {value!r}")
    return value


def normalize_json_schema(schema: Any) -> Any:
    """A copy of ``schema`` with the rewrites above applied at every nesting level."""
    if isinstance(schema, list):
        return [normalize_json_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: (v if k in _DATA_KEYS else normalize_json_schema(v)) for k, v in schema.items()}
    if out.get("type") == "string" and "pattern" not in out and "format" not in out and (
            "minLength" in out or "maxLength" in out):
        lo = _length_bound(out.pop("minLength", None), "minLength") or 0
        hi = _length_bound(out.pop("maxLength", None), "maxLength")
        if hi is not None and hi < lo:
            raise ValueError(f"json schema: maxLength {hi} < minLength {lo}")
        out["pattern"] = f"{_PLAIN_CHARS}{{{lo},{'' if hi is None else hi}}}"
    return out
