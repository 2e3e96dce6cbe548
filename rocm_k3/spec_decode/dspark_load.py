"""Loading a K3 DSpark drafter checkpoint (config.json + model.safetensors, or a sharded index) for a target.

Every problem is a ValueError naming it: a missing or unsupported config key, a target it was not trained for, and
each missing, unexpected or misshapen tensor (checked from the safetensors headers before any weight is read).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from rocm_k3.spec_decode.drafter import CONFIG_FILE, WEIGHTS_FILE, check_target
from rocm_k3.spec_decode.dspark import DSparkDrafter
from rocm_k3.spec_decode.dspark_config import IGNORED_PREFIXES, DSparkConfig, tensor_shapes

INDEX_FILE = "model.safetensors.index.json"


def read_dspark_config(root: Path, where: str) -> DSparkConfig:
    try:
        raw = json.loads((root / CONFIG_FILE).read_text())
    except OSError as e:
        raise ValueError(f"{where}: {CONFIG_FILE} cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        return DSparkConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _weight_files(root: Path, where: str) -> dict[str, Path]:
    """Tensor name -> the file that holds it (from the index when the checkpoint is sharded)."""
    if (root / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: {INDEX_FILE} has no readable weight_map ({e})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{where}: {INDEX_FILE}: weight_map is not an object")
        files = {name: root / str(file) for name, file in weight_map.items()}
    elif (root / WEIGHTS_FILE).is_file():
        files = {}
        try:
            with safe_open(str(root / WEIGHTS_FILE), framework="pt") as f:
                files = {name: root / WEIGHTS_FILE for name in f.keys()}  # noqa: SIM118
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{where}: {WEIGHTS_FILE} cannot be read ({e})") from None
    else:
        raise ValueError(f"{where}: expected {WEIGHTS_FILE} or {INDEX_FILE} beside {CONFIG_FILE} in {root}")
    return files


def _read_tensors(files: dict[str, Path], expected: dict[str, tuple[int, ...]], where: str) -> dict[str, torch.Tensor]:
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(n for n in set(files) - set(expected) if not n.startswith(IGNORED_PREFIXES))
    if missing or unexpected:
        raise ValueError(f"{where}: its tensors differ from the DSpark layout its {CONFIG_FILE} describes: missing "
                         f"{missing}, unexpected {unexpected}")
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != expected[name]:
                        raise ValueError(f"{where}: tensor {name!r} has shape {list(shape)}, its {CONFIG_FILE} "
                                         f"needs {list(expected[name])}")
                for name in names:
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{where}: {path.name} cannot be read ({e})") from None
    return tensors


def load_dspark(root: Path, where: str, *, target_hidden_size: int, target_num_hidden_layers: int,
                vocab_size: int, device: torch.device, dtype: torch.dtype) -> DSparkDrafter:
    """The drafter in directory ``root`` for a target of the given shape, on ``device`` as ``dtype``."""
    cfg = read_dspark_config(root, where)
    check_target(cfg, where, target_hidden_size=target_hidden_size,
                 target_num_hidden_layers=target_num_hidden_layers, vocab_size=vocab_size)
    if cfg.hidden_size != target_hidden_size:
        raise ValueError(f"{where}: hidden_size={cfg.hidden_size} in its {CONFIG_FILE} differs from the target's "
                         f"hidden size {target_hidden_size}, whose embedding and LM head the drafter shares")
    expected = tensor_shapes(cfg)
    tensors = _read_tensors(_weight_files(root, where), expected, where)
    drafter = DSparkDrafter(cfg)
    drafter.load_state_dict({n: t.float() for n, t in tensors.items()})
    return drafter.to(device=device, dtype=dtype).eval()
