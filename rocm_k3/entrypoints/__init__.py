"""CLI subcommands (one module each) and the vLLM plugin."""
