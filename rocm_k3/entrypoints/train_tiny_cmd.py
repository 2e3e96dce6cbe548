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
    parser.add_argument("--chats", type=int, default=None,
                        help="generated chats in the training set (default: the recipe's; the held-out set gets "
                             "one twenty-fifth as many, at least 4)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch CPU threads (default 2; results are reproducible for a fixed thread count)")
    parser.add_argument("--no-measure", dest="measure", action="store_false",
                        help="skip serving the result and measuring its behaviour")


def run(args: argparse.Namespace) -> int:
    from rocm_k3.training.recipe import TinyRecipe, train_tiny

    try:
        base = TinyRecipe()
        train = dataclasses.replace(base.train, seed=args.seed,
                                    **({"steps": args.steps} if args.steps is not None else {}))
        chats = {} if args.chats is None else {"chats": args.chats, "heldout_chats": max(4, args.chats // 25)}
        recipe = TinyRecipe(corpus=dataclasses.replace(base.corpus, seed=args.seed, **chats), train=train,
                            threads=args.threads)
    except ValueError as exc:
        print(f"rocm-k3 train-tiny: error: {exc}", file=sys.stderr)
        return 2
    root = Path(args.directory)
    report = train_tiny(root, recipe, log=lambda line: print(line, flush=True), measure=args.measure)
    print(json.dumps(report, indent=2, sort_keys=True))
    size = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
    print(f"wrote the trained tiny K3 checkpoint to {root} ({size / 1e6:.2f} MB)")
    return 0
