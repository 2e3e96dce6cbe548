"""Incremental output text and stop checks: split multi-byte characters, stop strings across tokens, held-back
stream text, stop/eos token ids, max_tokens, and stop strings without a tokenizer."""

from __future__ import annotations

import pytest

from rocm_k3.engine.stop import StopChecker
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.tokenizers import embedded_byte_tokenizer

TOK = embedded_byte_tokenizer()
EOM = TOK.special_tokens["<|end_of_msg|>"]


def Bytes():  # noqa: N802 (kept short: the tokenizer every test here uses)
    return TOK


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_split_characters_come_out_whole_and_specials_are_skipped_or_kept() -> None:
    text = "a€b中文🙂z"
    chk = StopChecker(SamplingParams(max_tokens=99), (), TOK, 99)
    pieces = []
    for t in _ids(text)[:2] + [EOM] + _ids(text)[2:]:
        chk.push(t)
        pieces.append(chk.take_text_delta())
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert pieces[1:5] == ["", "", "", "€"]  # the euro sign's 3 bytes come out together (the special is skipped)
    keep = StopChecker(SamplingParams(max_tokens=99, skip_special_tokens=False), (), TOK, 99)
    for t in [ord("a"), EOM, ord("b")]:
        keep.push(t)
    assert keep.text == "a<|end_of_msg|>b"


def test_a_truncated_character_is_flushed_at_the_end() -> None:
    chk = StopChecker(SamplingParams(max_tokens=2), (), TOK, 2)
    chk.push(0xE2)
    assert chk.push(0x82).finish_reason == "length"
    assert chk.text == "\ufffd"


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

    class Counting:
        special_tokens = TOK.special_tokens

        def token_bytes(self, token_id):
            calls.append(token_id)
            return TOK.token_bytes(token_id)

    chk = StopChecker(SamplingParams(max_tokens=10_000, stop=["never"]), (), Counting(), 10_000)
    for t in _ids("abc" * 1000):
        chk.push(t)
    assert len(calls) == 3000  # each token is decoded once, never the whole output again
    assert chk.text == "abc" * 1000
