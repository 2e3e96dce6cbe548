"""Compile :class:`StructuredOutputs` with xgrammar for one tokenizer and output family, with a cache.

``StructuredCompiler(tokenizer, family, vocab_size=model_logits_width)`` is built once per served model. A
request's constraint is compiled (or taken from the cache) by :meth:`StructuredCompiler.compile`; an invalid
JSON schema, regex, EBNF or structural tag raises ValueError naming the problem (the server answers 400), so
call :meth:`validate` when the request arrives. :meth:`new_state` gives the request's :class:`GrammarState`.
:func:`check_spec` does the same checks without the vocabulary (no token masks are computed: milliseconds even for
a schema whose compilation against K3's vocabulary takes a second), for front ends that only validate.
"""

from __future__ import annotations

import collections
import re
import threading

import pydantic
import xgrammar as xgr

from rocm_k3.structured.emptiness import accepts_some_text
from rocm_k3.structured.gate import ReasoningGate
from rocm_k3.structured.spec import StructuredOutputs
from rocm_k3.structured.state import GrammarState
from rocm_k3.structured.tags import structural_tag_for
from rocm_k3.structured.vocab import FamilyTokens, GrammarTokenizer, build_tokenizer_info, family_tokens

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "
_CPP_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


def _clean(err: BaseException) -> str:
    text = str(err).strip()
    if isinstance(err, pydantic.ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
    return _CPP_PREFIX.sub("", text).strip() or type(err).__name__


_COMPILE_ERRORS = (RuntimeError, ValueError, TypeError, pydantic.ValidationError)


def check_spec(spec: StructuredOutputs, tokens: FamilyTokens) -> None:
    """Raise ValueError naming the problem when ``spec`` would not compile for ``tokens.family`` (a bad JSON
    schema, regex, EBNF or structural tag); builds the grammar without compiling it against a vocabulary."""
    if not isinstance(spec, StructuredOutputs):
        raise TypeError(f"spec: expected StructuredOutputs, got {type(spec).__name__}")
    try:
        grammar = xgr.Grammar.from_structural_tag(structural_tag_for(spec, tokens))
    except _COMPILE_ERRORS as e:
        raise ValueError(f"{spec.kind}: {_clean(e)}") from None
    _check_not_empty(spec, grammar)


def _check_not_empty(spec: StructuredOutputs, grammar: xgr.Grammar) -> None:
    if not accepts_some_text(str(grammar)):
        raise ValueError(f"{spec.kind}: the grammar accepts no text (its language is empty: a pattern, regex or "
                         "schema that nothing matches)")


class StructuredCompiler:
    """Grammars for one tokenizer: ``compile(spec)`` -> xgrammar ``CompiledGrammar`` (LRU-cached,
    ``cache_size`` entries), ``new_state(spec, thinking=..., prompt_in_think=...)`` -> GrammarState.

    tokenizer:   the project's tokenizer interface (``vocab_size``, ``token_bytes``, ``special_tokens``,
                 ``eos_token_ids``); family: "kimi_k3" or "kimi_k2"; vocab_size: the model's logits width
                 (default: the tokenizer's); max_threads: xgrammar's compile threads.
    """

    def __init__(self, tokenizer: GrammarTokenizer, family: str, *, vocab_size: int | None = None,
                 max_threads: int = 1, cache_size: int = 128) -> None:
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size: expected an int >= 1, got {cache_size!r}")
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            raise ValueError(f"max_threads: expected an int >= 1, got {max_threads!r}")
        self.tokenizer = tokenizer
        self.tokens = family_tokens(tokenizer, family)
        self.tokenizer_info = build_tokenizer_info(tokenizer, self.tokens, vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: collections.OrderedDict[str, xgr.CompiledGrammar] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def family(self) -> str:
        return self.tokens.family

    @property
    def vocab_size(self) -> int:
        """Width of the logits (and of the bitmask rows, in bits) this compiler's grammars mask."""
        return int(self.tokenizer_info.vocab_size)

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        if not isinstance(spec, StructuredOutputs):
            raise TypeError(f"spec: expected StructuredOutputs, got {type(spec).__name__}")
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            tag = structural_tag_for(spec, self.tokens)
            compiled = self._compiler.compile_structural_tag(tag)
        except _COMPILE_ERRORS as e:
            raise ValueError(f"{spec.kind}: {_clean(e)}") from None
        _check_not_empty(spec, compiled.grammar)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def validate(self, spec: StructuredOutputs) -> None:
        """Raise ValueError (naming the problem) when ``spec`` does not compile; warms the cache otherwise."""
        self.compile(spec)

    def cache_len(self) -> int:
        with self._lock:
            return len(self._cache)

    def new_state(self, spec: StructuredOutputs, *, thinking: bool = True,
                  prompt_in_think: bool | None = None) -> GrammarState:
        """The per-request state. The grammar is gated off while the request is inside think, i.e. when the
        prompt ended inside think (``prompt_in_think``, default = ``thinking``); otherwise it applies at once."""
        if prompt_in_think is None:
            prompt_in_think = thinking
        if prompt_in_think and not thinking:
            raise ValueError("prompt_in_think: cannot be True when thinking is off")
        compiled = self.compile(spec)
        gate = ReasoningGate(self.tokenizer, self.tokens, tool_calls=spec.kind == "tools") if prompt_in_think else None
        return GrammarState(compiled, gate)
