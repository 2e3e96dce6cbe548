"""English prose from the Python standard library's own documentation, cleaned for a byte-level language model.

:func:`stdlib_docstrings` collects the docstrings and pydoc topics of the running interpreter's standard library
(:mod:`rocm_k3.training.stdlib_docs`, in a child interpreter). :func:`clean_paragraphs` keeps the paragraphs
that read as plain English sentences: ASCII, no code (no indented or prompt lines, no identifiers with ``_`` or
``.``, no call syntax, no camelCase, no markup characters), starting with a capital letter and ending with a full
stop, made mostly of alphabetic words; a paragraph indented as a whole (the text under a definition in pydoc's
topics) counts, one with ragged indentation (code, lists) does not. :func:`prose_documents` groups the kept paragraphs of each source into
documents of bounded length. Everything is sorted and deduplicated, so one interpreter gives the same corpus
every time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

MIN_PARAGRAPH = 30  # characters
MIN_WORDS = 5
MAX_PARAGRAPH = 1200
MIN_ALPHA_WORDS = 0.9  # fraction of words made of letters (with inner hyphens or apostrophes)
_FORBIDDEN = set("_=<>{}[]|\\#*~^@$%`\t/")
_CALL = re.compile(r"\w\(")
_CAMEL = re.compile(r"[a-z][A-Z]")
_WORD = re.compile(r"^[A-Za-z]+(?:['-][A-Za-z]+)*$")
_ABBREVIATIONS = frozenset({"e.g", "i.e", "etc", "vs", "Mr", "Dr"})
_STRIP = ",.;:!?\"'()"


class ProseDocument(NamedTuple):
    source: str  # the docstring's module / object path
    text: str


def stdlib_docstrings(python: str | None = None, timeout_s: float = 300.0) -> list[tuple[str, str]]:
    """``[(source, docstring)]`` of the standard library of ``python`` (default: this interpreter)."""
    script = Path(__file__).with_name("stdlib_docs.py")
    proc = subprocess.run([python or sys.executable, "-I", "-S", str(script)], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"collecting the standard library's docstrings failed: {proc.stderr.strip()[-2000:]}")
    return [(str(s), str(t)) for s, t in json.loads(proc.stdout)]


def is_clean_paragraph(text: str) -> bool:
    """True when ``text`` (one paragraph joined into one line, single spaces) reads as plain English prose."""
    if not MIN_PARAGRAPH <= len(text) <= MAX_PARAGRAPH or not text.isascii():
        return False
    if not (text[0].isupper() and text.endswith(".")) or "::" in text or "->" in text:
        return False
    if any(c in _FORBIDDEN for c in text) or _CALL.search(text) or _CAMEL.search(text):
        return False
    words = text.split()
    if len(words) < MIN_WORDS:
        return False
    alpha = 0
    for raw in words:
        word = raw.strip(_STRIP)
        if "." in word and word not in _ABBREVIATIONS:
            return False
        alpha += bool(_WORD.match(word)) or word in _ABBREVIATIONS
    return alpha >= MIN_ALPHA_WORDS * len(words)


def clean_paragraphs(doc: str) -> list[str]:
    """The clean paragraphs of one docstring, each joined into one line (see :func:`is_clean_paragraph`)."""
    out = []
    for block in re.split(r"\n\s*\n", doc):
        lines = textwrap.dedent(block).strip("\n").split("\n")  # an indented paragraph (a definition's text)
        if not lines or any(not line.strip() or line[:1].isspace() or line.lstrip().startswith(
                (">>>", "...", "-", "+", "*", "o ")) for line in lines):
            continue
        text = " ".join(" ".join(lines).split())  # one line, single spaces
        if is_clean_paragraph(text):
            out.append(text)
    return out


def prose_documents(docstrings: Iterable[tuple[str, str]], max_chars: int = 1200) -> list[ProseDocument]:
    """Documents of consecutive clean paragraphs of each docstring (joined by a blank line, at most
    ``max_chars`` unless one paragraph is longer); a paragraph seen before (anywhere) is dropped."""
    seen: set[str] = set()
    out: list[ProseDocument] = []
    for source, doc in docstrings:
        current: list[str] = []
        for para in clean_paragraphs(doc):
            if para in seen:
                continue
            seen.add(para)
            if current and len("\n\n".join([*current, para])) > max_chars:
                out.append(ProseDocument(source, "\n\n".join(current)))
                current = []
            current.append(para)
        if current:
            out.append(ProseDocument(source, "\n\n".join(current)))
    return out


def word_list(texts: Sequence[str]) -> frozenset[str]:
    """Lower-cased alphabetic words of ``texts`` (the dictionary that generated prose is measured against);
    single letters other than "a" and "i" (the "t" of "don't") are not words."""
    words = {w.lower() for text in texts for w in re.findall(r"[A-Za-z]+", text)}
    return frozenset(w for w in words if len(w) > 1 or w in ("a", "i"))
