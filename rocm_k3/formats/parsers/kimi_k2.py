"""Kimi K2 / K2.5 / Kimi Linear output: single-token markers (SERVING_SPEC §2.3, §3.3, §4.2).

``[reasoning </think>] content [<|tool_calls_section_begin|> (<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>)+ <|tool_calls_section_end|>] <|im_end|>``.

- ``</think>`` ends reasoning, and so does a tool section (or a bare call) start seen inside think (the K2
  model sometimes starts a tool section without ``</think>``: vLLM #32216, #33646);
- the call header is kept verbatim as the OpenAI id when it has the canonical ``NAME:IDX`` shape (the name is
  the part before the last ``:`` without a ``functions.`` prefix); otherwise the header is the name and the
  id is generated like K3's; empty arguments become ``{}``; other arguments must be a JSON object, written
  as is; a call whose header or arguments hold markup, whose arguments are not a JSON object, or with no
  argument marker is not a call: its text is kept as content (markers removed);
- ``<|im_end|>`` and the tokenizer eos ``[EOS]`` end the turn and never reach the content; text after them
  is dropped.
"""

from __future__ import annotations

import dataclasses
import re

from rocm_k3.formats.parsers.types import FamilyMarkers, FamilySpec, ParseOptions, ToolCall, json_object_or_none

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
IM_END = "<|im_end|>"
EOS = "[EOS]"  # the tokenizer eos, also a stop token
FUNCTIONS_PREFIX = "functions."

_CANONICAL_ID = re.compile(r"(.+):(\d+)", re.DOTALL)


SPECIALS = (THINK_OPEN, THINK_CLOSE, SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, IM_END, EOS)
# the markup that ends or breaks a call: inside a tool section the think markers are plain text (an argument may
# quote them)
CALL_MARKUP = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, IM_END, EOS)


def _split(body: str, index: int, opts: ParseOptions) -> tuple[ToolCall, str] | None:
    """(the call with no arguments yet, the argument text) once the header is complete and names a function."""
    header, sep, arguments = body.partition(ARGUMENT_BEGIN)
    header = header.strip()
    if not sep or any(s in header for s in CALL_MARKUP):
        return None
    m = _CANONICAL_ID.fullmatch(header)
    name = m.group(1) if m else header
    if name.startswith(FUNCTIONS_PREFIX):
        name = name[len(FUNCTIONS_PREFIX):]
    if not name:
        return None
    call_id = header if m else f"{opts.call_id_prefix}{index}"
    return ToolCall(id=call_id, name=name, arguments_json="", index=index), arguments


def parse_call(body: str, index: int, opts: ParseOptions) -> ToolCall | None:
    """One call: ``body`` = ``'functions.NAME:IDX<|tool_call_argument_begin|>{json}'``; None unless the arguments
    are empty or a JSON object with no markup inside."""
    split = _split(body, index, opts)
    if split is None:
        return None
    call, arguments = split
    arguments = arguments.strip()
    if any(s in arguments for s in CALL_MARKUP):
        return None
    if arguments and not isinstance(json_object_or_none(arguments), dict):
        return None
    return dataclasses.replace(call, arguments_json=arguments or "{}")


def partial_call(body: str, index: int, opts: ParseOptions) -> ToolCall | None:
    """The call being written once its header is complete; the argument text so far (up to any markup in it,
    leading and trailing whitespace held back, since the final arguments are stripped) is a prefix of the final
    arguments."""
    split = _split(body, index, opts)
    if split is None:
        return None
    call, arguments = split
    ends = [at for at in (arguments.find(s) for s in CALL_MARKUP) if at >= 0]
    if ends:
        arguments = arguments[:min(ends)]
    return dataclasses.replace(call, arguments_json=arguments.strip())


KIMI_K2 = FamilySpec(
    name="kimi_k2",
    markers=FamilyMarkers(think_open=THINK_OPEN, think_close=THINK_CLOSE, tools_open=SECTION_BEGIN,
                          tools_close=SECTION_END, call_open=CALL_BEGIN, call_close=CALL_END, wrappers=(),
                          ends=(IM_END, EOS)),
    special_texts=(THINK_OPEN, THINK_CLOSE, SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END,
                   IM_END, EOS),
    parse_call=parse_call,
    partial_call=partial_call,
)
