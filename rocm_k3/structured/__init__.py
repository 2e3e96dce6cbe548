"""Structured output (JSON schema, regex, choice, EBNF, structural tags, forced tool calls) with xgrammar,
gated by the reasoning channel. See ``compiler.py`` for the entry point and ``state.py`` for the per-step
protocol of the worker's sampler."""

from rocm_k3.structured.compiler import StructuredCompiler, check_spec
from rocm_k3.structured.gate import ReasoningGate
from rocm_k3.structured.spec import (
    StructuredOutputs,
    ToolCallConstraint,
    ToolSchema,
    tool_call_constraint,
)
from rocm_k3.structured.state import (
    GrammarRejectedError,
    GrammarState,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)
from rocm_k3.structured.vocab import GrammarTokenizer

__all__ = [
    "GrammarRejectedError",
    "GrammarState",
    "GrammarTokenizer",
    "ReasoningGate",
    "StructuredCompiler",
    "StructuredOutputs",
    "ToolCallConstraint",
    "ToolSchema",
    "allocate_bitmask",
    "apply_bitmask",
    "check_spec",
    "fill_bitmasks",
    "tool_call_constraint",
]
