"""Test helpers for the vision tower: seeded checkpoints in the released layouts, small configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rocm_k3.model.vision.config import VisionConfig
from rocm_k3.model.vision.tiny import seeded_vision_tensors


def random_vision_tensors(raw: dict[str, Any], seed: int, bias_scale: float = 0.1) -> dict[str, torch.Tensor]:
    """Seeded fp32 tensors (checkpoint names) for the tower + projector of a raw ``vision_config``."""
    return seeded_vision_tensors(VisionConfig.from_hf_dict(raw), seed, bias_scale)


def write_vision_checkpoint(root: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                            dtype: torch.dtype = torch.float32, shards: int = 1) -> Path:
    """``config.json`` and the tensors in ``dtype``: ``model.safetensors``, or shards with an index."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    stored = {n: t.to(dtype).contiguous() for n, t in tensors.items()}
    if shards == 1:
        save_file(stored, str(root / "model.safetensors"), metadata={"format": "pt"})
        return root
    names = sorted(stored)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[i * per:(i + 1) * per]
        save_file({n: stored[n] for n in chunk}, str(root / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root
