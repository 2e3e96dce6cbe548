"""Chat requests around an engine: the prompt, the constraint a request needs, and its parsed output.

Shared by :meth:`rocm_k3.LLM.chat` and the server's ``/v1/chat/completions``. :class:`ModelFrontend` holds what the
request side knows of a served model (tokenizer, chat renderer, output family); :meth:`ModelFrontend.prepare_chat`
turns a :class:`ChatRequest` into a :class:`PreparedChat`:

- the prompt, rendered with the checkpoint's chat format (tools declared, tool_choice / response_format notes,
  thinking on or off from ``chat_template_kwargs`` / ``reasoning_effort``);
- the grammar: ``tool_choice`` "required" or a named function -> a tool-call constraint over the family's tool
  grammar; ``response_format`` json_object / json_schema or ``structured_outputs`` -> that constraint (at most
  one of them); every constraint is checked here (ValueError naming the field), the worker compiles it;
- the sampling changes: special tokens kept in the text (the parsers read the markers), the constraint, and
  whether the prompt ended inside think (the grammar and the thinking budget start after the reasoning);
- the parser options, so that the text parses into reasoning, content and tool calls, whole or streamed.

Tool choice follows vLLM: with tools, the default is "auto", which a server only serves with
``--enable-auto-tool-choice``; "none" keeps tool markup as text; "required" and named choices are enforced by the
grammar, with the calls right away (no content before them, as OpenAI's forced tool choices return none).
``parallel_tool_calls=False`` allows one call (the grammar for required/named, the first parsed call
otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rocm_k3.engine.outputs import RequestOutput
from rocm_k3.formats.parsers import ParsedOutput, StreamParser, ToolCall, parse_output
from rocm_k3.formats.parsers.types import ToolCallDelta, named_tool_choice, tool_names
from rocm_k3.sampling_params import RANGES, SamplingParams
from rocm_k3.formats import load_chat_renderer, thinking_options
from rocm_k3.formats.chat_base import DEFAULT_EFFORT_BUDGETS, SCHEMA_FIELD, response_format_kind

STRUCTURED_OUTPUT_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """One conversation and its options (OpenAI chat-completions fields)."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: Mapping[str, Any] | None = None
    structured_outputs: Any = None  # a request object ({"regex": ...}) or a StructuredOutputs
    chat_template_kwargs: Mapping[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking_token_budget: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclasses.dataclass(frozen=True)
class PreparedChat:
    """A rendered chat: the prompt, the constraint (None = free text) and how to parse the output.

    thinking: the output has a reasoning channel; prompt_in_think: the prompt ended inside it.
    image_positions: where each image part's block goes in ``prompt_token_ids`` (``RenderedChat.image_positions``;
    the ids hold nothing for an image): pass them with the images to ``MultiModalProcessor.process_images``.
    """

    prompt_token_ids: list[int]
    prompt_text: str
    family: str
    thinking: bool
    prompt_in_think: bool
    constraint: Any
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: Any
    parallel_tool_calls: bool
    thinking_token_budget: int | None
    image_positions: tuple[int, ...] = ()

    def sampling_changes(self) -> dict[str, Any]:
        """The SamplingParams fields the chat sets (see the module docstring)."""
        return {"skip_special_tokens": False, "structured_outputs": self.constraint,
                "prompt_in_think": self.prompt_in_think,
                "thinking_token_budget": self.thinking_token_budget if self.prompt_in_think else None}

    def sampling(self, base: SamplingParams) -> SamplingParams:
        """``base`` (a caller's SamplingParams) with the chat's changes."""
        return dataclasses.replace(base, **self.sampling_changes())

    def parser(self, call_id_prefix: str = "call_") -> StreamParser:
        return StreamParser(self.family, tools=self.tools, tool_choice=self.tool_choice, thinking=self.thinking,
                            prompt_in_think=self.prompt_in_think, call_id_prefix=call_id_prefix)

    def parse(self, text: str, call_id_prefix: str = "call_") -> ParsedOutput:
        parsed = parse_output(self.family, text, tools=self.tools, tool_choice=self.tool_choice,
                              thinking=self.thinking, prompt_in_think=self.prompt_in_think,
                              call_id_prefix=call_id_prefix)
        parsed.tool_calls = self.allowed_calls(parsed.tool_calls, 0)
        return parsed

    def allowed_call_deltas(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        """The streamed call pieces of the calls :meth:`allowed_calls` keeps (the first only without parallel
        calls)."""
        return deltas if self.parallel_tool_calls else [d for d in deltas if d.index == 0]

    def allowed_calls(self, calls: list[ToolCall], num_before: int) -> list[ToolCall]:
        """``calls`` after ``num_before`` earlier ones, cut to one call in all when parallel calls are off."""
        if self.parallel_tool_calls:
            return calls
        return calls[: max(0, 1 - num_before)]


@dataclasses.dataclass
class ChatOutput:
    """One chat completion: the engine's output and the parsed message.

    finish_reason: the engine's, except "tool_calls" when the turn stopped with tool calls.
    """

    output: RequestOutput
    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str


def chat_finish_reason(engine_reason: str, has_tool_calls: bool) -> str:
    return "tool_calls" if has_tool_calls and engine_reason == "stop" else engine_reason


def structured_outputs_from(value: Mapping[str, Any] | None, field: str = "structured_outputs"):
    """A ``structured_outputs`` request object (``{"json": ...}``, ``{"regex": ...}``, ...) as StructuredOutputs."""
    if value is None:
        return None
    from rocm_k3.structured import StructuredOutputs
    from rocm_k3.structured.schema_keywords import check_schema_keywords

    if isinstance(value, StructuredOutputs):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{field}: expected an object, got {type(value).__name__}")
    given = {k: v for k, v in value.items() if v is not None and not (v is False and k != "json")}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUT_KEYS))
    if unknown:
        raise ValueError(f"{field}: unknown keys {unknown}; expected one of {list(STRUCTURED_OUTPUT_KEYS)}")
    try:
        out = StructuredOutputs(**given)
    except ValueError as exc:
        raise ValueError(f"{field}.{exc}") from None
    if out.kind == "json":  # named by the request's field here; the compiler checks again (LLM.generate)
        check_schema_keywords(out.json, f"{field}.json" if field == "structured_outputs" else field)
    return out


def response_format_constraint(response_format: Mapping[str, Any] | None):
    """``response_format`` json_object / json_schema as StructuredOutputs (None for text or no format)."""
    checked = response_format_kind(response_format)
    if checked is None:
        return None
    from rocm_k3.structured import StructuredOutputs
    from rocm_k3.structured.schema_keywords import check_schema_keywords

    kind, schema = checked
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    try:
        out = StructuredOutputs(json=schema)
    except ValueError as exc:
        raise ValueError(f"{SCHEMA_FIELD}: {exc}") from None
    check_schema_keywords(out.json, SCHEMA_FIELD)
    return out


class ModelFrontend:
    """The request side of a served model (see the module docstring).

    family: the output family ("kimi_k3" / "kimi_k2") or None (no tools, reasoning parsing or grammars).
    """

    def __init__(self, path: Path, tokenizer: Any, family: str | None,
                 effort_budgets: Mapping[str, int] | None = None) -> None:
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.family = family
        self.effort_budgets = dict(DEFAULT_EFFORT_BUDGETS if effort_budgets is None else effort_budgets)
        self.chat_template: tuple[str, str] | None = None  # (Jinja text, where it came from): --chat-template

    @functools.cached_property
    def renderer(self):
        """The chat renderer: ``chat_template`` (``--chat-template``) when set, else the checkpoint's; None without
        a tokenizer or a chat format."""
        if self.chat_template is not None and self.tokenizer is not None:
            from rocm_k3.formats import K2ChatRenderer

            return K2ChatRenderer(self.tokenizer, self.chat_template[0], source=self.chat_template[1])
        return load_chat_renderer(self.path, self.tokenizer)

    @functools.cached_property
    def _family_tokens(self):
        from rocm_k3.structured.vocab import family_tokens

        return family_tokens(self.tokenizer, self.family)

    def check_sampling(self, params: SamplingParams) -> None:
        """ValueError naming the problem when the worker could not serve ``params``' constraint."""
        if params.structured_outputs is None and params.thinking_token_budget is None:
            return
        if self.tokenizer is None:
            raise ValueError("structured_outputs: this checkpoint has no tokenizer, which the grammar needs")
        if self.family is None:
            raise ValueError("structured_outputs: this checkpoint has no output family; serve it with "
                             "--tool-call-parser/--reasoning-parser")
        if params.structured_outputs is not None:
            from rocm_k3.structured import check_spec

            check_spec(params.structured_outputs, self._family_tokens)

    def prepare_chat(self, request: ChatRequest, *, enable_auto_tool_choice: bool = True,
                     allow_images: bool = False) -> PreparedChat:
        """Render and check one chat request (ValueError naming the field on bad input).

        allow_images: the caller runs the image parts (``PreparedChat.image_positions`` + the decoded images through
        ``MultiModalProcessor.process_images``); otherwise a request with image parts is refused rather than run
        without its images.
        """
        renderer = self.renderer
        if renderer is None:
            raise ValueError(f"{self.path} has no tokenizer or chat format; chat requests are not available "
                             "(send token ids to the completions API)")
        tools = list(request.tools) if request.tools else None
        tool_choice = _tool_choice(tools, request.tool_choice, enable_auto_tool_choice)
        if not isinstance(request.parallel_tool_calls, bool):
            raise ValueError(f"parallel_tool_calls: expected a bool, got {request.parallel_tool_calls!r}")
        if tools:
            from rocm_k3.structured.tool_schemas import check_tool_schemas

            check_tool_schemas(tools)  # for every tool_choice: auto shows the schemas to the model too
        constraint = _constraint(tools, tool_choice, request)
        if (tools or constraint is not None) and self.family is None:
            raise ValueError("tools / structured output: this checkpoint has no output family; serve it with "
                             "--tool-call-parser/--reasoning-parser")
        if constraint is not None:
            from rocm_k3.structured import check_spec

            check_spec(constraint, self._family_tokens)
        options = thinking_options(request.chat_template_kwargs, request.reasoning_effort)
        rendered = renderer.render(request.messages, tools=tools, tool_choice=tool_choice,
                                   response_format=request.response_format, thinking=options.thinking,
                                   thinking_effort=options.effort, add_generation_prompt=request.add_generation_prompt,
                                   continue_final_message=request.continue_final_message)
        if rendered.image_positions and not allow_images:
            raise ValueError(f"messages: {len(rendered.image_positions)} image part(s), but this chat path does not "
                             "take images yet (LLM.generate takes them: prompt_token_ids + image_positions + "
                             "multi_modal_data)")
        budget = request.thinking_token_budget
        if budget is None and options.thinking is not False:
            budget = self.effort_budgets.get(request.reasoning_effort)  # the effort's default think budget
        if budget is not None:
            RANGES["thinking_token_budget"].check("thinking_token_budget", budget)  # ValueError naming the range
        return PreparedChat(
            prompt_token_ids=list(rendered.token_ids), prompt_text=rendered.text, family=self.family or renderer.family,
            thinking=options.thinking is not False, prompt_in_think=rendered.prompt_in_think, constraint=constraint,
            tools=tools, tool_choice=tool_choice, parallel_tool_calls=request.parallel_tool_calls,
            thinking_token_budget=budget, image_positions=tuple(rendered.image_positions))


def _tool_choice(tools: list | None, tool_choice: Any, enable_auto: bool) -> Any:
    names = tool_names(tools)
    forced = named_tool_choice(tool_choice)  # ValueError for a malformed choice
    if not names:
        if tool_choice in (None, "none", "auto"):
            return None
        raise ValueError(f"tool_choice: {tool_choice!r} needs a non-empty tools list")
    if forced is not None and forced not in names:
        raise ValueError(f"tool_choice: function {forced!r} is not in tools {list(names)}")
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice == "auto" and not enable_auto:
        raise ValueError('tool_choice: "auto" needs the server to run with --enable-auto-tool-choice')
    return tool_choice


def _constraint(tools: list | None, tool_choice: Any, request: ChatRequest):
    """The one grammar of a chat request, or None."""
    formatted = response_format_constraint(request.response_format)
    extension = structured_outputs_from(request.structured_outputs)
    if formatted is not None and extension is not None:
        raise ValueError("structured_outputs: cannot be combined with a json response_format")
    content = formatted if formatted is not None else extension
    if tools and tool_choice not in (None, "auto", "none"):
        if content is not None:
            raise ValueError("tool_choice: a required or named tool choice cannot be combined with "
                             "response_format / structured_outputs")
        from rocm_k3.structured import StructuredOutputs, tool_call_constraint

        return StructuredOutputs(tools=tool_call_constraint(tools, tool_choice, request.parallel_tool_calls,
                                                            allow_text=False))
    return content
