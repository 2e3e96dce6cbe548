"""``rocm-k3 generate PROMPT``: generate text with a checkpoint (default: the embedded tiny K3 model)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched by the engine)")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny K3 model)")
    parser.add_argument("--token-ids", action="store_true",
                        help="read each prompt as comma-separated token ids (for checkpoints without a tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32", "float16"),
                        help="auto (default): bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--backend", default=None, help="op backend (reference, triton, flydsl, aiter; default auto)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--moe-act-quant", default="bf16", choices=("bf16", "mxfp8"),
                        help="routed-expert activations: bf16 (A16W4, default) or mxfp8 (A8W4)")
    parser.add_argument("--device", default=None, help="torch device (default: first GPU, else cpu)")
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    engine = parser.add_argument_group("engine and cache")
    engine.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="turn KDA-aware prefix caching off (on by default; outputs are identical either way)")
    engine.add_argument("--block-size", type=int, default=None, help="MLA KV page size in tokens")
    engine.add_argument("--max-num-seqs", type=int, default=None, help="sequences running at once")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="new tokens per engine step")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise ValueError(f"--token-ids: expected comma-separated integers, got {text!r}") from exc


def run(args: argparse.Namespace) -> int:
    from rocm_k3.engine.llm import LLM
    from rocm_k3.sampling_params import SamplingParams

    # errors propagate to rocm_k3.cli.main, which prints one line (or the traceback with --debug)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    prompts = [_parse_ids(p) for p in args.prompt] if args.token_ids else list(args.prompt)
    knobs = {name: getattr(args, name) for name in ("block_size", "max_num_seqs", "max_num_batched_tokens")
             if getattr(args, name) is not None}
    llm = LLM(args.model, dtype=args.dtype, backend=args.backend, max_model_len=args.max_model_len,
              device=args.device, progress=True, moe_act_quant=args.moe_act_quant,
              enable_prefix_caching=args.prefix_caching, **knobs)
    outputs = llm.generate(prompts, params)
    failed = 0
    for prompt, out in zip(args.prompt, outputs):
        print(f"prompt: {prompt!r}")
        print(f"output: {out.text!r}  [{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
        if args.show_ids or llm.tokenizer is None:
            print(f"token ids: {out.token_ids}")
        if out.finish_reason == "error":
            failed += 1
            print(f"rocm-k3 generate: error: prompt {prompt!r} failed: {out.error}", file=sys.stderr)
    return 1 if failed else 0
