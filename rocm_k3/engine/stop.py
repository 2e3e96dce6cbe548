"""Per-request output text and stop conditions, checked incrementally (engine side, plain Python).

:class:`IncrementalDetokenizer` decodes only a short window around the newest tokens (so a step costs O(1) in
the output length) and holds back a character whose UTF-8 bytes are still split across tokens.
:class:`StopChecker` appends each sampled token, decides whether the request is finished (eos / stop token,
stop string, max_tokens) and keeps the text: stop strings are searched only in the new text plus the
``len(longest stop) - 1`` characters before it, and text that could still become a stop string is held back
from streamed deltas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from rocm_k3.sampling_params import SamplingParams
from rocm_k3.tokenizers.detokenizer import IncrementalDetokenizer

class Detokenizable(Protocol):
    special_tokens: Mapping[str, int]

    def token_bytes(self, token_id: int) -> bytes: ...


@dataclasses.dataclass(frozen=True)
class StopDecision:
    """finish_reason: "stop" (eos, a stop token or a stop string), "length" (max_tokens) or None (continue)."""

    finish_reason: str | None
    stop_reason: int | str | None = None


_CONTINUE = StopDecision(None)  # (frozen: one instance serves every token that does not finish)


class StopChecker:
    """The output of one request, token by token.

    tokenizer: needed for text and stop strings (a request with ``stop`` strings and no tokenizer is refused);
    special tokens are left out of the text when ``params.skip_special_tokens``;
    max_tokens: the generation cap (SamplingParams.max_tokens, capped by max_model_len).
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int], tokenizer: Detokenizable | None,
                 max_tokens: int) -> None:
        if params.stop and tokenizer is None:
            raise ValueError(f"stop={list(params.stop)!r}: stop strings need a tokenizer, and this checkpoint has "
                             "none (use stop_token_ids)")
        self.params = params
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._tokenizer = tokenizer
        skip = params.skip_special_tokens and tokenizer is not None
        self._hidden = frozenset(tokenizer.special_tokens.values()) if skip else frozenset()
        self._max_tokens = max_tokens
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._start()

    def _start(self) -> None:
        """The state before the first token."""
        self._detok = IncrementalDetokenizer(self._tokenizer) if self._tokenizer is not None else None
        self.num_tokens = 0
        self.text = ""
        self.finished = False
        self._emitted = 0

    @property
    def num_chars_emitted(self) -> int:
        """Characters of text already returned by :meth:`take_text_delta`."""
        return self._emitted

    def rewind(self, output_ids: Sequence[int], num_chars_emitted: int) -> None:
        """Go back to the state after ``output_ids`` (a prefix of the tokens pushed so far, none of which finished
        the request) with ``num_chars_emitted`` characters taken: how the engine undoes a step that an exception
        cut short. Replays the tokens (the rare path; no per-step snapshot)."""
        self._start()
        for token_id in output_ids:
            if self.push(token_id).finish_reason is not None:
                raise RuntimeError("rewind: the request finishes before the tokens given end")
        self._emitted = num_chars_emitted

    def push(self, token_id: int) -> StopDecision:
        """Append one generated token; the decision after it (the text is cut before a matched stop string)."""
        if self.finished:
            raise ValueError("push: the request has already finished")
        self.num_tokens += 1
        if self._detok is not None and token_id not in self._hidden:
            piece = self._detok.feed((token_id,))
            if piece:
                old = len(self.text)
                self.text += piece
                decision = self._check_stop_strings(old)
                if decision is not None:
                    return self._finish(decision)
        if token_id in self._stop_ids:
            return self._finish(StopDecision("stop", token_id), flush=True)
        if token_id in self._eos:
            return self._finish(StopDecision("stop", None), flush=True)
        if self.num_tokens >= self._max_tokens:
            return self._finish(StopDecision("length"), flush=True)
        return _CONTINUE

    def take_text_delta(self) -> str:
        """Text not yet returned, minus a tail that could still grow into a stop string (all of it once finished)."""
        end = len(self.text) if self.finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _check_stop_strings(self, old_len: int) -> StopDecision | None:
        if not self.params.stop or len(self.text) == old_len:
            return None
        start = max(0, old_len - self._holdback)
        hits = [(pos, s) for s in self.params.stop if (pos := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        pos, s = min(hits)
        self.text = self.text[:pos]
        return StopDecision("stop", s)

    def _finish(self, decision: StopDecision, flush: bool = False) -> StopDecision:
        if flush and self._detok is not None:
            self.text += self._detok.finish()
        self.finished = True
        return decision
