"""Load the vision tower and projector (``vision_tower.*``, ``mm_projector.*``) of a checkpoint directory.

The text model's loader (:mod:`rocm_k3.model.loader`) skips these names; this one reads only them, from the same
safetensors files (single or sharded). It checks every header against the names and shapes the vision config
implies (:func:`rocm_k3.model.vision.model.expected_vision_tensors`, the released K3 and K2.5 layouts) before
reading any data, and raises the text loader's named errors, each listing the tensors concerned:
``MissingTensorError``, ``UnexpectedTensorError`` (a vision-prefixed name the config does not explain, e.g. a
bias in a bias-free K3 tower), ``TensorShapeError`` (shape, or a non-float dtype), ``CorruptCheckpointError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from rocm_k3.model.config import read_config_json
from rocm_k3.model.loader import (
    CorruptCheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    checkpoint_files,
)
from rocm_k3.model.vision.config import VisionConfig, VisionConfigError
from rocm_k3.model.vision.model import VisionModel, expected_vision_tensors

VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_MAX_LISTED = 12


def _listed(items: list[str]) -> str:
    more = f" ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


def vision_config_of(checkpoint_dir: str | Path) -> VisionConfig | None:
    """The ``vision_config`` of a checkpoint's ``config.json`` (None when the model has no tower)."""
    return VisionConfig.from_checkpoint_config(read_config_json(checkpoint_dir))


def plan_vision_load(cfg: VisionConfig, files: list[Path]) -> dict[str, Path]:
    """Check the vision tensors of every shard header against ``cfg``; returns name -> file."""
    expected = expected_vision_tensors(cfg)
    found: dict[str, Path] = {}
    unexpected, wrong = [], []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if not name.startswith(VISION_PREFIXES):
                        continue
                    if name in found:
                        raise CorruptCheckpointError(
                            f"tensor {name} appears in both {found[name].name} and {file.name}"
                        )
                    found[name] = file
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    sl = f.get_slice(name)
                    shape, st_dtype = tuple(sl.get_shape()), sl.get_dtype()
                    if shape != expected[name]:
                        wrong.append(f"{name}: expected shape {list(expected[name])}, got {list(shape)}")
                    elif st_dtype not in _FLOAT_DTYPES:
                        wrong.append(f"{name}: expected a floating-point dtype, got {st_dtype}")
        except (SafetensorError, OSError) as exc:
            raise CorruptCheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
    missing = sorted(n for n in expected if n not in found)
    if missing:
        raise MissingTensorError(f"{len(missing)} vision tensors missing from the checkpoint: {_listed(missing)}")
    if unexpected:
        raise UnexpectedTensorError(
            f"{len(unexpected)} vision tensors the vision_config does not explain: {_listed(sorted(unexpected))}"
        )
    if wrong:
        raise TensorShapeError(f"{len(wrong)} vision tensors do not match the vision_config: {_listed(wrong)}")
    return found


def load_vision_model(checkpoint_dir: str | Path, vision_config: VisionConfig | Mapping[str, Any] | None = None,
                      dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", *,
                      backend: str | None = None) -> VisionModel:
    """The tower + projector of ``checkpoint_dir`` as a :class:`VisionModel` in ``dtype`` on ``device``.

    vision_config: a :class:`VisionConfig`, a raw ``vision_config`` object (with ``text_hidden_size``), or None
    to read it from the checkpoint's ``config.json``. dtype: bfloat16, float16 or float32.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    if vision_config is None:
        cfg = vision_config_of(checkpoint_dir)
        if cfg is None:
            raise VisionConfigError(f"{checkpoint_dir}/config.json has no vision_config: the model takes no images")
    elif isinstance(vision_config, VisionConfig):
        cfg = vision_config
    else:
        cfg = VisionConfig.from_hf_dict(vision_config)
    plan = plan_vision_load(cfg, checkpoint_files(checkpoint_dir).files)
    device = torch.device(device)
    by_file: dict[Path, list[str]] = {}
    for name, file in plan.items():
        by_file.setdefault(file, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as exc:
            raise CorruptCheckpointError(f"{file}: cannot read tensor data ({exc})") from exc
    with torch.device("meta"):
        model = VisionModel(cfg, backend=backend, device="meta", dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
