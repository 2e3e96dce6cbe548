"""Does a grammar accept any text at all? A grammar whose language is empty (a regex such as ``[^\\s\\S]``, a
required argument whose pattern matches nothing) would leave the sampler no token at its first or some later
step; the request is refused instead (400) when it arrives.

:func:`accepts_some_text` reads xgrammar's printed EBNF (``str(grammar)``) and computes the productive rules
(a rule is productive when one of its alternatives is a sequence of productive elements: a string, a character
class that holds a character, a productive rule, a group, or anything repeated at least zero times) up to a fixed
point; the language is empty exactly when ``root`` is not productive. Lookaheads are taken as always satisfiable
and any syntax this reader does not know counts as productive, so the answer errs towards "accepts text" (never a
refusal of a grammar that accepts something).
"""

from __future__ import annotations

import re

_RULE = re.compile(r"^([A-Za-z_][\w]*) ::= ", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_][\w]*")
_REPEAT = re.compile(r"\{\s*(\d+)\s*,\s*(-?\d+)\s*\}")
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0", "b": "\b", "a": "\a", "e": "\x1b"}
_MAX_CODE = 0x10FFFF


class _Unknown(Exception):
    """Syntax this reader does not know."""


def accepts_some_text(ebnf: str) -> bool:
    """False only when the grammar printed as ``ebnf`` (root rule ``root``) provably accepts no text."""
    try:
        rules = _parse_rules(ebnf)
    except (_Unknown, IndexError, ValueError):
        return True
    if "root" not in rules:
        return True
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            if name not in productive and _alts_productive(alts, productive):
                productive.add(name)
                changed = True
    return "root" in productive


# An element: ("s",) always productive; ("c", has_char); ("r", name); ("g", alternatives); each with min count.
def _alts_productive(alts: list, productive: set[str]) -> bool:
    return any(all(_elem_productive(e, n, productive) for e, n in seq) for seq in alts)


def _elem_productive(elem: tuple, min_count: int, productive: set[str]) -> bool:
    if min_count == 0 or elem[0] == "s":
        return True
    if elem[0] == "c":
        return elem[1]
    if elem[0] == "r":
        return elem[1] in productive
    return _alts_productive(elem[1], productive)


def _parse_rules(ebnf: str) -> dict[str, list]:
    heads = list(_RULE.finditer(ebnf))
    rules = {}
    for i, head in enumerate(heads):
        body = ebnf[head.end():heads[i + 1].start() if i + 1 < len(heads) else len(ebnf)].strip()
        rules[head.group(1)] = _Reader(body).alternatives(0)[0]
    return rules


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text

    def alternatives(self, pos: int, closing: str = "") -> tuple[list, int]:
        alts, seq = [], []
        t = self.text
        while True:
            while pos < len(t) and t[pos] in " \n":
                pos += 1
            if pos >= len(t) or (closing and t[pos] == closing):
                alts.append(seq)
                return alts, pos + (1 if closing and pos < len(t) else 0)
            ch = t[pos]
            if ch == "|":
                alts.append(seq)
                seq, pos = [], pos + 1
                continue
            if t.startswith("(=", pos):  # a lookahead: taken as satisfiable
                _, pos = self.alternatives(pos + 2, ")")
                continue
            if ch == "(":
                inner, pos = self.alternatives(pos + 1, ")")
                elem: tuple = ("g", inner)
            elif ch == '"':
                pos = self._skip_string(pos)
                elem = ("s",)
            elif ch == "[":
                has_char, pos = self._char_class(pos)
                elem = ("c", has_char)
            elif t.startswith(("Token(", "TagDispatch("), pos):  # a token / free text: accepts something
                pos = self._skip_call(t.index("(", pos))
                elem = ("s",)
            else:
                name = _NAME.match(t, pos)
                if name is None:
                    raise _Unknown(t[pos:pos + 20])
                elem, pos = ("r", name.group()), name.end()
            min_count, pos = self._quantifier(pos)
            seq.append((elem, min_count))

    def _quantifier(self, pos: int) -> tuple[int, int]:
        t = self.text
        if pos < len(t) and t[pos] in "*?":
            return 0, pos + 1
        if pos < len(t) and t[pos] == "+":
            return 1, pos + 1
        rep = _REPEAT.match(t, pos)
        if rep is not None:
            return int(rep.group(1)), rep.end()
        return 1, pos

    def _skip_string(self, pos: int) -> int:
        t, pos = self.text, pos + 1
        while t[pos] != '"':
            pos += 2 if t[pos] == "\\" else 1
        return pos + 1

    def _skip_call(self, pos: int) -> int:
        """The position after the parenthesis closing the one at ``pos`` (strings inside skipped)."""
        t, depth = self.text, 0
        while True:
            if t[pos] == '"':
                pos = self._skip_string(pos)
                continue
            depth += {"(": 1, ")": -1}.get(t[pos], 0)
            pos += 1
            if depth == 0:
                return pos

    def _char(self, pos: int) -> tuple[int, int]:
        """(code point, next position) of one (possibly escaped) character of a class."""
        t = self.text
        if t[pos] != "\\":
            return ord(t[pos]), pos + 1
        kind = t[pos + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(kind)
        if width is not None:
            return int(t[pos + 2:pos + 2 + width], 16), pos + 2 + width
        return ord(_ESCAPES.get(kind, kind)), pos + 2

    def _char_class(self, pos: int) -> tuple[bool, int]:
        t, pos = self.text, pos + 1
        negated = t[pos] == "^"
        pos += negated
        ranges = []
        while t[pos] != "]":
            lo, pos = self._char(pos)
            hi = lo
            if t[pos] == "-" and t[pos + 1] != "]":
                hi, pos = self._char(pos + 1)
            ranges.append((lo, hi))
        pos += 1
        if not negated:
            return bool(ranges), pos
        covered = 0  # the first code point not yet covered by the sorted ranges
        for lo, hi in sorted(ranges):
            if lo > covered:
                break
            covered = max(covered, hi + 1)
        return covered <= _MAX_CODE, pos
