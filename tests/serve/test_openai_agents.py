"""``openai-agents`` (the pinned test extra) driving the real server on 127.0.0.1 with the embedded model: an
``Agent`` with a ``@function_tool``, run by ``Runner`` through ``OpenAIResponsesModel`` (streamed, ``POST
/v1/responses``) and ``OpenAIChatCompletionsModel`` (``POST /v1/chat/completions``), tracing off.

The embedded model is tiny: with ``tool_choice="auto"`` it writes a call in some sampled seeds only (measured at
temperature 1: 2 of 4 seeds, one of them with the asked city and then calling again until ``max_turns``), so the agent asks for ``tool_choice="required"``
(greedy, ``reasoning.effort="none"``); the SDK resets the choice after the call, so the second turn reads the
tool's output and answers in text. The city the model writes is not the asked one (its arguments are its own
words); what is checked is the protocol: the function ran once with the arguments parsed from the model's call,
its output went back as the ``function_call_output`` and the run ended with a final text output."""

from __future__ import annotations

import asyncio
import json

import agents  # openai-agents, pinned in the test extra
import pytest
from openai.types.shared import Reasoning

from rocm_k3.args import EngineArgs, ServerArgs
from tests.server_fixtures import running_server

QUESTION = "What's the weather in Paris?"


@pytest.fixture(scope="module")
def server():
    agents.set_tracing_disabled(True)  # no trace export to an outside address
    with running_server(EngineArgs(dtype="float32", max_model_len=2048),
                        ServerArgs(port=0, enable_auto_tool_choice=True, uvicorn_log_level="warning")) as srv:
        yield srv


def _weather_agent(model) -> tuple[agents.Agent, list[str]]:
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        calls.append(city)
        return json.dumps({"city": city, "temperature_c": 21, "condition": "sunny"})

    settings = agents.ModelSettings(tool_choice="required", temperature=0.0, max_tokens=400,
                                    reasoning=Reasoning(effort="none"))
    return agents.Agent(name="weather", tools=[get_weather], model=model, model_settings=settings), calls


async def _run_both(server):
    name = server.served.names[0]
    client = server.async_client()
    by_responses, responses_calls = _weather_agent(agents.OpenAIResponsesModel(name, client))
    by_chat, chat_calls = _weather_agent(agents.OpenAIChatCompletionsModel(name, client))

    async def streamed():
        run = agents.Runner.run_streamed(by_responses, QUESTION, max_turns=3)
        kinds = [event.type async for event in run.stream_events()]
        assert "raw_response_event" in kinds  # the SSE stream of /v1/responses reached the SDK
        return run

    # both runs at once: the engine batches them (greedy outputs do not depend on the batch)
    ran = await asyncio.gather(streamed(), agents.Runner.run(by_chat, QUESTION, max_turns=3))
    return list(zip(ran, (responses_calls, chat_calls), ("responses", "chat")))


def test_agent_function_tool_round_trip(server) -> None:
    for result, calls, api in asyncio.run(_run_both(server)):
        items = result.new_items
        tool_calls = [i for i in items if isinstance(i, agents.ToolCallItem)]
        outputs = [i for i in items if isinstance(i, agents.ToolCallOutputItem)]
        assert len(tool_calls) == 1 and len(outputs) == 1, (api, items)
        call = tool_calls[0].raw_item
        assert call.name == "get_weather" and call.call_id, (api, call)
        # the function ran once, with the arguments the model wrote (parsed by the server into JSON)
        args = json.loads(call.arguments)
        assert set(args) == {"city"} and calls == [args["city"]], (api, call, calls)
        assert outputs[0].raw_item["call_id"] == call.call_id
        assert json.loads(outputs[0].output)["city"] == args["city"]
        # second turn: the model read the tool's output and answered in text
        assert isinstance(result.final_output, str) and result.final_output.strip(), (api, items)
        assert isinstance(items[-1], agents.MessageOutputItem), (api, items)
        assert len(result.raw_responses) == 2, api
