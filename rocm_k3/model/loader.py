"""Load a Kimi K3 / Kimi Linear checkpoint (safetensors, single file or sharded) into a :class:`KimiModel`.

Steps: read ``config.json``; find the shards (the index's, else ``*.safetensors``), every file checked to lie
inside the checkpoint directory and to be a regular file before it is opened (:mod:`rocm_k3.model.checkpoint_io`);
read every shard's header (names, shapes, dtypes; no tensor data), check it against the index and against the
tensors the config implies (:mod:`rocm_k3.model.checkpoint_names`), raising a named error that lists every
missing, unexpected or mis-shaped tensor; then stream the tensors one by one (progress bar), cast floats to
the model dtype (fp32 tensors such as ``A_log``/``dt_bias`` stay fp32, MXFP4 bytes stay uint8), move them to the
device, and build the model, which fuses what the ops want fused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from rocm_k3.model import checkpoint_io
from rocm_k3.model.checkpoint_errors import (
    CheckpointError,
    CorruptCheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsafePathError,
)
from rocm_k3.model.checkpoint_names import TensorSpec, canonical_name, expected_tensors
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.decoder import KimiModel
from rocm_k3.model.moe import ACT_QUANT_MODES

__all__ = [
    "CheckpointError", "CorruptCheckpointError", "MissingTensorError", "TensorShapeError", "UnexpectedTensorError",
    "UnsafePathError", "CheckpointFiles", "checkpoint_files", "plan_load", "load_model",
]

INDEX_FILE = "model.safetensors.index.json"
_MAX_LISTED = 12


class CheckpointFiles(NamedTuple):
    """The safetensors shards of a checkpoint directory.

    files:      the shard paths (inside the directory, regular files), sorted.
    index:      path of ``model.safetensors.index.json``, or None when the directory has none.
    weight_map: tensor name -> shard path as the index lists it (None without an index); :func:`plan_load`
                checks it against the shards' headers.
    """

    files: list[Path]
    index: Path | None
    weight_map: dict[str, Path] | None


def checkpoint_files(path: str | Path) -> CheckpointFiles:
    """The safetensors files of a checkpoint directory: those the index names, else ``*.safetensors``.

    Raises UnsafePathError for a shard name or symlink leading outside the directory, CorruptCheckpointError for
    an unreadable index, a ``weight_map`` that is not an object of file names, a shard that is missing or is not a
    regular file; nothing is opened before these checks.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    index = checkpoint_io.member(root, INDEX_FILE)
    if checkpoint_io.require_regular(index, CorruptCheckpointError):
        weight_map = _read_weight_map(root, index)
        files = sorted(set(weight_map.values()))
        absent = [f.name for f in files if not checkpoint_io.require_regular(f, CorruptCheckpointError)]
        if absent:
            raise CorruptCheckpointError(f"{index} names shards that do not exist: {absent}")
        return CheckpointFiles(files, index, weight_map)
    files = sorted(checkpoint_io.member(root, f.name, "safetensors file") for f in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {root}")
    for f in files:
        checkpoint_io.require_regular(f, CorruptCheckpointError)
    return CheckpointFiles(files, None, None)


def _read_weight_map(root: Path, index: Path) -> dict[str, Path]:
    """tensor name -> shard path from the index, every shard name checked to stay inside ``root``."""
    raw = checkpoint_io.read_json(index, CorruptCheckpointError)
    if not isinstance(raw, Mapping):
        raise CorruptCheckpointError(f"{index}: expected a JSON object, got {type(raw).__name__}")
    if "weight_map" not in raw:
        raise CorruptCheckpointError(f"{index}: no 'weight_map' (tensor name -> shard file)")
    weight_map = raw["weight_map"]
    if not isinstance(weight_map, Mapping):
        raise CorruptCheckpointError(
            f"{index}: 'weight_map' must be an object (tensor name -> shard file), got {type(weight_map).__name__}"
        )
    if not weight_map:
        raise CorruptCheckpointError(f"{index}: weight_map is empty")
    shards: dict[str, Path] = {}
    out: dict[str, Path] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CorruptCheckpointError(
                f"{index}: weight_map[{name!r}] must be a shard file name (a string), got {type(shard).__name__}"
            )
        if shard not in shards:
            shards[shard] = checkpoint_io.member(root, shard, f"shard named by {INDEX_FILE}")
        out[name] = shards[shard]
    return out


def _header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype string) for every tensor of one file, without reading data."""
    checkpoint_io.require_regular(file, CorruptCheckpointError)  # never hand a pipe to safe_open
    try:
        with safe_open(str(file), framework="pt") as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype())
            return out
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc


def _check_index(ckpt: CheckpointFiles, headers: dict[Path, dict[str, tuple[tuple[int, ...], str]]]) -> None:
    """The index must list every tensor of every shard, in the shard that holds it, and nothing else."""
    if ckpt.weight_map is None:
        return
    wrong, omitted, seen = [], [], set()
    for file, header in headers.items():
        for name in header:
            listed = ckpt.weight_map.get(name)
            seen.add(name)
            if listed is None:
                omitted.append(name)
            elif listed != file:
                wrong.append(f"{name}: the index names {listed.name} but it is in {file.name}")
    if wrong:
        raise CorruptCheckpointError(f"{ckpt.index} disagrees with the shards: {_listed(sorted(wrong))}")
    absent = sorted(set(ckpt.weight_map) - seen)
    if absent:
        raise CorruptCheckpointError(
            f"{ckpt.index} lists {len(absent)} tensors that no shard holds: {_listed(absent)}"
        )
    if omitted:
        raise CorruptCheckpointError(
            f"{ckpt.index} does not list {len(omitted)} tensors that its shards hold: {_listed(sorted(omitted))}"
        )


def _listed(names: list[str]) -> str:
    more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def plan_load(cfg: ModelConfig, ckpt: CheckpointFiles) -> dict[str, tuple[Path, str, TensorSpec]]:
    """Check every shard header against the index and the config; returns canonical name -> (file, checkpoint
    name, spec)."""
    headers = {file: _header(file) for file in ckpt.files}
    _check_index(ckpt, headers)
    # a config implying far more tensors than the shards hold is refused before it is enumerated in full
    expected = expected_tensors(cfg, limit=2 * sum(len(h) for h in headers.values()) + 1024)
    found: dict[str, tuple[Path, str, TensorSpec]] = {}
    unexpected, wrong = [], []
    for file, header in headers.items():
        for name, (shape, st_dtype) in header.items():
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
            checkpoint_io.require_regular(file, CorruptCheckpointError)
            try:
                with safe_open(str(file), framework="pt") as f:
                    for canon, name in names:
                        yield canon, f.get_tensor(name)
                        bar.update(1)
            except (SafetensorError, OSError) as exc:
                raise CorruptCheckpointError(f"{file}: cannot read tensor data ({exc})") from exc
    finally:
        bar.close()


def _check_a_log(cfg: ModelConfig, name: str, t: torch.Tensor) -> None:
    """A_log in the K3 release layout ``[head_dim]`` holds the H per-head values, then zeros (the model keeps the
    first H). A non-zero tail is not that padding (another layout, e.g. per channel): refuse it, never drop it."""
    h, d = cfg.kda.num_heads, cfg.kda.head_dim
    if t.dim() == 1 and t.shape[0] == d and d > h:
        tail = t[h:].float()
        if bool((tail != 0).any()):
            raise TensorShapeError(
                f"{name}: a [{d}] A_log must hold the {h} per-head values followed by zero padding (the K3 "
                f"layout), but {int((tail != 0).sum())} of the {d - h} padding entries are non-zero"
            )


def load_model(path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
               backend: str | None = None, progress: bool = True, moe_act_quant: str = "bf16") -> KimiModel:
    """Load the text model of a Kimi K3 or Kimi Linear checkpoint directory.

    dtype: activation/weight dtype (bfloat16 or float32); fp32 parameters (A_log, dt_bias, router) stay fp32.
    moe_act_quant: routed-expert activations "bf16" (A16W4) or "mxfp8" (A8W4).
    Raises ConfigError/UnsupportedModelError for the config, and MissingTensorError, UnexpectedTensorError,
    TensorShapeError, CorruptCheckpointError or UnsafePathError for the weights, each naming the tensors or
    file concerned.
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
        if canon.endswith("self_attn.A_log"):
            _check_a_log(cfg, plan[canon][1], t)
        kind = plan[canon][2].kind
        target = torch.uint8 if kind == "uint8" else torch.float32 if kind == "fp32" else dtype
        tensors[canon] = t.to(device=device, dtype=target)
    return KimiModel.from_tensors(cfg, tensors, backend=backend, moe_act_quant=moe_act_quant)
