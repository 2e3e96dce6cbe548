"""``rocm-k3 train-tiny DIR``: train the embedded tiny K3 on the CPU and write its checkpoint (a developer command;
the result is committed as ``rocm_k3/model/embedded/``).

The same seed and thread count give the same files. On a shared machine run it with ``OMP_WAIT_POLICY=PASSIVE``:
spinning OpenMP threads that lose their cores to other processes make each step several times slower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="output directory (created; existing checkpoint files are overwritten)")
    parser.add_argument("--seed", type=int, default=0, help="corpus, initialisation and batch-order seed (default 0)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    parser.add_argument("--drill-steps", type=int, default=None,
                        help="first steps on copy drills only (default: the recipe's, or with --steps the "
                             "recipe's share of the steps)")
    parser.add_argument("--chats", type=int, default=None,
                        help="generated chats in the training set (default: the recipe's; the held-out set gets "
                             "one twenty-fifth as many, at least 4)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch CPU threads (default 2; results are reproducible for a fixed thread count)")
    parser.add_argument("--device", default="cpu",
                        help="where the training steps run (default cpu, which wrote the committed checkpoint; "
                             "cuda to try a recipe quickly)")
    parser.add_argument("--no-measure", dest="measure", action="store_false",
                        help="skip serving the result and measuring its behaviour")


def run(args: argparse.Namespace) -> int:
    from rocm_k3.training.recipe import TinyRecipe, train_tiny

    try:
        base = TinyRecipe()
        steps = base.train.steps if args.steps is None else args.steps
        drill_steps = args.drill_steps
        if drill_steps is None:
            drill_steps = base.train.drill_steps if args.steps is None else (
                args.steps * base.train.drill_steps // base.train.steps)
        train = dataclasses.replace(base.train, seed=args.seed, steps=steps, drill_steps=drill_steps)
        chats = {} if args.chats is None else {"chats": args.chats, "heldout_chats": max(4, args.chats // 25)}
        recipe = TinyRecipe(corpus=dataclasses.replace(base.corpus, seed=args.seed, **chats), train=train,
                            threads=args.threads)
    except ValueError as exc:
        print(f"rocm-k3 train-tiny: error: {exc}", file=sys.stderr)
        return 2
    import torch

    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, ValueError) as exc:
        print(f"rocm-k3 train-tiny: error: --device {args.device!r} is not usable here: {exc}", file=sys.stderr)
        return 2
    root = Path(args.directory)
    report = train_tiny(root, recipe, log=lambda line: print(line, flush=True), measure=args.measure,
                        device=device)
    print(json.dumps(report, indent=2, sort_keys=True))
    size = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
    print(f"wrote the trained tiny K3 checkpoint to {root} ({size / 1e6:.2f} MB)")
    return 0
