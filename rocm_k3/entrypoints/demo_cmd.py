"""``rocm-k3 demo`` (``make demo``): what the embedded tiny K3 does, in three parts.

1. A chat turn in K3's XTML format: the prompt as the chat renderer writes it and the model's completion, with
   its think / response channels and the end-of-message marker.
2. The same turn parsed: its reasoning (the think channel) and its answer (the response channel).
3. A tool call: ``get_weather`` declared, the model writes a call in XTML and the parser turns it into OpenAI
   ``tool_calls`` JSON. The turn is sampled (``--seed``); when that sample holds no call, the turn is run again with
   ``tool_choice="required"`` (the grammar forces a call) and the demo says so.

Every engine flag is accepted (``--model DIR`` runs the demo on another checkpoint).
"""

from __future__ import annotations

import argparse
import json

from rocm_k3.args import EngineArgs

RULE = "=" * 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--question", default="What is 12 + 7?", help="the chat turn of parts 1 and 2")
    parser.add_argument("--tool-question", default="What's the weather in Paris?", help="the tool turn of part 3")
    parser.add_argument("--seed", type=int, default=10, help="sampling seed of the tool turn (temperature 1)")
    EngineArgs.add_cli_args(parser)


def _section(title: str) -> None:
    print(f"\n{RULE}\n{title}\n{RULE}")


def run(args: argparse.Namespace) -> int:
    from rocm_k3.engine.chat import ChatRequest
    from rocm_k3.engine.llm import LLM
    from rocm_k3.sampling_params import SamplingParams
    from rocm_k3.training.chats import WEATHER_TOOL

    llm = LLM.from_engine_args(EngineArgs.from_cli(args))
    try:
        messages = [{"role": "user", "content": args.question}]
        turn = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=300))[0]
        prompt = llm.frontend.prepare_chat(ChatRequest(messages)).prompt_text
        _section("1. A chat turn in K3's XTML format (the rendered prompt, then the model's completion)")
        print(prompt + turn.output.text)

        _section("2. The turn parsed: reasoning and answer")
        print(f"reasoning: {turn.reasoning_content!r}")
        print(f"answer:    {turn.content!r}   [finish_reason={turn.finish_reason}]")
        print("(the embedded model has 2.2 M parameters: its markup is well formed, its arithmetic is not)")

        tool_turn = [{"role": "user", "content": args.tool_question}]
        sampled = SamplingParams(temperature=1.0, seed=args.seed, max_tokens=400)
        called = llm.chat(tool_turn, sampled, tools=[WEATHER_TOOL], tool_choice="auto")[0]
        how = f"tool_choice auto, seed {args.seed}"
        if not called.tool_calls:
            called = llm.chat(tool_turn, sampled, tools=[WEATHER_TOOL], tool_choice="required")[0]
            how = f"seed {args.seed} wrote no call with tool_choice auto; tool_choice required"
        _section(f"3. A tool call parsed into JSON ({WEATHER_TOOL['function']['name']} declared; {how})")
        print(f"user:        {args.tool_question}")
        print(f"model wrote: {called.output.text}")
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.name, "arguments": json.loads(c.arguments_json)}} for c in called.tool_calls]
        print("tool_calls:  " + json.dumps(calls, indent=2).replace("\n", "\n             "))
    finally:
        llm.shutdown()
    return 0 if calls else 1
