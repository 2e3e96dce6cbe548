"""Kimi K2 / K2.5 / Kimi Linear output: single-token markers (SERVING_SPEC §2.3, §3.3, §4.2).

``[reasoning </think>] content [<|tool_calls_section_begin|> (<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>)+ <|tool_calls_section_end|>] <|im_end|>``.

- ``</think>`` ends reasoning, and so does a tool section (or a bare call) start seen inside think (the K2
  model sometimes starts a tool section without ``</think>``: vLLM #32216, #33646);
- the call header is kept verbatim as the OpenAI id when it has the canonical ``NAME:IDX`` shape (the name is
  the part before the last ``:`` without a ``functions.`` prefix); otherwise the header is the name and the
  id is generated like K3's; empty arguments become ``{}``, other argument text is passed on as written;
- ``<|im_end|>`` and the tokenizer eos ``[EOS]`` end the turn and never reach the content; text after them
  is dropped.
"""

from __future__ import annotations

import re

from rocm_k3.formats.parsers.types import FamilyMarkers, FamilySpec, ParseOptions, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
IM_END = "<|im_end|>"
EOS = "[EOS]"  # the tokenizer eos, also a stop token
FUNCTIONS_PREFIX = "functions."

_CANONICAL_ID = re.compile(r"(.+):(\d+)", re.DOTALL)


def parse_call(body: str, index: int, opts: ParseOptions) -> ToolCall | None:
    """One call: ``body`` = ``'functions.NAME:IDX<|tool_call_argument_begin|>{json}'``."""
    header, _, arguments = body.partition(ARGUMENT_BEGIN)
    header = header.strip()
    m = _CANONICAL_ID.fullmatch(header)
    name = m.group(1) if m else header
    if name.startswith(FUNCTIONS_PREFIX):
        name = name[len(FUNCTIONS_PREFIX):]
    if not name:
        return None
    call_id = header if m else f"{opts.call_id_prefix}{index}"
    return ToolCall(id=call_id, name=name, arguments_json=arguments.strip() or "{}", index=index)


def partial_call(body: str, index: int, opts: ParseOptions) -> ToolCall | None:
    """The call being written once its header is complete; the argument text so far (leading and trailing
    whitespace held back, since the final arguments are stripped) is a prefix of the final arguments."""
    if ARGUMENT_BEGIN not in body:
        return None
    header, _, arguments = body.partition(ARGUMENT_BEGIN)
    call = parse_call(header + ARGUMENT_BEGIN, index, opts)
    if call is None:
        return None
    return ToolCall(id=call.id, name=call.name, arguments_json=arguments.strip(), index=index)


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
