"""The sampling-field table of docs/sampling.md, walked against the code and the live server (issue 31, item 3).

Each row's range is the one the code enforces (``SamplingParams.RANGES`` / the server's ``SERVER_RANGES``), every
range field of the code has a row, and on a real server every bound behaves as written: a value at a closed end is
accepted, one at an open end or just outside is a 400 whose ``param`` is the field and whose message names the
field and the range; NaN and infinities are refused. An extreme but valid value (``repetition_penalty`` 1e30)
answers normally and counts a sampler fallback in ``/metrics``.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request

import pytest

from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.entrypoints.openai.serving_common import SERVER_RANGES
from rocm_k3.sampling_params import RANGES
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import ROOT, running_server

DOC = ROOT / "docs" / "sampling.md"
CHAT_ONLY = {"max_completion_tokens", "top_logprobs", "thinking_token_budget"}
EXTRA = {"top_logprobs": {"logprobs": True}}  # what a probe of the field needs besides it
SAME_AS = {"max_completion_tokens": "max_tokens"}  # a request field checked with another field's range
MAX_LEN = 384  # the chat probe's rendered prompt is ~350 tokens
LONG_PROMPT = [5, 6, 7] * 120  # a huge max_tokens then leaves room for 24 tokens
ROW = re.compile(r"^\| `(\w+)` \| (int|number) \| `([\[(])([^,]+), ([^)\]]+)([\])])` \|")


def _bound(text: str) -> float | int:
    text = text.strip()
    if text in ("inf", "-inf"):
        return float(text)
    if text == "2**63 - 1":
        return 2**63 - 1
    return float(text) if "." in text else int(text)


def doc_rows() -> list[tuple[str, str, str, float | int, float | int, bool, bool]]:
    """(field, type, range text, lo, hi, lo_open, hi_open) of every row of the table."""
    rows = []
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            field, kind, lo_b, lo, hi, hi_b = m.groups()
            rows.append((field, kind, f"{lo_b}{lo}, {hi}{hi_b}", _bound(lo), _bound(hi), lo_b == "(", hi_b == ")"))
    return rows


def probes(kind: str, lo, hi, lo_open: bool, hi_open: bool) -> list[tuple[object, bool]]:
    """(value, accepted?) at and around both ends."""
    step = 1 if kind == "int" else 1e-3
    out: list[tuple[object, bool]] = []
    for end, is_open, outward in ((lo, lo_open, -1), (hi, hi_open, 1)):
        if end in (float("inf"), float("-inf")):
            out.append((10**9 * outward if kind == "int" else 1e30 * outward, True))  # huge but finite: fine
            if kind == "number":
                out.append((end, False))
            continue
        out.append((end, not is_open))
        out.append((end + outward * step, False))
        if is_open:
            out.append((end - outward * step, True))
    if kind == "number":
        out.append((float("nan"), False))
    return out


def test_the_doc_table_is_the_code() -> None:
    rows = {r[0]: r for r in doc_rows()}
    assert len(rows) >= 14, f"the table of {DOC} was not read: {sorted(rows)}"
    for field, (_, kind, text, *_rest) in rows.items():
        code = SERVER_RANGES.get(field) or RANGES.get(SAME_AS.get(field, field))
        assert code is not None, f"{field}: documented but not checked by the code"
        assert str(code) == text, f"{field}: the doc says {text}, the code enforces {code}"
        assert code.integer == (kind == "int"), field
    missing = (set(RANGES) | set(SERVER_RANGES)) - set(rows)
    assert not missing, f"fields with a range in the code but no row in {DOC.name}: {sorted(missing)}"


def test_probes_cover_both_ends() -> None:
    assert probes("number", 0, 1, True, False)[:5] == [(0, False), (-1e-3, False), (1e-3, True), (1, True),
                                                       (1 + 1e-3, False)]
    assert probes("int", -1, float("inf"), False, True) == [(-1, True), (-2, False), (10**9, True)]


@pytest.fixture(scope="module")
def server():
    with running_server(EngineArgs(dtype="float32", max_model_len=MAX_LEN),
                        ServerArgs(port=0, uvicorn_log_level="warning")) as srv:
        yield srv


def _post(server, route: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url(route), data=json.dumps(body).encode(),  # NaN / Infinity as Python's
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _request(field: str, value: object) -> tuple[str, dict]:
    if field in CHAT_ONLY:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        route = "/v1/chat/completions"
    else:
        prompt = LONG_PROMPT if field == "max_tokens" else "Hi"
        body, route = {"prompt": prompt, "max_tokens": 1}, "/v1/completions"
    body.update(EXTRA.get(field, {}))
    body[field] = value  # a huge max_tokens is capped by the server's max_model_len
    return route, body


@pytest.mark.parametrize("row", doc_rows(), ids=lambda r: r[0])
def test_every_documented_bound_holds_on_the_server(server, row) -> None:
    field, kind, text, lo, hi, lo_open, hi_open = row
    for value, accepted in probes(kind, lo, hi, lo_open, hi_open):
        route, body = _request(field, value)
        status, answer = _post(server, route, body)
        if accepted:
            assert status == 200, f"{field}={value!r}: {status} {answer}"
        else:
            assert status == 400, f"{field}={value!r}: {status} {answer}"
            error = answer["error"]
            if isinstance(value, float) and not math.isfinite(value):  # not JSON: refused with the body
                assert "is not a JSON number" in error["message"], (value, error)
                continue
            assert error["param"] == field, (value, error)
            assert error["message"].startswith(f"{field}: ") and text in error["message"], (value, error)


def _fallbacks(server) -> float:
    with urllib.request.urlopen(server.url("/metrics"), timeout=30) as resp:
        text = resp.read().decode()
    m = re.search(r"^rocm_k3_sampler_fallbacks_total (\S+)$", text, re.M)
    assert m, "rocm_k3_sampler_fallbacks_total is not in /metrics"
    return float(m.group(1))


def _extreme_penalty_counts_a_fallback(server) -> None:
    before = _fallbacks(server)
    # the prompt's own tokens get logits divided by 1e-300 (0 in fp32): +inf, then inf - inf = NaN in the softmax
    status, answer = _post(server, "/v1/completions", {"prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 4,
                                                       "repetition_penalty": 1e-300, "ignore_eos": True,
                                                       "temperature": 1.0, "seed": 1})
    assert status == 200, answer
    assert "\x00" not in answer["choices"][0]["text"]
    assert _fallbacks(server) > before


def test_extreme_repetition_penalty_answers_and_counts_a_fallback(server) -> None:
    _extreme_penalty_counts_a_fallback(server)


@pytest.mark.dist
@pytest.mark.slow
def test_the_fallback_count_crosses_the_rank_boundary() -> None:
    """Under -tp 2 (gloo, two CPU ranks) the sampling rank's count reaches /metrics through the step broadcast."""
    with running_server(EngineArgs(dtype="float32", max_model_len=MAX_LEN, tensor_parallel_size=2),
                        ServerArgs(port=0, uvicorn_log_level="warning")) as tp2:
        _extreme_penalty_counts_a_fallback(tp2)
