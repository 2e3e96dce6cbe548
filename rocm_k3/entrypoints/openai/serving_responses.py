"""``POST /v1/responses`` (OpenAI's Responses API): the request becomes a chat (the same rendering, tool, structured
output and thinking path as ``/v1/chat/completions``, through :func:`prepare_chat`), and the parsed output becomes
Response output items: ``reasoning`` (its text in ``content``), ``message`` (one ``output_text`` part) and
``function_call`` (call_id, name, arguments).

Input items: a string is one user message; a list holds messages (``role`` user / system / developer / assistant,
content a string or ``input_text`` / ``output_text`` / ``input_image`` parts), ``function_call`` items (they join
the assistant turn before them), ``function_call_output`` items (tool messages answering a call_id) and
``reasoning`` items (the next assistant turn's reasoning). ``instructions`` is a system message in front;
``previous_response_id`` puts the stored conversation of that response (its output included) in front of the new
input. Streaming sends OpenAI's typed events (``event:`` + ``data:``, each with a ``sequence_number``), ending in
``response.completed``, ``response.incomplete`` (the token budget ran out: ``incomplete_details.reason`` is
"max_output_tokens") or ``response.failed``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from pydantic import ValidationError

from rocm_k3.entrypoints.openai.errors import APIError, from_validation_error
from rocm_k3.entrypoints.openai.protocol import ChatCompletionRequest
from rocm_k3.entrypoints.openai.protocol_responses import ResponsesRequest
from rocm_k3.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from rocm_k3.entrypoints.openai.serving_chat import ChatRun, prepare_chat
from rocm_k3.entrypoints.openai.serving_common import ServedModel, collect, merge_streams
from rocm_k3.formats.parsers import ToolCall

INPUT_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request -> chat ------------------------------------------------------------------------------------------
def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: expected a string or a list of content parts", param="input")
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(400, f"{where}[{k}].image_url: expected a URL string (file_id is not supported)",
                               param="input")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise APIError(400, f"{where}[{k}]: expected an input_text, output_text or input_image part with its "
                                f"text / image_url, got type {kind!r}", param="input")
    return parts


def _reasoning_text(item: Mapping[str, Any]) -> str:
    pieces = [p.get("text", "") for p in item.get("content") or [] if isinstance(p, Mapping)]
    if not pieces:
        pieces = [p.get("text", "") for p in item.get("summary") or [] if isinstance(p, Mapping)]
    return "".join(p for p in pieces if isinstance(p, str))


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (400 naming the item that cannot be one)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or reasoning is not None:
            last = {"role": "assistant", "content": None}
            if reasoning is not None:
                last["reasoning_content"], reasoning = reasoning, None
            messages.append(last)
        return last

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = INPUT_ROLES.get(item.get("role"))
            if role is None:
                raise APIError(400, f"{where}.role: expected one of {', '.join(INPUT_ROLES)}, got "
                                    f"{item.get('role')!r}", param="input")
            content = _content(item.get("content"), f"{where}.content")
            if role == "assistant":
                message = assistant()
                text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
                message["content"] = (message["content"] or "") + text
            else:
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) and v for v in (name, call_id)) or not isinstance(args, str):
                raise APIError(400, f"{where}: a function_call needs string call_id, name and arguments",
                               param="input")
            message = assistant()
            message.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise APIError(400, f"{where}.call_id: expected a string", param="input")
            if not isinstance(output, str):
                output = json.dumps(output, ensure_ascii=False)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        else:
            raise APIError(400, f"{where}.type: expected message, function_call, function_call_output or "
                                f"reasoning, got {kind!r}", param="input")
    if reasoning is not None:  # a trailing reasoning item: the assistant turn it belongs to follows
        messages.append({"role": "assistant", "content": None, "reasoning_content": reasoning})
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}].type: only function tools are served, got {tool.get('type')!r}",
                           param="tools")
        if "function" in tool:  # the chat API's shape, accepted too
            out.append({"type": "function", "function": tool["function"]})
            continue
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice: expected auto, none, required or {type: function, name}",
                           param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, f"text.format: expected an object with a type, got {type(fmt).__name__}",
                       param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), (dict, bool)):
            raise APIError(400, "text.format.schema: a JSON-schema object is required for type json_schema",
                           param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    raise APIError(400, f"text.format.type: expected text, json_object or json_schema, got {fmt.get('type')!r}",
                   param="text.format")


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that renders and runs ``req`` (``messages``: the whole conversation)."""
    effort = (req.reasoning or {}).get("effort")
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "tools": _tools(req.tools), "tool_choice": _tool_choice(
            req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text), "max_completion_tokens": req.max_output_tokens,
        "reasoning_effort": effort, "chat_template_kwargs": req.chat_template_kwargs,
        "thinking_token_budget": req.thinking_token_budget, "user": req.user, "ignore_eos": req.ignore_eos,
        "kv_transfer_params": req.kv_transfer_params,
    }
    for key in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                "repetition_penalty"):
        body[key] = getattr(req, key)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:  # a field of this request with a type the chat request refuses
        raise from_validation_error(exc) from None


# ---- output -> Response ---------------------------------------------------------------------------------------
def reasoning_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: ToolCall, item_id: str, arguments: str | None = None, status: str = "completed"
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments_json if arguments is None else arguments, "status": status}


class ResponsesRun:
    """One validated Responses request over its :class:`ChatRun`."""

    def __init__(self, served: ServedModel, store: ResponseStore, req: ResponsesRequest,
                 messages: list[dict[str, Any]], chat: ChatRun) -> None:
        self.served, self.store, self.req, self.messages, self.chat = served, store, req, messages, chat
        self.id = _item_id("resp")
        self.created_at = int(time.time())

    def body(self, status: str, output: list[dict[str, Any]], usage: dict | None = None,
             error: dict | None = None) -> dict[str, Any]:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.chat.model, "output": output, "instructions": req.instructions,
            "tools": req.tools or [], "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "text": {"format": fmt}, "metadata": req.metadata or {}, "store": req.store,
            "background": req.background, "truncation": "disabled", "user": req.user, "usage": usage,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        }

    def _usage(self, output_ids: list[int], cached: int, reasoning: str | None) -> dict[str, Any]:
        tok = self.served.tokenizer
        thought = len(tok.encode(reasoning)) if reasoning and tok is not None else 0  # the reasoning text re-encoded
        prompt = len(self.chat.prompt)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": len(output_ids), "output_tokens_details": {"reasoning_tokens": thought},
                "total_tokens": prompt + len(output_ids)}

    def _finish(self, body: dict[str, Any], reasoning: str | None, content: str | None,
                calls: list[ToolCall]) -> dict[str, Any]:
        """Store the finished response with its conversation (for previous_response_id); returns ``body``."""
        if self.req.store:
            turn: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                turn["reasoning_content"] = reasoning
            if calls:
                turn["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]
            item = self.store.get(self.id) or StoredResponse(body, [])
            item.body, item.messages, item.task = body, self.messages + [turn], None
            self.store.put(self.id, item)
        return body

    async def respond(self) -> dict[str, Any]:
        streams = await self.chat._streams()
        choice = (await collect(self.served, streams))[0]
        parsed = self.chat.prepared.parse(choice.text, call_id_prefix=self.chat._call_prefix(0))
        output = []
        if parsed.reasoning:
            output.append(reasoning_item(parsed.reasoning, _item_id("rs")))
        if parsed.content:
            output.append(message_item(parsed.content, _item_id("msg")))
        output += [call_item(c, _item_id("fc")) for c in parsed.tool_calls]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        body = self.body(status, output, self._usage(choice.token_ids, choice.cached, parsed.reasoning))
        if choice.kv_transfer_params:  # a kv_producer's answer: where a decode instance fetches the prompt's cache
            body["kv_transfer_params"] = choice.kv_transfer_params
        return self._finish(body, parsed.reasoning, parsed.content, parsed.tool_calls)

    def start_background(self) -> dict[str, Any]:
        """Run in the background; the stored body is "in_progress" until it ends (GET it, or cancel it)."""
        body = self.body("in_progress", [])
        task = asyncio.ensure_future(self._background())
        self.store.put(self.id, StoredResponse(body, self.messages, task))
        return body

    async def _background(self) -> None:
        try:
            await self.respond()
        except asyncio.CancelledError:
            item = self.store.get(self.id)
            if item is not None:
                item.body, item.task = self.body("cancelled", []), None
            raise
        except APIError as exc:
            item = self.store.get(self.id)
            if item is not None:
                item.body = self.body("failed", [], error={"code": "server_error", "message": exc.message})
                item.task = None

    async def stream(self) -> AsyncIterator[str]:
        streams = await self.chat._streams()
        return self._events(streams)

    async def _events(self, streams) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events.send("response.created", response=self.body("in_progress", []))
        yield events.send("response.in_progress", response=self.body("in_progress", []))
        parser = self.chat.prepared.parser(self.chat._call_prefix(0))
        out = _OutputBuilder(events)
        token_ids: list[int] = []
        try:
            async for _i, delta in merge_streams(streams):
                token_ids += delta.new_token_ids
                if delta.finish_reason == "error":
                    raise APIError(500, f"generation failed: {delta.error}")
                parsed = parser.feed(delta.new_text)
                pieces = [parsed]
                if delta.finished:
                    pieces.append(parser.finish())
                for p in pieces:
                    for chunk in out.add(p, self.chat.prepared, _item_id):
                        yield chunk
                if delta.finished:
                    for chunk in out.close():
                        yield chunk
                    cached = delta.output.num_cached_tokens if delta.output is not None else 0
                    status = "incomplete" if delta.finish_reason == "length" else "completed"
                    body = self.body(status, out.items, self._usage(token_ids, cached, out.reasoning or None))
                    self._finish(body, out.reasoning or None, out.content or None, out.calls)
                    yield events.send(f"response.{status}", response=body)
                    return
        except APIError as exc:
            body = self.body("failed", out.items, error={"code": "server_error", "message": exc.message})
            yield events.send("response.failed", response=body)


class _EventWriter:
    """Server-sent events of the Responses API, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def send(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _OutputBuilder:
    """The output items of a streamed response as parsed deltas arrive: the open reasoning or message item grows
    with text deltas; a channel change closes it; each tool call is one function_call item."""

    def __init__(self, events: _EventWriter) -> None:
        self.events = events
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None  # "reasoning" / "message"
        self.text = ""
        self.reasoning = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self.call_items: dict[int, int] = {}  # the parser's call index -> its output index

    def _index(self) -> int:
        return len(self.items) - 1

    def _start(self, kind: str, new_id) -> list[str]:
        out = self.close()
        item = reasoning_item("", new_id("rs"), "in_progress") if kind == "reasoning" else \
            message_item("", new_id("msg"), "in_progress")
        self.items.append(item)
        self.open, self.text = kind, ""
        out.append(self.events.send("response.output_item.added", output_index=self._index(), item=item))
        if kind == "message":
            out.append(self.events.send("response.content_part.added", item_id=item["id"],
                                        output_index=self._index(), content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        item, index, send = self.items[-1], self._index(), self.events.send
        item["status"] = "completed"
        item["content"][0]["text"] = self.text
        if self.open == "reasoning":
            out = [send("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=self.text)]
        else:
            out = [send("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=self.text, logprobs=[]),
                   send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=item["content"][0])]
        out.append(send("response.output_item.done", output_index=index, item=item))
        self.open = None
        return out

    def _text(self, kind: str, text: str, new_id) -> list[str]:
        out = self._start(kind, new_id) if self.open != kind else []
        self.text += text
        item = self.items[-1]
        if kind == "reasoning":
            self.reasoning += text
            out.append(self.events.send("response.reasoning_text.delta", item_id=item["id"],
                                        output_index=self._index(), content_index=0, delta=text))
        else:
            self.content += text
            out.append(self.events.send("response.output_text.delta", item_id=item["id"],
                                        output_index=self._index(), content_index=0, delta=text, logprobs=[]))
        return out

    def add(self, parsed, prepared, new_id) -> list[str]:
        out: list[str] = []
        if parsed.reasoning:
            out += self._text("reasoning", parsed.reasoning, new_id)
        if parsed.content:
            out += self._text("message", parsed.content, new_id)
        for d in prepared.allowed_call_deltas(parsed.call_deltas):
            send = self.events.send
            if d.id is not None:  # a call starts: its item, then its argument pieces
                out += self.close()
                item = {"type": "function_call", "id": new_id("fc"), "call_id": d.id, "name": d.name,
                        "arguments": "", "status": "in_progress"}
                self.items.append(item)
                self.call_items[d.index] = len(self.items) - 1
                out.append(send("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
            index = self.call_items[d.index]
            item = self.items[index]
            if d.arguments:
                item["arguments"] += d.arguments
                out.append(send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=d.arguments))
        for call in prepared.allowed_calls(parsed.tool_calls, len(self.calls)):
            self.calls.append(call)
            index = self.call_items.get(call.index)
            if index is None:  # an undeclared function: not streamed
                continue
            item, send = self.items[index], self.events.send
            item["status"] = "completed"
            out.append(send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=call.name, arguments=item["arguments"]))
            out.append(send("response.output_item.done", output_index=index, item=item))
        return out


def conversation(store: ResponseStore, req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of a Responses request: the previous response's (``previous_response_id``), the
    ``instructions`` as a system message (marked ``_instructions``), then ``input``; 404 / 400 when they cannot be."""
    messages: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise APIError(404, f"previous_response_id: no stored response {req.previous_response_id!r} (it was "
                                "never stored, was deleted, or left the store)", param="previous_response_id")
        if previous.task is not None:
            raise APIError(400, f"previous_response_id: {req.previous_response_id!r} has not finished",
                           param="previous_response_id")
        messages += [m for m in previous.messages if not (m["role"] == "system" and m.get("_instructions"))]
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions, "_instructions": True})
    return messages + input_messages(req.input)


def prepare_responses(served: ServedModel, store: ResponseStore, req: ResponsesRequest,
                      remote: dict[str, bytes] | None = None) -> ResponsesRun:
    """Check and render a Responses request (400 / 404 before any output); ``remote``: its fetched http(s)
    images (``fetch_remote_images`` over :func:`conversation`)."""
    if req.background and not req.store:
        raise APIError(400, "background: needs store=true (the result is fetched with GET /v1/responses/{id})",
                       param="background")
    if req.background and req.stream:
        raise APIError(400, "background: streaming a background response is not supported; poll GET "
                            "/v1/responses/{id} instead", param="background")
    messages = conversation(store, req)
    try:
        chat = prepare_chat(served, chat_request(req, [{k: v for k, v in m.items() if k != "_instructions"}
                                                       for m in messages]), remote)
    except APIError as exc:  # the chat request's field names -> this request's
        for chat_field, field in _CHAT_FIELDS:
            if exc.message.startswith(chat_field):
                raise APIError(exc.status, field + exc.message[len(chat_field):], param=field) from None
        raise
    return ResponsesRun(served, store, req, messages, chat)


_CHAT_FIELDS = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
                ("max_completion_tokens", "max_output_tokens"), ("reasoning_effort", "reasoning.effort"))
