"""``rocm-k3 generate PROMPT``: generate text with a checkpoint (default: the embedded tiny K3 model).

Every engine knob of :class:`rocm_k3.args.EngineArgs` is a flag (``--max-model-len``, ``-tp``, ``-pp``, ...). On a
multi-node run, node 0 generates and ``--node-rank N`` (N > 0) runs that node's ranks headless until node 0 ends.
"""

from __future__ import annotations

import argparse
import sys

from rocm_k3.args import EngineArgs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched by the engine)")
    parser.add_argument("--token-ids", action="store_true",
                        help="read each prompt as comma-separated token ids (for checkpoints without a tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(progress=True)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise ValueError(f"--token-ids: expected comma-separated integers, got {text!r}") from exc


def run(args: argparse.Namespace) -> int:
    from rocm_k3.engine.assembly import run_headless_node
    from rocm_k3.engine.llm import LLM
    from rocm_k3.sampling_params import SamplingParams

    # errors propagate to rocm_k3.cli.main, which prints one line (or the traceback with --debug)
    engine_args = EngineArgs.from_cli(args)
    if engine_args.node_rank > 0:
        return run_headless_node(engine_args)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    prompts = [_parse_ids(p) for p in args.prompt] if args.token_ids else list(args.prompt)
    llm = LLM.from_engine_args(engine_args)
    try:
        outputs = llm.generate(prompts, params)
        stats = llm.stats()
    finally:
        llm.shutdown()
    failed = 0
    for prompt, out in zip(args.prompt, outputs):
        print(f"prompt: {prompt!r}")
        print(f"output: {out.text!r}  [{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
        if args.show_ids or llm.tokenizer is None:
            print(f"token ids: {out.token_ids}")
        if out.finish_reason == "error":
            failed += 1
            print(f"rocm-k3 generate: error: prompt {prompt!r} failed: {out.error}", file=sys.stderr)
    if engine_args.speculative_config is not None:
        print(speculation_line(stats))
    return 1 if failed else 0


def speculation_line(stats: dict[str, float]) -> str:
    """One line of the speculative counters of ``stats``: steps, drafted / accepted tokens, acceptance."""
    per_pos = [stats[f"spec_acceptance_rate_pos{j}"] for j in range(8) if f"spec_acceptance_rate_pos{j}" in stats]
    return (f"speculative decoding: {int(stats.get('spec_num_drafts', 0))} verification steps, "
            f"{int(stats.get('spec_num_draft_tokens', 0))} drafted, {int(stats.get('spec_num_accepted_tokens', 0))} "
            f"accepted (rate {stats.get('spec_acceptance_rate', 0.0):.2f}; per position "
            f"{', '.join(f'{r:.2f}' for r in per_pos)}); mean accepted tokens per step "
            f"{stats.get('spec_mean_accepted_length', 0.0):.2f}")
