"""Drive a GrammarState token by token with seeded random logits masked by its bitmask (test helper)."""

from __future__ import annotations

import torch

from grammar_tokenizer import LONE_HIGH_BYTES
from rocm_k3.structured import GrammarState, allocate_bitmask, apply_bitmask


def generate(state: GrammarState, vocab_size: int, *, seed: int, prefix: list[int] = (), greedy: bool = True,
             max_steps: int = 4000, scale: float = 3.0, banned: frozenset[int] = LONE_HIGH_BYTES) -> list[int]:
    """Accept ``prefix`` (e.g. think text while gated), then sample until the grammar terminates; returns
    all ids. Each step: fresh N(0, scale) logits, the grammar's mask applied, argmax (greedy) or a draw.

    ``banned`` ids are never sampled: by default the lone bytes 0x80-0xFF, because xgrammar's character
    classes accept overlong / surrogate UTF-8 byte sequences that no strict decoder reads back (a real BPE
    vocabulary has whole-character tokens; the test tokenizer has some multi-byte ones)."""
    ids = []
    for tid in prefix:
        state.accept(tid)
        ids.append(tid)
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, vocab_size)
    for _ in range(max_steps):
        if not state.fill_bitmask(bitmask, 0):
            raise AssertionError("the grammar does not apply after the prefix (still gated?)")
        logits = torch.randn(1, vocab_size, generator=gen) * scale  # [1, V]
        apply_bitmask(logits, bitmask, [0])
        logits[0, sorted(banned)] = float("-inf")
        if greedy:
            tok = int(logits.argmax())
        else:
            tok = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))
        state.accept(tok)
        ids.append(tok)
        if state.is_terminated:
            return ids
    raise AssertionError(f"no termination within {max_steps} steps: {ids[-50:]}")


_PY_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None),
             "object": dict, "array": list}


def validate_json(instance, schema) -> None:
    """jsonschema's validation when installed, else a structural check of the keywords the tests use."""
    try:
        import jsonschema
    except ImportError:
        _check(instance, schema, "$")
        return
    jsonschema.validate(instance, schema)


def _check(value, schema, path) -> None:
    t = schema.get("type")
    if t is not None:
        ok = isinstance(value, _PY_TYPES[t]) and not (t in ("integer", "number") and isinstance(value, bool))
        assert ok, f"{path}: {value!r} is not {t}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if isinstance(value, str):
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)), path
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), path
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            assert key in value, f"{path}: missing {key!r}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _check(value[key], sub, f"{path}.{key}")
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", len(value)), path
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{path}[{i}]")
