"""The marker scanner behind both entry points: :class:`StreamParser` (incremental) and :func:`parse_output`.

The scanner keeps only unprocessed text. At each step it looks for the earliest marker of the current state's
table; text before it goes to the state's channel, the marker applies its transition. With no complete marker
left, the longest tail that could still grow into a marker is held back and the rest is emitted. Because no
marker of a table contains another (checked), the markers found, and so every channel's text, do not depend
on how the text was split: ``parse_output(text)`` is the scanner fed ``text`` whole, and feeding any split of
``text`` yields deltas that add up to it (tests check this for every case).

Content that is whitespace only so far is held until a non-space character arrives, and dropped at the end:
whitespace-only content is None, as in vLLM. A call is emitted whole, with its index, once its close marker
has arrived. Nothing is lost: a call that does not parse, names a function the request did not declare, or is
still open at the end (cut off) comes back as content text, its markers removed; so does text inside a tool
section outside any call (whitespace between calls is dropped). While a call is written, ``call_deltas`` carry it the
way vLLM streams calls: a first piece with index, id and name and the first fixed part of its arguments JSON
(the family's ``partial_call``; only for a declared function when tools are declared), then each new fixed
part, the rest when it closes; the pieces of a closed call concatenate to its ``arguments_json``. The name waits
for the first well-formed piece of the arguments, so a call that breaks in its first argument streams nothing;
a call that breaks (or is cut off) after pieces went out cannot take them back: its text still comes back as
content, and its index is not reused, so the pieces of the next call never add to it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from rocm_k3.formats.parsers.registry import get_family
from rocm_k3.formats.parsers.types import (
    FamilySpec,
    ParsedDelta,
    ParsedOutput,
    ParseOptions,
    State,
    ToolCallDelta,
    Transition,
    merge_deltas,
    tool_names,
)


class _CompiledTable:
    """One state's markers: a leftmost-match regex and every proper prefix (for the hold-back)."""

    def __init__(self, markers: Mapping[str, Transition]) -> None:
        for a in markers:
            for b in markers:
                if a != b and a in b:
                    raise ValueError(f"marker {a!r} occurs inside marker {b!r}: streaming would depend on splits")
        self.transitions = dict(markers)
        self.pattern = re.compile("|".join(re.escape(m) for m in markers)) if markers else None
        self.prefixes = frozenset(m[:i] for m in markers for i in range(1, len(m)))
        self.max_len = max((len(m) for m in markers), default=0)

    def held_len(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a marker."""
        for start in range(max(0, len(buf) - self.max_len + 1), len(buf)):
            if buf[start:] in self.prefixes:
                return len(buf) - start
        return 0


class StreamParser:
    """Incremental parser of one completion: ``feed(delta_text) -> ParsedDelta``, then ``finish()``.

    family: "kimi_k3" or "kimi_k2" (or an alias, see ``registry``); the keyword options are those of
    :class:`ParseOptions`.
    """

    def __init__(self, family: str | FamilySpec, *, tools: Sequence[Mapping[str, Any]] | None = None,
                 tool_choice: Any = None, thinking: bool = True, prompt_in_think: bool | None = None,
                 call_id_prefix: str = "call_") -> None:
        self._spec = family if isinstance(family, FamilySpec) else get_family(family)
        self._opts = ParseOptions(tools=tools, tool_choice=tool_choice, thinking=thinking,
                                  prompt_in_think=prompt_in_think, call_id_prefix=call_id_prefix)
        self._tables = {state: _CompiledTable(m) for state, m in self._spec.markers.tables(self._opts).items()}
        self._state = State.REASONING if self._opts.prompt_in_think else State.CONTENT
        self._buf = ""
        self._call: list[str] | None = None  # body of the open call
        self._between: list[str] = []  # text inside a tool section outside any call (kept as content)
        self._call_return = State.TOOLS
        self._n_calls = 0
        self._content_started = False  # a non-space content character has been emitted
        self._pending_space = ""
        self._finished = False
        self._out = ParsedDelta()
        self._declared = frozenset(tool_names(tools))
        self._sent: str | None = None  # the arguments text streamed for the open call (None: not started)

    @property
    def options(self) -> ParseOptions:
        return self._opts

    def feed(self, delta_text: str) -> ParsedDelta:
        if self._finished:
            raise ValueError("feed: the parser has finished")
        if not isinstance(delta_text, str):
            raise TypeError(f"delta_text: expected str, got {type(delta_text).__name__}")
        self._buf += delta_text
        self._drain(final=False)
        self._stream_call()
        return self._take()

    def finish(self) -> ParsedDelta:
        """Flush the held-back tail (a truncated marker is dropped) and end; unclosed calls are dropped."""
        if self._finished:
            raise ValueError("finish: the parser has already finished")
        self._drain(final=True)
        if self._call is not None:  # cut off before its close (max_tokens): its text is content
            self._end_call(closed=False)
        self._keep_between()
        self._finished = True
        self._pending_space = ""
        return self._take()

    # -- scanning --------------------------------------------------------------------------------------------

    def _drain(self, final: bool) -> None:
        while True:
            table = self._tables[self._state]
            m = table.pattern.search(self._buf) if table.pattern is not None else None
            if m is not None:
                self._emit(self._buf[:m.start()])
                self._buf = self._buf[m.end():]
                self._apply(table.transitions[m.group()], m.group())
                continue
            held = table.held_len(self._buf)
            cut = len(self._buf) - held
            self._emit(self._buf[:cut])
            tail = self._buf[cut:]
            if final:
                if not any(s in tail for s in self._spec.special_texts):
                    self._emit(tail)  # ordinary text that merely looked like a marker start
                tail = ""
            self._buf = tail
            return

    def _apply(self, tr: Transition, marker: str) -> None:
        leaving = self._state
        nxt = tr.next if tr.next is not None else self._call_return
        if leaving is State.TOOLS:
            self._keep_between()
        if leaving is State.CALL:
            self._end_call(tr.closes_call)
        if nxt is State.CALL:
            self._call = []
            if leaving is not State.CALL:
                self._call_return = State.TOOLS if leaving is State.TOOLS else State.CONTENT
        self._state = nxt
        if tr.keep:
            self._emit(marker)

    def _emit(self, text: str) -> None:
        if not text:
            return
        state = self._state
        if state is State.REASONING:
            self._out.reasoning = (self._out.reasoning or "") + text
        elif state is State.CONTENT:
            if not self._content_started:
                text = self._pending_space + text
                if not text.strip():
                    self._pending_space = text
                    return
                self._pending_space = ""
                self._content_started = True
            self._out.content = (self._out.content or "") + text
        elif state is State.CALL and self._call is not None:  # entering CALL always opens a body
            self._call.append(text)
        elif state is State.TOOLS:  # kept until the next marker, then content (see _keep_between)
            self._between.append(text)
        # END (after the turn) drops its text

    def _end_call(self, closed: bool) -> None:
        """Leave the open call: a closed, well-formed call to a declared function is returned; anything else
        keeps its text as content. A call whose pieces were streamed keeps its index either way, so that the
        next call's pieces never add to it."""
        self._stream_call()
        body, self._call = self._call, None
        call = self._spec.parse_call("".join(body), self._n_calls, self._opts) if closed and body is not None \
            else None
        if call is not None and self._declared and call.name not in self._declared:
            call = None  # a function the request did not declare: its text is content
        if call is not None:
            self._out.tool_calls.append(call)
            self._close_call_deltas(call)
            self._n_calls += 1
        elif body is not None:
            self._keep_text(body)
            self._n_calls += self._sent is not None
        self._sent = None

    def _keep_between(self) -> None:
        """Text in a tool section outside any call (stray or broken markup, prose) is content, markers removed;
        whitespace between calls is dropped."""
        between, self._between = self._between, []
        if "".join(between).strip():
            self._keep_text(["".join(between).strip()])

    def _keep_text(self, body: list[str]) -> None:
        """A call that is not a call (malformed, undeclared, unclosed): its text goes on as content, the family's
        special-token markers removed."""
        text = "".join(body)
        for special in self._spec.special_texts:
            text = text.replace(special, " ")
        text = re.sub(r" {2,}", " ", text).strip(" ")
        state, self._state = self._state, State.CONTENT
        self._emit(text)
        self._state = state

    def _stream_call(self) -> None:
        """The new argument piece of the open call (see the module docstring)."""
        partial_call = self._spec.partial_call
        if self._call is None or partial_call is None:
            return
        part = partial_call("".join(self._call), self._n_calls, self._opts)
        if part is None or (self._declared and part.name not in self._declared):
            return
        if self._sent is None:
            if part.arguments_json:  # the name goes out with the first well-formed piece of its arguments
                self._out.call_deltas.append(ToolCallDelta(part.index, part.arguments_json, part.id, part.name))
                self._sent = part.arguments_json
        elif len(part.arguments_json) > len(self._sent) and part.arguments_json.startswith(self._sent):
            self._out.call_deltas.append(ToolCallDelta(part.index, part.arguments_json[len(self._sent):]))
            self._sent = part.arguments_json

    def _close_call_deltas(self, call) -> None:
        if self._declared and call.name not in self._declared:
            return
        if self._sent is None:
            self._out.call_deltas.append(ToolCallDelta(call.index, call.arguments_json, call.id, call.name))
        elif call.arguments_json.startswith(self._sent):
            rest = call.arguments_json[len(self._sent):]
            if rest:
                self._out.call_deltas.append(ToolCallDelta(call.index, rest))
        else:  # cannot happen for a family whose partial_call returns prefixes (checked by the parser tests)
            raise RuntimeError(f"streamed arguments {self._sent!r} are not a prefix of {call.arguments_json!r}")
        self._sent = None

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out


def parse_output(family: str | FamilySpec, text: str, *, tools: Sequence[Mapping[str, Any]] | None = None,
                 tool_choice: Any = None, thinking: bool = True, prompt_in_think: bool | None = None,
                 call_id_prefix: str = "call_") -> ParsedOutput:
    """Split a whole completion ``text`` (decoded with special tokens as their literal text) into reasoning,
    content and tool calls; the same as streaming it through :class:`StreamParser` in any split."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    parser = StreamParser(family, tools=tools, tool_choice=tool_choice, thinking=thinking,
                          prompt_in_think=prompt_in_think, call_id_prefix=call_id_prefix)
    return merge_deltas([parser.feed(text), parser.finish()])
