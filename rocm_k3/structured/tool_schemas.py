"""Tool parameter schemas checked when a request arrives, whatever its ``tool_choice``: each ``parameters`` must
be a valid JSON schema by its metaschema (``jsonschema``'s check: draft 2020-12 unless ``$schema`` names
another draft). ``{"type": "strnig"}`` or ``"properties": []`` is a ValueError naming the tool, where in its
schema, and the problem (the server answers 400). Which keywords the grammar then enforces (tool_choice
``required`` / named) is :mod:`rocm_k3.structured.schema_keywords`' business."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rocm_k3.formats.parsers.types import tool_names


def check_tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> None:
    """ValueError naming the first tool whose ``function.parameters`` is not a valid JSON schema."""
    import jsonschema

    for i, name in enumerate(tool_names(tools)):
        params = tools[i]["function"].get("parameters")
        where = f"tools[{i}].function.parameters"
        if params is None:
            continue
        if not isinstance(params, (Mapping, bool)):
            raise ValueError(f"{where}: expected a JSON-schema object (tool {name!r}), got {type(params).__name__}")
        validator = jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator)
        try:
            validator.check_schema(params)
        except jsonschema.SchemaError as exc:
            at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
            raise ValueError(f"{where}{at}: not a valid JSON schema (tool {name!r}): {exc.message}") from None
        except RecursionError:
            raise ValueError(f"{where}: nested too deeply to check (tool {name!r})") from None
