"""The OpenAI-compatible surface: output parsers (reasoning, tool calls) for the served model families."""
