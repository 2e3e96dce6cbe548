"""Reasoning and tool-call parsers for Kimi K3 (XTML) and Kimi K2 / Kimi Linear (single-token markers).

``parse_output(family, text, ...)`` parses a whole completion; ``StreamParser(family, ...)`` parses it piece
by piece with ``feed`` / ``finish``, and the deltas of any split add up to ``parse_output`` of the whole.
"""

from rocm_k3.formats.parsers.registry import (
    FAMILIES,
    family_for_model_type,
    get_family,
    resolve_family,
)
from rocm_k3.formats.parsers.stream import StreamParser, parse_output
from rocm_k3.formats.parsers.types import (
    FamilySpec,
    ParsedDelta,
    ParsedOutput,
    ParseOptions,
    ToolCall,
    merge_deltas,
)

__all__ = [
    "FAMILIES",
    "FamilySpec",
    "ParseOptions",
    "ParsedDelta",
    "ParsedOutput",
    "StreamParser",
    "ToolCall",
    "family_for_model_type",
    "get_family",
    "merge_deltas",
    "parse_output",
    "resolve_family",
]
