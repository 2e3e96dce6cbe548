"""Loading a K3 DSpark drafter checkpoint (config.json + model.safetensors, or a sharded index) for a target.

Every problem is a ValueError naming it: a missing or unsupported config key, a target it was not trained for, and
each missing, unexpected or misshapen tensor (checked from the safetensors headers before any weight is read). The
directory is untrusted input: its files are opened through :mod:`rocm_k3.checkpoint_io` (a pipe is refused, never
waited on; an index's shard names and every symlink stay inside the directory).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from rocm_k3 import checkpoint_io
from rocm_k3.spec_decode.drafter import CONFIG_FILE, WEIGHTS_FILE, check_target, read_drafter_config
from rocm_k3.spec_decode.dspark import DSparkDrafter
from rocm_k3.spec_decode.dspark_config import IGNORED_PREFIXES, DSparkConfig, tensor_shapes

INDEX_FILE = "model.safetensors.index.json"


def read_dspark_config(root: Path, where: str) -> DSparkConfig:
    raw = read_drafter_config(root, where)
    try:
        return DSparkConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _weight_files(root: Path, where: str) -> dict[str, Path]:
    """Tensor name -> the file that holds it (from the index when the checkpoint is sharded); every file checked
    to stay inside ``root``."""
    try:
        index = checkpoint_io.member(root, INDEX_FILE)
        weights = checkpoint_io.member(root, WEIGHTS_FILE)
        if checkpoint_io.require_regular(index, ValueError):
            try:
                weight_map = checkpoint_io.read_json(index, ValueError)["weight_map"]
            except (KeyError, TypeError) as e:
                raise ValueError(f"{INDEX_FILE} has no weight_map ({e})") from None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{INDEX_FILE}: weight_map is not an object")
            return {name: checkpoint_io.member(root, file, f"shard named by {INDEX_FILE}")
                    for name, file in weight_map.items()}
        if checkpoint_io.require_regular(weights, ValueError):
            try:
                with safe_open(str(weights), framework="pt") as f:
                    return {name: weights for name in f.keys()}  # noqa: SIM118
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{WEIGHTS_FILE} cannot be read ({e})") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    raise ValueError(f"{where}: expected {WEIGHTS_FILE} or {INDEX_FILE} beside {CONFIG_FILE} in {root}")


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
            checkpoint_io.require_regular(path, ValueError)  # never hand a pipe to safe_open
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
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
