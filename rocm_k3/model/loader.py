"""Load a Kimi K3 / Kimi Linear checkpoint (safetensors, single file or sharded) into a :class:`KimiModel`.

Steps: read ``config.json``; find the shards (the index's, else ``*.safetensors``), every file checked to lie
inside the checkpoint directory and to be a regular file before it is opened (:mod:`rocm_k3.checkpoint_io`);
read every shard's header (names, shapes, dtypes; no tensor data), check it against the index and against the
tensors the config implies (:mod:`rocm_k3.model.checkpoint_names`), raising a named error that lists every
missing, unexpected or mis-shaped tensor; build this rank's model (``nn.Module`` s with uninitialised
parameters, see :mod:`rocm_k3.model.decoder`); then read, tensor by tensor (progress bar), only the slice of
each checkpoint tensor that one of this rank's parameters needs (the layers' shard rules,
:mod:`rocm_k3.model.layers.weights`), cast it to the parameter's dtype (the model dtype; fp32 for ``A_log``,
``dt_bias`` and the router; uint8 MXFP4 bytes) and copy it in place; finally let the layers finish (the routed
experts are re-laid for the serving backend).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from rocm_k3.distributed.context import ParallelContext
from rocm_k3 import checkpoint_io
from rocm_k3.checkpoint_errors import (
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
from rocm_k3.model.layers.weights import Target
from rocm_k3.model.moe import ACT_QUANT_MODES
from rocm_k3.ops.registry import bind

__all__ = [
    "CheckpointError", "CorruptCheckpointError", "MissingTensorError", "TensorShapeError", "UnexpectedTensorError",
    "UnsafePathError", "CheckpointFiles", "checkpoint_files", "check_coverage", "fill_target", "plan_load",
    "load_model",
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


def _read_targets(plan: dict[str, tuple[Path, str, TensorSpec]], targets: dict[str, Target], cfg: ModelConfig,
                  progress: bool) -> int:
    """Fill every target from its checkpoint tensor, reading only the target's slice; returns the bytes read."""
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for canon in targets:
        file, name, _ = plan[canon]
        by_file.setdefault(file, []).append((canon, name))
    loaded = 0
    bar = tqdm(total=len(targets), desc="loading tensors", unit="tensor", disable=not progress)
    try:
        for file, names in by_file.items():
            checkpoint_io.require_regular(file, CorruptCheckpointError)
            try:
                with safe_open(str(file), framework="pt") as f:
                    for canon, name in names:
                        target = targets[canon]
                        sl = f.get_slice(name)
                        t = sl[target.read.index(len(sl.get_shape()))]  # only this rank's slice leaves the file
                        loaded += t.numel() * t.element_size()
                        fill_target(cfg, canon, name, target, t)
                        bar.update(1)
            except (SafetensorError, OSError) as exc:
                raise CorruptCheckpointError(f"{file}: cannot read tensor data ({exc})") from exc
    finally:
        bar.close()
    return loaded


def fill_target(cfg: ModelConfig, canon: str, name: str, target: Target, t: torch.Tensor) -> None:
    """Copy ``t`` (this rank's slice of checkpoint tensor ``name``, canonical name ``canon``) into its parameter:
    the A_log layout check, the target's transform, a shape check (TensorShapeError naming the tensor), the cast."""
    if canon.endswith("self_attn.A_log"):
        _check_a_log(cfg, name, t)
    if target.read.transform is not None:
        t = target.read.transform(t)
    if tuple(t.shape) != tuple(target.dst.shape):
        raise TensorShapeError(f"{name}: this rank's slice has shape {list(t.shape)}, its "
                               f"parameter {list(target.dst.shape)}")
    with torch.no_grad():
        target.dst.copy_(t.to(dtype=target.dst.dtype))


def check_coverage(model: KimiModel, targets: dict[str, Target]) -> None:
    """Every element of every parameter is some target's destination (a layer that forgot a tensor fails here)."""
    covered: dict[int, int] = {}
    for t in targets.values():
        covered[t.dst.untyped_storage().data_ptr()] = covered.get(t.dst.untyped_storage().data_ptr(), 0) + t.dst.numel()
    for name, p in model.named_parameters():
        key = p.untyped_storage().data_ptr()
        padding = _padding_rows(model, name)
        if covered.get(key, 0) + padding < p.numel():
            raise CheckpointError(f"parameter {name} ({list(p.shape)}) is not fully filled from the checkpoint")


def _padding_rows(model: KimiModel, name: str) -> int:
    """Elements of a vocab-parallel table past the vocabulary (zero rows that no tensor fills)."""
    module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    valid, per_rank = getattr(module, "valid", None), getattr(module, "per_rank", None)
    if valid is None or per_rank is None:
        return 0
    return (per_rank - valid) * module.weight.shape[1]


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
               backend: str | None = None, progress: bool = True, moe_act_quant: str = "bf16",
               ctx: ParallelContext | None = None) -> KimiModel:
    """Load this rank's part of the text model of a Kimi K3 or Kimi Linear checkpoint directory.

    dtype: activation/weight dtype (bfloat16 or float32); fp32 parameters (A_log, dt_bias, router) stay fp32.
    moe_act_quant: routed-expert activations "bf16" (A16W4) or "mxfp8" (A8W4).
    ctx: the rank's place in the parallel layout (None: one process). Each rank reads only its slices of the
    shards (``model.loaded_bytes`` reports how many bytes it read); routed experts are re-laid once for the
    serving backend on the rank that owns them.
    Raises ConfigError/UnsupportedModelError for the config, LayoutError for a layout the model cannot be split
    into, and MissingTensorError, UnexpectedTensorError, TensorShapeError, CorruptCheckpointError or
    UnsafePathError for the weights, each naming the tensors or file concerned.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    if moe_act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"moe_act_quant: expected one of {ACT_QUANT_MODES}, got {moe_act_quant!r}")
    ctx = ParallelContext.single() if ctx is None else ctx
    cfg = ModelConfig.from_pretrained(path)
    plan = plan_load(cfg, checkpoint_files(path))
    device = torch.device(device)
    table = bind(device, backend)
    model = KimiModel(cfg, ctx, table, dtype=dtype, device=device, moe_act_quant=moe_act_quant)
    targets = model.weight_targets()
    unknown = sorted(set(targets) - set(plan))
    if unknown:
        raise MissingTensorError(f"{len(unknown)} tensors the model needs are not in the checkpoint: "
                                 f"{_listed(unknown)}")
    check_coverage(model, targets)
    model.loaded_bytes = _read_targets(plan, targets, cfg, progress)
    model.post_load()
    return model
