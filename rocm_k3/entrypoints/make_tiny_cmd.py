"""``rocm-k3 make-tiny DIR [--vision]``: write the small seeded K3-architecture checkpoint (K3 layout, MXFP4 experts;
with ``--vision`` also a tiny K3 vision tower and projector)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="output directory (created; existing checkpoint files are overwritten)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0, the embedded model's)")
    parser.add_argument("--shards", type=int, default=1,
                        help="number of safetensors shards, 1 to the number of tensors (default 1)")
    parser.add_argument("--vision", action="store_true",
                        help="also write a tiny K3 vision tower and projector (vision_tower.*, mm_projector.*)")


def run(args: argparse.Namespace) -> int:
    from rocm_k3.model.tiny import write_tiny_checkpoint

    root = write_tiny_checkpoint(Path(args.directory), seed=args.seed, shards=args.shards, vision=args.vision)
    size = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
    what = "tiny K3 checkpoint with a vision tower" if args.vision else "tiny K3 checkpoint"
    print(f"wrote the {what} to {root} ({size / 1e6:.1f} MB)")
    return 0
