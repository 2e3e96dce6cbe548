"""Incremental output text and stop checks: split multi-byte characters, stop strings across tokens, held-back
stream text, stop/eos token ids, max_tokens, and stop strings without a tokenizer."""

from __future__ import annotations

import pytest

from rocm_k3.engine.stop import IncrementalDetokenizer, StopChecker
from rocm_k3.sampling_params import SamplingParams


class Bytes:
    """A byte-level tokenizer: id = UTF-8 byte; ids >= 256 are specials that decode to nothing."""

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_detokenizer_emits_split_characters_whole() -> None:
    text = "a€b中文🙂z"
    detok = IncrementalDetokenizer(Bytes())
    pieces = [detok.push(t) for t in _ids(text)]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1:4] == ["", "", "€"]  # the 3 bytes of the euro sign come out together


def test_detokenizer_flushes_a_truncated_character() -> None:
    detok = IncrementalDetokenizer(Bytes())
    assert detok.push(0xE2) == "" and detok.push(0x82) == ""
    assert detok.flush() == "\ufffd"


def test_stop_string_split_across_tokens_cuts_the_text() -> None:
    p = SamplingParams(max_tokens=50, stop=["END"])
    chk = StopChecker(p, (), Bytes(), 50)
    decisions = [chk.push(t) for t in _ids("xyEN")]
    assert all(d.finish_reason is None for d in decisions)
    assert chk.take_text_delta() == "xy"  # "EN" could still become "END": held back
    d = chk.push(ord("D"))
    assert (d.finish_reason, d.stop_reason) == ("stop", "END")
    assert chk.text == "xy" and chk.take_text_delta() == ""


def test_held_back_text_is_released_when_it_cannot_be_a_stop() -> None:
    chk = StopChecker(SamplingParams(max_tokens=50, stop=["END"]), (), Bytes(), 50)
    out = ""
    for t in _ids("ENx"):
        chk.push(t)
        out += chk.take_text_delta()
    assert out == "E"  # "Nx" is within the holdback window of len("END") - 1
    for t in _ids("yz"):
        chk.push(t)
        out += chk.take_text_delta()
    assert out == "ENx"


def test_token_stops_and_length() -> None:
    p = SamplingParams(max_tokens=4, stop_token_ids=[9])
    chk = StopChecker(p, (0,), Bytes(), 4)
    assert chk.push(1).finish_reason is None
    assert chk.push(9).finish_reason == "stop"
    chk = StopChecker(p, (0,), Bytes(), 4)
    assert chk.push(0).finish_reason == "stop"  # eos
    chk = StopChecker(SamplingParams(ignore_eos=True, max_tokens=2), (0,), Bytes(), 2)
    assert chk.push(0).finish_reason is None and chk.push(0).finish_reason == "length"
    chk = StopChecker(SamplingParams(max_tokens=16), (), None, 3)  # capped by max_model_len
    assert [chk.push(5).finish_reason for _ in range(3)] == [None, None, "length"]
    with pytest.raises(ValueError, match="already finished"):
        chk.push(5)


def test_stop_strings_need_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        StopChecker(SamplingParams(stop=["x"]), (), None, 16)


def test_stop_check_cost_does_not_grow_with_the_output() -> None:
    calls = []

    class Counting(Bytes):
        def decode(self, ids):
            calls.append(len(ids))
            return super().decode(ids)

    chk = StopChecker(SamplingParams(max_tokens=10_000, stop=["never"]), (), Counting(), 10_000)
    for t in _ids("abc" * 1000):
        chk.push(t)
    assert max(calls) <= 8  # a short window per token, never the whole output
    assert chk.text == "abc" * 1000
