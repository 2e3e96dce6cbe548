"""``rocm-k3 train-tiny-drafter DIR``: train the hidden-state drafter of the embedded tiny K3 on the CPU and write it
(a developer command; the result is committed as ``rocm_k3/model/embedded/drafter/``, served by
``--speculative-config '{"method": "draft_model", "model": "embedded-drafter"}'``).

Seeded: the same seed and thread count give the same files. See :mod:`rocm_k3.training.drafter` for the recipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="output directory (created; existing drafter files are overwritten)")
    parser.add_argument("--seed", type=int, default=0, help="prompt, sampling, initialisation and batch seed (default 0)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts the target continues (default: the recipe's)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="target tokens generated per prompt (default: the recipe's)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch CPU threads (default 2; results are reproducible for a fixed thread count)")
    parser.add_argument("--model", default=None, help="the target checkpoint (default: the embedded tiny K3)")
    parser.add_argument("--no-measure", dest="measure", action="store_false",
                        help="skip serving the result and measuring its acceptance")


def run(args: argparse.Namespace) -> int:
    from rocm_k3.training.drafter import DrafterRecipe, train_tiny_drafter

    overrides = {name: value for name, value in (("steps", args.steps), ("prompts", args.prompts),
                                                 ("max_new_tokens", args.max_new_tokens)) if value is not None}
    try:
        recipe = dataclasses.replace(DrafterRecipe(), seed=args.seed, threads=args.threads, **overrides)
    except ValueError as exc:
        print(f"rocm-k3 train-tiny-drafter: error: {exc}", file=sys.stderr)
        return 2
    root = Path(args.directory)
    report = train_tiny_drafter(root, recipe, log=lambda line: print(line, flush=True), measure=args.measure,
                                target=args.model)
    print(json.dumps(report, indent=2, sort_keys=True))
    size = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
    print(f"wrote the drafter to {root} ({size / 1e3:.0f} KB)")
    return 0
