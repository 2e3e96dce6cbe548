"""The hidden-state drafter (``method: draft_model``): a small recurrent head over the target's tapped layers.

The EAGLE / DSpark shape at the smallest useful size. After the target has produced token x_{t+1} at position t,
the drafter reads the target's hidden states of position t at the depths ``tap_layer_ids`` (a depth
``0 .. L - 1`` is that layer's normed attention input, ``L`` = ``num_hidden_layers`` the final-normed hidden
state the LM head reads) and proposes x_{t+2} .. x_{t+k+1} greedily::

    s_0 = tanh(fuse(concat(taps)))                 # [B, hidden]
    s_j = GRUCell(embed(x_{t+j}), s_{j-1})         # j = 1 .. k, x_{t+1} is the target's token
    x_{t+j+1} = argmax(head(s_j))

Greedy drafting makes the proposal deterministic (q is one-hot at the draft), so the worker's acceptance rule
(sample each verified row from the target, accept while the sample equals the draft) is exact rejection sampling.

A drafter directory holds ``config.json`` (:class:`DrafterConfig`) and ``model.safetensors`` (``fuse.weight``,
``fuse.bias``, ``embed.weight``, ``cell.weight_ih`` / ``weight_hh`` / ``bias_ih`` / ``bias_hh``, ``head.weight``,
``head.bias``). :func:`load_drafter` checks both against the target and names any mismatch (ValueError).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from rocm_k3 import checkpoint_io
from rocm_k3.model.tiny import EMBEDDED_DIR
from rocm_k3.settings import get_settings
from rocm_k3.spec_decode.config import EMBEDDED_DRAFTER
from rocm_k3.spec_decode.dspark_config import ARCHITECTURE as DSPARK_ARCHITECTURE
from rocm_k3.spec_decode.dspark_config import MODEL_TYPE as DSPARK_MODEL_TYPE
from rocm_k3.spec_decode.dspark_config import is_dspark_config

ARCHITECTURE = "RocmK3TapDrafter"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EMBEDDED_DRAFTER_DIR = EMBEDDED_DIR / "drafter"  # package data, beside the embedded tiny K3
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # Hugging Face's "name" or "owner/name"


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """tap_layer_ids: target depths read (see the module docstring), ascending, distinct; target_hidden_size /
    target_num_hidden_layers / vocab_size: the target it was trained for; hidden_size: the drafter's width."""

    tap_layer_ids: tuple[int, ...]
    target_hidden_size: int
    target_num_hidden_layers: int
    vocab_size: int
    hidden_size: int

    def __post_init__(self) -> None:
        for name in ("target_hidden_size", "target_num_hidden_layers", "vocab_size", "hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"drafter config: {name}: expected a positive int, got {value!r}")
        ids = self.tap_layer_ids
        if (not isinstance(ids, tuple) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
                or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] > self.target_num_hidden_layers):
            raise ValueError(f"drafter config: tap_layer_ids: expected distinct ascending ints in 0.."
                             f"{self.target_num_hidden_layers} (the target's depths), got {ids!r}")

    @classmethod
    def from_dict(cls, raw: Any) -> DrafterConfig:
        if not isinstance(raw, dict):
            raise ValueError(f"drafter config: expected a JSON object, got {type(raw).__name__}")
        if raw.get("architectures") != [ARCHITECTURE]:
            raise ValueError(f"drafter config: architectures: expected [{ARCHITECTURE!r}], got "
                             f"{raw.get('architectures')!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in raw]
        if missing:
            raise ValueError(f"drafter config: missing keys {missing}")
        taps = raw["tap_layer_ids"]
        return cls(**{n: raw[n] for n in names if n != "tap_layer_ids"},
                   tap_layer_ids=tuple(taps) if isinstance(taps, list) else taps)

    def to_dict(self) -> dict[str, Any]:
        return {"architectures": [ARCHITECTURE], **dataclasses.asdict(self), "tap_layer_ids": list(self.tap_layer_ids)}


class TapDrafter(nn.Module):
    """See the module docstring."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fuse = nn.Linear(len(cfg.tap_layer_ids) * cfg.target_hidden_size, d)
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.cell = nn.GRUCell(d, d)
        self.head = nn.Linear(d, cfg.vocab_size)

    def start(self, taps: torch.Tensor) -> torch.Tensor:
        """The recurrent state [B, hidden] from the tapped hidden states ``taps`` [B, len(tap_layer_ids), H]."""
        return torch.tanh(self.fuse(taps.flatten(1).to(self.fuse.weight.dtype)))

    def forward(self, taps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [B, S, vocab]: row j predicts the token after ``tokens[:, j]`` (``tokens`` int64
        [B, S], the first of them the target's token at the tapped position)."""
        state = self.start(taps)
        emb = self.embed(tokens)  # [B, S, hidden]
        out = []
        for j in range(tokens.shape[1]):
            state = self.cell(emb[:, j], state)
            out.append(self.head(state))
        return torch.stack(out, dim=1)

    @torch.inference_mode()
    def propose(self, taps: torch.Tensor, first: torch.Tensor, k: int) -> torch.Tensor:
        """Greedy drafts int64 [B, k] continuing ``first`` int64 [B] (the target's token after the tapped one)."""
        state = self.start(taps)
        token = first
        drafts = []
        for _ in range(k):
            state = self.cell(self.embed(token), state)
            token = self.head(state).argmax(dim=-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)


def resolve_drafter_path(model: str, revision: str | None = None) -> Path:
    """The directory of ``model``: :data:`EMBEDDED_DRAFTER` (shipped beside the embedded tiny K3), a local directory,
    or a Hugging Face repo id (``owner/name``, at ``revision``: a branch, tag or full commit hash; default main)
    found in the local Hugging Face cache (``Settings.hf_hub_cache``: HF_HUB_CACHE / HF_HOME). Nothing is ever
    downloaded. ValueError naming every place looked at when it is in none."""
    if model == EMBEDDED_DRAFTER:
        return EMBEDDED_DRAFTER_DIR
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    cache = get_settings().hf_hub_cache
    if _REPO_ID.fullmatch(model):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise ValueError(f"draft model {model!r}: no directory at {local.absolute()}, and looking up a Hugging "
                             "Face repo id needs huggingface_hub (pip install 'rocm-k3[hub]')") from None
        try:
            return Path(snapshot_download(model, revision=revision, cache_dir=cache, local_files_only=True))
        except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), or not a valid repo id
            pass
    at = f" at revision {revision!r}" if revision else ""
    raise ValueError(f"draft model {model!r}: not found: no directory at {local.absolute()}, and no snapshot of "
                     f"repo id {model!r}{at} in the Hugging Face cache {cache} (looked for "
                     f"{cache / ('models--' + model.replace('/', '--'))}); rocm-k3 never downloads: fetch it first "
                     "(huggingface-cli download), or set HF_HOME / HF_HUB_CACHE to the cache that holds it (a "
                     f"drafter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}: rocm-k3 train-tiny-drafter DIR "
                     "writes one)")


def read_drafter_config(root: Path, where: str) -> Any:
    """The parsed ``config.json`` of drafter directory ``root`` (untrusted input: read through
    :mod:`rocm_k3.checkpoint_io`, so a pipe or a symlink out of the directory is refused, never waited on);
    ValueError naming the problem."""
    try:
        return checkpoint_io.read_json(checkpoint_io.member(root, CONFIG_FILE), ValueError)
    except ValueError as e:
        raise ValueError(f"{where}: {CONFIG_FILE}: {e}") from None


def refuse_foreign_drafter(root: Path, where: str) -> None:
    """ValueError naming the architecture when ``root``'s config.json names another architecture than
    :data:`ARCHITECTURE`: a K3 DSpark drafter (``k3_dspark`` / ``K3DSparkModel``) is loaded by
    :func:`~rocm_k3.spec_decode.dspark_load.load_dspark` (the engine picks it by its config), any other DSpark or
    drafter layout is not one rocm-k3 runs. Nothing is raised for a config that is absent (the caller reports
    that); one that cannot be read is a ValueError naming why."""
    if not checkpoint_io.file_kind(root / CONFIG_FILE):
        return
    raw = read_drafter_config(root, where)
    if not isinstance(raw, dict):
        return
    arch, model_type = raw.get("architectures"), raw.get("model_type")
    names = [str(a) for a in arch] if isinstance(arch, list) else []
    if is_dspark_config(raw):
        raise ValueError(f"{where}: a K3 DSpark drafter ({DSPARK_ARCHITECTURE}): load_dspark loads it (method "
                         f"'draft_model' picks it by its config.json); load_drafter loads {ARCHITECTURE!r} only")
    if names and names != [ARCHITECTURE]:
        other = any("dspark" in n.lower() or "dflash" in n.lower() for n in names)
        kind = "a DSpark / DFlash drafter of another layout" if other else "not a drafter layout rocm-k3 runs"
        raise ValueError(f"{where}: architectures {arch!r} (model_type {model_type!r}) in its {CONFIG_FILE} is "
                         f"{kind}: method 'draft_model' loads {DSPARK_ARCHITECTURE!r} (model_type "
                         f"{DSPARK_MODEL_TYPE!r}: MLA layers, target_layer_ids taps, a vanilla Markov head) and "
                         f"{ARCHITECTURE!r} checkpoints only")


def check_target(cfg, where: str, **target: int) -> None:
    """ValueError naming the first of ``target`` (config field -> the target model's value) that a drafter
    config ``cfg`` has otherwise: the drafter was trained for another model."""
    for name, value in target.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"{where}: {name}={getattr(cfg, name)} in its {CONFIG_FILE}, but the target model has "
                             f"{value}: this drafter was trained for another model")


def save_drafter(drafter: TapDrafter, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (weights stored as ``dtype``) into ``directory``."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in drafter.state_dict().items()}
    save_file(tensors, str(root / WEIGHTS_FILE), metadata={"format": "pt"})
    (root / CONFIG_FILE).write_text(json.dumps(drafter.cfg.to_dict(), indent=2) + "\n")
    return root


def load_drafter(model: str | Path, *, target_hidden_size: int, target_num_hidden_layers: int, vocab_size: int,
                 device: torch.device, dtype: torch.dtype = torch.float32, revision: str | None = None) -> TapDrafter:
    """The drafter at ``model`` (see :func:`resolve_drafter_path`) for a target of the given shape, on ``device``;
    ValueError naming the file, key or tensor that does not fit."""
    root = resolve_drafter_path(str(model), revision)
    where = f"draft model {str(model)!r}"
    refuse_foreign_drafter(root, where)
    if not (root / CONFIG_FILE).is_file() or not (root / WEIGHTS_FILE).is_file():
        raise ValueError(f"{where}: expected a directory with {CONFIG_FILE} and {WEIGHTS_FILE} (rocm-k3 "
                         f"train-tiny-drafter DIR writes one), found none at {root}")
    raw = read_drafter_config(root, where)
    try:
        cfg = DrafterConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    outside = [i for i in cfg.tap_layer_ids if i > target_num_hidden_layers]
    if outside:
        raise ValueError(f"{where}: tap_layer_ids {list(cfg.tap_layer_ids)} in its {CONFIG_FILE} name depths "
                         f"{outside} outside the target model, which has depths 0..{target_num_hidden_layers} "
                         f"({target_num_hidden_layers} layers, then the final norm)")
    check_target(cfg, where, target_hidden_size=target_hidden_size,
                 target_num_hidden_layers=target_num_hidden_layers, vocab_size=vocab_size)
    drafter = TapDrafter(cfg)
    try:
        tensors = load_file(str(root / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{where}: {WEIGHTS_FILE} cannot be read ({e})") from None
    expected = drafter.state_dict()
    if set(tensors) != set(expected):
        raise ValueError(f"{where}: {WEIGHTS_FILE} tensors differ from the config's drafter: missing "
                         f"{sorted(set(expected) - set(tensors))}, unexpected {sorted(set(tensors) - set(expected))}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {list(t.shape)}, the config's drafter needs "
                             f"{list(expected[name].shape)}")
    drafter.load_state_dict({n: t.float() for n, t in tensors.items()})
    return drafter.to(device=device, dtype=dtype).eval()
