"""Load a Kimi K3 / Kimi Linear checkpoint (safetensors, single file or sharded) into a :class:`KimiModel`.

Steps: read ``config.json``; read every shard's header (names, shapes, dtypes; no tensor data) and check them
against the tensors the config implies (:mod:`rocm_k3.model.checkpoint_names`), raising a named error that lists
every missing, unexpected or mis-shaped tensor; then stream the tensors one by one (progress bar), cast floats to
the model dtype (fp32 tensors such as ``A_log``/``dt_bias`` stay fp32, MXFP4 bytes stay uint8), move them to the
device, and build the model, which fuses what the ops want fused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from rocm_k3.model.checkpoint_names import TensorSpec, canonical_name, expected_tensors
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.decoder import KimiModel
from rocm_k3.model.moe import ACT_QUANT_MODES

INDEX_FILE = "model.safetensors.index.json"
_MAX_LISTED = 12


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or cannot be read."""


class MissingTensorError(CheckpointError):
    """Tensors the config requires are not in the checkpoint."""


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds tensors the config does not explain."""


class TensorShapeError(CheckpointError):
    """Tensors whose shape (or storage dtype) differs from what the config implies."""


class CorruptCheckpointError(CheckpointError):
    """A safetensors file or index that cannot be parsed, or whose contents disagree with the index."""


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those of the index, else ``*.safetensors``."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({exc})") from exc
        files = sorted({root / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CorruptCheckpointError(f"{index} names shards that do not exist: {absent}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {root}")
    return files


def _header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype string) for every tensor of one file, without reading data."""
    try:
        with safe_open(str(file), framework="pt") as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype())
            return out
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc


def _listed(names: list[str]) -> str:
    more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def plan_load(cfg: ModelConfig, files: list[Path]) -> dict[str, tuple[Path, str, TensorSpec]]:
    """Check every shard header against the config; returns canonical name -> (file, checkpoint name, spec)."""
    expected = expected_tensors(cfg)
    found: dict[str, tuple[Path, str, TensorSpec]] = {}
    unexpected, wrong = [], []
    for file in files:
        for name, (shape, st_dtype) in _header(file).items():
            canon = canonical_name(cfg, name)
            if canon is None:
                continue  # vision tower: not part of the text model
            spec = expected.get(canon)
            if spec is None:
                unexpected.append(name)
                continue
            if canon in found:
                raise CorruptCheckpointError(f"tensor {name} appears in both {found[canon][0].name} and {file.name}")
            if not spec.accepts(shape):
                alts = "".join(f" or {list(a)}" for a in spec.alt_shapes)
                wrong.append(f"{name}: expected shape {list(spec.shape)}{alts}, got {list(shape)}")
            elif spec.kind == "uint8" and st_dtype != "U8":
                wrong.append(f"{name}: expected dtype uint8 (MXFP4 bytes), got {st_dtype}")
            elif spec.kind != "uint8" and st_dtype not in ("F32", "F16", "BF16", "F64"):
                wrong.append(f"{name}: expected a floating-point dtype, got {st_dtype}")
            found[canon] = (file, name, spec)
    missing = sorted(cfg.weight_prefix + n for n in expected if n not in found)
    if missing:
        raise MissingTensorError(f"{len(missing)} tensors missing from the checkpoint: {_listed(missing)}")
    if unexpected:
        raise UnexpectedTensorError(
            f"{len(unexpected)} unexpected tensors in the checkpoint: {_listed(sorted(unexpected))}"
        )
    if wrong:
        raise TensorShapeError(f"{len(wrong)} tensors do not match the config: {_listed(wrong)}")
    return found


def _stream(plan: dict[str, tuple[Path, str, TensorSpec]], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (canonical name, tensor) file by file, one tensor at a time."""
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for canon, (file, name, _) in plan.items():
        by_file.setdefault(file, []).append((canon, name))
    bar = tqdm(total=len(plan), desc="loading tensors", unit="tensor", disable=not progress)
    try:
        for file, names in by_file.items():
            try:
                with safe_open(str(file), framework="pt") as f:
                    for canon, name in names:
                        yield canon, f.get_tensor(name)
                        bar.update(1)
            except (SafetensorError, OSError) as exc:
                raise CorruptCheckpointError(f"{file}: cannot read tensor data ({exc})") from exc
    finally:
        bar.close()


def load_model(path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
               backend: str | None = None, progress: bool = True, moe_act_quant: str = "bf16") -> KimiModel:
    """Load the text model of a Kimi K3 or Kimi Linear checkpoint directory.

    dtype: activation/weight dtype (bfloat16 or float32); fp32 parameters (A_log, dt_bias, router) stay fp32.
    moe_act_quant: routed-expert activations "bf16" (A16W4) or "mxfp8" (A8W4).
    Raises ConfigError/UnsupportedModelError for the config, and MissingTensorError, UnexpectedTensorError,
    TensorShapeError or CorruptCheckpointError for the weights, each naming the tensors or file concerned.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    if moe_act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"moe_act_quant: expected one of {ACT_QUANT_MODES}, got {moe_act_quant!r}")
    cfg = ModelConfig.from_pretrained(path)
    plan = plan_load(cfg, checkpoint_files(path))
    device = torch.device(device)
    tensors: dict[str, torch.Tensor] = {}
    for canon, t in _stream(plan, progress):
        kind = plan[canon][2].kind
        target = torch.uint8 if kind == "uint8" else torch.float32 if kind == "fp32" else dtype
        tensors[canon] = t.to(device=device, dtype=target)
    return KimiModel.from_tensors(cfg, tensors, backend=backend, moe_act_quant=moe_act_quant)
