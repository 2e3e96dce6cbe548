"""docs/openai_compat.md, walked row by row against one live server (uvicorn on 127.0.0.1, the embedded tiny K3):
each endpoint listed as supported is a route of the app (and every route is listed), refused endpoints are 404s;
each field row's example merged into its endpoint's base request is answered 200 (supported, ignored) or 400
naming the field (refused); every field of the server's request models and every parameter of the ``openai``
SDK's create methods has a row, so the table cannot drift from the code."""

from __future__ import annotations

import inspect
import json
import re
import urllib.error
import urllib.request

import pytest

from rocm_k3.args import EngineArgs
from rocm_k3.entrypoints.openai.api_server import build_app
from rocm_k3.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)
from rocm_k3.entrypoints.openai.protocol_responses import ResponsesRequest
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import ROOT, serve_module

TABLE = ROOT / "docs" / "openai_compat.md"
STATUSES = ("supported", "refused", "ignored")
MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest, "/v1/responses": ResponsesRequest}


def _cells(line: str) -> list[str]:
    """A markdown table row's cells (``\\|`` is a literal pipe)."""
    parts = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [p.strip().replace("\\|", "|") for p in parts]


def _rows(lines: list[str]) -> list[list[str]]:
    return [_cells(line) for line in lines if line.startswith("|") and not line.startswith("|---")][1:]


def parse_table(text: str) -> tuple[list[list[str]], dict[str, dict]]:
    """(endpoint rows [method, path, status, notes], {path: {"base": dict, "rows": [[field, status, example,
    notes]]}})."""
    endpoints: list[list[str]] = []
    fields: dict[str, dict] = {}
    section, lines = None, []

    def close() -> None:
        if section == "endpoints":
            endpoints.extend(_rows(lines))
        elif section is not None:
            fields[section]["rows"] = _rows(lines)

    for line in text.splitlines():
        heading = re.match(r"#{2,3} (.*)", line)
        if heading:
            close()
            title, lines = heading.group(1), []
            section = "endpoints" if title == "Endpoints" else None
            match = re.fullmatch(r"POST (/\S+)", title)
            if match:
                section = match.group(1)
                fields[section] = {"base": None, "rows": []}
            continue
        base = re.fullmatch(r"Base request: `(.*)`", line)
        if base and section in fields:
            fields[section]["base"] = json.loads(base.group(1))
        lines.append(line)
    close()
    return endpoints, fields


ENDPOINTS, FIELDS = parse_table(TABLE.read_text())


@pytest.fixture(scope="module")
def server():
    yield from serve_module(EngineArgs(dtype="float32", max_model_len=1024), enable_auto_tool_choice=True)


def _call(server, method: str, route: str, body: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url(route), data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_table_is_well_formed() -> None:
    assert len(ENDPOINTS) >= 12 and set(FIELDS) == set(MODELS)
    for row in ENDPOINTS:
        assert len(row) == 4 and row[2] in STATUSES and row[3], row
    for path, section in FIELDS.items():
        assert isinstance(section["base"], dict), path
        names = [row[0] for row in section["rows"]]
        assert len(names) == len(set(names)), f"{path}: a field listed twice"
        for row in section["rows"]:
            assert len(row) == 4 and row[1] in STATUSES, (path, row)
            assert row[3] or row[1] == "supported", f"{path}: {row[0]} is {row[1]} without a reason"
            example = json.loads(row[2].strip("`"))
            assert isinstance(example, dict) and row[0].split(".")[0] in example, (path, row)


def test_every_model_field_and_sdk_parameter_has_a_row() -> None:
    import openai

    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
    sdk = {"/v1/chat/completions": client.chat.completions.create, "/v1/completions": client.completions.create,
           "/v1/responses": client.responses.create}
    for path, model in MODELS.items():
        listed = {row[0] for row in FIELDS[path]["rows"]}
        want = {f.alias or name for name, f in model.model_fields.items()}
        want |= set(model.REFUSED) | model.IGNORED
        if "stream_options" in model.model_fields:
            want |= {f"stream_options.{name}" for name in StreamOptions.model_fields}
        if path in sdk:
            want |= set(inspect.signature(sdk[path]).parameters) - {"extra_headers", "extra_query", "extra_body",
                                                                    "timeout"}
        assert want - listed == set(), f"{path}: fields without a row in {TABLE.name}"
        statuses = {row[0]: row[1] for row in FIELDS[path]["rows"]}
        assert {n for n in model.REFUSED} <= {n for n, s in statuses.items() if s == "refused"}, path
        assert model.IGNORED <= {n for n, s in statuses.items() if s == "ignored"}, path


def test_endpoints_are_the_app_routes(server) -> None:
    app = build_app(server.served)
    routes = {(method, re.sub(r":\w+}", "}", route.path)) for route in app.routes
              for method in getattr(route, "methods", ()) if method != "HEAD"}
    supported = {(m, p) for m, p, status, _ in ENDPOINTS if status == "supported"}
    assert supported == routes
    model = server.served.names[0]
    for method, path, status, _ in ENDPOINTS:
        if status == "refused":
            got, body = _call(server, method, path, {} if method == "POST" else None)
            assert got == 404 and path in json.loads(body)["error"]["message"], (method, path)
    assert _call(server, "GET", f"/v1/models/{model}")[0] == 200
    assert _call(server, "GET", "/health")[0] == 200 and _call(server, "GET", "/metrics")[0] == 200


@pytest.mark.parametrize("path", list(MODELS))
def test_each_field_row(server, path: str) -> None:
    model = server.served.names[0]
    section = FIELDS[path]
    previous = None
    failures = []
    for field, status, example, _ in section["rows"]:
        text = example.strip("`").replace("$MODEL", model)
        if "$PREVIOUS" in text:
            if previous is None:
                got, body = _call(server, "POST", "/v1/responses", {**section["base"], "store": True})
                previous = json.loads(body)["id"]
            text = text.replace("$PREVIOUS", previous)
        body = {**section["base"], **json.loads(text)}
        body = {k: v for k, v in body.items() if v is not None}
        got, answer = _call(server, "POST", path, body)
        if status == "refused":
            ok = got == 400 and json.loads(answer)["error"]["param"] == field.split(".")[0] \
                and field.split(".")[0] in json.loads(answer)["error"]["message"]
        else:
            ok = got == 200
        if not ok:
            failures.append((field, status, got, answer[:300]))
    assert failures == []
