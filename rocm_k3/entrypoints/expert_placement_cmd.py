"""``rocm-k3 expert-placement LOADS --ep-size N --num-redundant-experts R -o PLACEMENT``: write an expert placement
(physical expert slots per MoE layer, replicas for the busiest experts, balanced over the EP ranks) from recorded
loads, for ``--expert-placement`` (see :mod:`rocm_k3.model.expert_placement`).

LOADS is JSON ``{"layers": {"<layer>": [picks per logical expert, ...]}}``, e.g. ``{"layers": llm.expert_loads()}``
dumped after a representative workload.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("loads", help='recorded loads, JSON {"layers": {"<layer>": [picks per expert]}}')
    parser.add_argument("--ep-size", type=int, required=True, help="expert-parallel ranks (the TP size with EP)")
    parser.add_argument("--num-redundant-experts", type=int, default=0, help="extra physical slots per layer")
    parser.add_argument("-o", "--output", required=True, help="placement JSON to write")


def run(args: argparse.Namespace) -> int:
    from rocm_k3.distributed.context import LayoutError
    from rocm_k3.model.expert_placement import ExpertPlacement

    try:
        raw = json.loads(Path(args.loads).read_text())
        layers = {int(k): v for k, v in raw["layers"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LayoutError(f"loads {args.loads}: expected JSON {{\"layers\": {{layer: [loads]}}}} "
                          f"({type(exc).__name__}: {exc})") from exc
    if not layers:
        raise LayoutError(f"loads {args.loads}: no layers recorded (was expert parallelism on?)")
    placement = ExpertPlacement.from_loads(layers, args.num_redundant_experts, args.ep_size)
    Path(args.output).write_text(placement.to_json())
    print(f"wrote a placement of {placement.num_experts} experts + {placement.num_redundant_experts} redundant over "
          f"{placement.ep_size} ranks for {len(layers)} layers to {args.output}")
    return 0
