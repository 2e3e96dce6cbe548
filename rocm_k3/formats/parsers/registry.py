"""Which output family a checkpoint uses, with the ``--tool-call-parser`` / ``--reasoning-parser`` overrides."""

from __future__ import annotations

from pathlib import Path

from rocm_k3.formats.parsers.kimi_k2 import KIMI_K2
from rocm_k3.formats.parsers.kimi_k3 import KIMI_K3
from rocm_k3.formats.parsers.types import FamilySpec

FAMILIES: dict[str, FamilySpec] = {KIMI_K3.name: KIMI_K3, KIMI_K2.name: KIMI_K2}
# checkpoint ``model_type`` (top level of config.json) -> family
MODEL_TYPE_FAMILIES = {"kimi_k3": "kimi_k3", "kimi_linear": "kimi_k2", "kimi_k2": "kimi_k2", "kimi_k25": "kimi_k2"}
# parser names accepted on the command line (vLLM's spellings) -> family
PARSER_ALIASES = {"kimi_k3": "kimi_k3", "kimi_k2": "kimi_k2", "kimi_linear": "kimi_k2", "kimi_k25": "kimi_k2"}


def get_family(name: str) -> FamilySpec:
    """The family called ``name`` ("kimi_k3", "kimi_k2" or an alias such as "kimi_linear")."""
    family = PARSER_ALIASES.get(name) if isinstance(name, str) else None
    if family is None:
        raise ValueError(f"parser family: expected one of {sorted(PARSER_ALIASES)}, got {name!r}")
    return FAMILIES[family]


def family_for_model_type(model_type: str) -> str:
    """The family of a checkpoint's ``model_type``."""
    family = MODEL_TYPE_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"model_type: no output parser for {model_type!r} (known: {sorted(MODEL_TYPE_FAMILIES)})")
    return family


def resolve_family(model_type: str | None, *, tool_call_parser: str | None = None,
                   reasoning_parser: str | None = None) -> str:
    """The family to parse with: the overrides when given (they must agree: one scanner parses both channels),
    else the checkpoint's own."""
    chosen = {get_family(p).name for p in (tool_call_parser, reasoning_parser) if p is not None}
    if len(chosen) > 1:
        raise ValueError(
            f"--tool-call-parser {tool_call_parser!r} and --reasoning-parser {reasoning_parser!r} name different "
            "families; rocm-k3 parses reasoning and tool calls of one family together"
        )
    if chosen:
        return chosen.pop()
    if model_type is None:
        raise ValueError("parser family: no checkpoint model_type and no --tool-call-parser/--reasoning-parser")
    return family_for_model_type(model_type)


def checkpoint_family(checkpoint_dir: str | Path, *, tool_call_parser: str | None = None,
                      reasoning_parser: str | None = None) -> str | None:
    """The family of a checkpoint directory (its ``config.json`` ``model_type``, or the overrides); None when the
    checkpoint names no known family and no override is given (such a model serves no tools or grammars)."""
    from rocm_k3.tokenizers.base import read_json_if_present

    if tool_call_parser is not None or reasoning_parser is not None:
        return resolve_family(None, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    config = read_json_if_present(Path(checkpoint_dir) / "config.json") or {}
    model_type = config.get("model_type")
    return MODEL_TYPE_FAMILIES.get(model_type) if isinstance(model_type, str) else None
