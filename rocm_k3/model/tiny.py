"""The tiny Kimi K3 checkpoints: the trained embedded default, and seeded random ones of any small shape.

The embedded default (``rocm_k3.LLM()`` with no path, ``rocm-k3 generate``) is the trained checkpoint committed
under ``rocm_k3/model/embedded/`` (written by ``rocm-k3 train-tiny``, see :mod:`rocm_k3.training`);
:func:`ensure_embedded_model` copies it once into ``settings.cache_dir``, under a name that carries a digest of
its bytes (a retrained checkpoint gets a new directory, never a stale copy).

``write_tiny_checkpoint(dir)`` writes a random model of the same architecture for tests that need other shapes or
seeds: ``config.json`` (top-level ``kimi_k3`` with ``text_config`` and a compressed-tensors
``mxfp4-pack-quantized`` quantization_config), ``model.safetensors`` (or shards plus
``model.safetensors.index.json``) with ``language_model.``-prefixed names and MXFP4 routed experts
(``weight_packed`` + ``weight_scale``), and a byte-level tokenizer with K3's control specials (so K3 XTML chats
render and run on it). Six layers: KDA at 1, 2, 4, 5 and MLA at 3, 6 (1-based), AttnRes blocks of 2 (three
snapshots), a dense first layer, then LatentMoE with 8 experts (top-2) and two shared experts; SiTU activation;
safe gate; full-rank KDA output gate; MLA with q_lora and output gate. The MLA latent geometry is the released
one (512 + 64, heads 128/64/128; ``text_overrides`` can change it: the model and ops take the widths from the
config). About 2 MB. Its weights are random: it exercises every code path, it does not speak.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rocm_k3 import ops
from rocm_k3.model.checkpoint_names import expected_tensors
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.loader import INDEX_FILE
from rocm_k3.settings import get_settings
from rocm_k3.tokenizers.byte import TOKENIZER_FILE, embedded_byte_tokenizer

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"  # the trained checkpoint (package data)
EMBEDDED_FILES = ("config.json", "model.safetensors", TOKENIZER_FILE)
EMBEDDED_PREFIX = "tiny-k3-trained"
TINY_SEED = 0
COMPLETE_MARKER = ".rocm_k3_complete"  # written last into a finished embedded model


class EmbeddedModelError(OSError):
    """The embedded model cannot be built in the cache directory; the message names it and the fix."""

_TOKENIZER = embedded_byte_tokenizer()

TINY_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": _TOKENIZER.vocab_size,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 2,
    "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 32,
    "latent_moe_use_norm": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "intermediate_size": 128,
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": _TOKENIZER.bos_token_id,
    "eos_token_id": list(_TOKENIZER.eos_token_ids),  # <|end_of_msg|>, [EOS]
    "pad_token_id": _TOKENIZER.pad_token_id,
    "linear_attn_config": {
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
        "full_attn_layers": [3, 6],
        "kda_layers": [1, 2, 4, 5],
    },
}

QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                        "symmetric": True, "dynamic": False},
            "input_activations": None,
            "format": "mxfp4-pack-quantized",
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*routed_expert_.*", "re:.*gate$"],
}


def tiny_config(text_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The top-level K3 ``config.json`` of the tiny model (``text_overrides`` patch ``text_config``)."""
    text = json.loads(json.dumps(TINY_TEXT_CONFIG))
    text.update(text_overrides or {})
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "torch_dtype": "bfloat16",
        "text_config": text,
        "quantization_config": QUANTIZATION_CONFIG,
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
    }


def k3_slice_overrides(width: int = 1) -> dict:
    """``text_config`` overrides for a 4-layer slice of K3 (3 KDA + 1 MLA) at K3 width: hidden 7168, KDA 96 x 128,
    MLA with TP-8's 12 heads and the 512 + 64 latent, LatentMoE 7168 -> 3584 with experts 3584 -> 2 x 3072 (32 of
    the 896, top-16), dense layer 0 of 33792, AttnRes blocks of 2. ``width`` > 1 (a power of two <= 16) divides
    the widths (tests of the plumbing)."""
    return {
        "hidden_size": 7168 // width, "num_hidden_layers": 4, "num_attention_heads": 12,
        "q_lora_rank": 1536 // width, "num_experts": 32, "num_experts_per_token": max(2, 16 // width),
        "moe_intermediate_size": 3072 // width, "routed_expert_hidden_size": 3584 // width,
        "intermediate_size": 33792 // width, "attn_res_block_size": 2,
        "linear_attn_config": {"num_heads": 96 // width, "head_dim": 128, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "full_attn_layers": [4], "kda_layers": [1, 2, 3]},
    }


def random_tensors(cfg: ModelConfig, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """Seeded random weights for every tensor of ``cfg``, by checkpoint name, in fp32 (experts: see below).

    Linear weights ~ N(0, 1/fan_in); norms ~ 1 + N(0, 0.1^2); AttnRes projections ~ N(0, 1/hidden) so the
    depth mix is far from uniform; A_log = log U(1, 16) and dt_bias = inverse-softplus of U(1e-3, 1e-1) as in
    the released initialisation. Routed experts are quantised to MXFP4 when ``cfg.expert_format == "mxfp4"``.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    dense_experts: dict[str, torch.Tensor] = {}
    specs = expected_tensors(cfg)
    for name, spec in specs.items():
        full = cfg.weight_prefix + name
        shape = spec.shape
        if name.endswith(("_norm.weight", "layernorm.weight", "o_norm.weight", "model.norm.weight")):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()  # [1, 1, H, 1]
            if cfg.is_k3:  # the K3 release stores A_log as [head_dim]: H real entries, then zero padding
                t = torch.cat([t.reshape(-1), torch.zeros(cfg.kda.head_dim - cfg.kda.num_heads)])
        elif name.endswith("dt_bias"):
            dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            t = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith("e_score_correction_bias"):
            t = 0.01 * torch.randn(shape, generator=gen)
        elif name.endswith("_res_proj.weight"):
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen)
        elif spec.kind == "uint8":
            base = name.rsplit(".", 1)[0]  # ...experts.E.wN
            if base not in dense_experts:
                packed_shape = specs[base + ".weight_packed"].shape
                rows, cols = packed_shape[0], packed_shape[1] * 2
                dense_experts[base] = torch.randn(rows, cols, generator=gen) / math.sqrt(cols)
            continue
        elif len(shape) == 3:  # conv taps [C, 1, W]
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        out[full] = t
    for base, w in dense_experts.items():
        packed, scales = ops.quantize_mxfp4(w, rule="ct")
        out[cfg.weight_prefix + base + ".weight_packed"] = packed
        out[cfg.weight_prefix + base + ".weight_scale"] = scales
    return out


def storage_form(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as the checkpoint stores it: bf16, except uint8 bytes and the fp32 A_log / dt_bias / router bias."""
    if t.dtype == torch.uint8 or name.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
        return t.contiguous()
    return t.to(torch.bfloat16).contiguous()


def write_checkpoint(directory: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                     shards: int = 1) -> Path:
    """Write ``config.json`` and the tensors (bf16 except fp32/uint8 ones) as 1 or more safetensors shards.

    ``shards`` is between 1 and the number of tensors (every shard holds at least one; checked before anything
    is written).
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= max(1, len(tensors)):
        raise ValueError(f"shards: expected an int in [1, {len(tensors)}] (the checkpoint has {len(tensors)} "
                         f"tensors, at least one per shard), got {shards!r}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [*root.glob("*.safetensors"), root / INDEX_FILE]:  # a previous checkpoint's weights
        stale.unlink(missing_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = sorted(tensors)
    stored = {n: storage_form(n, tensors[n]) for n in names}
    meta = {"format": "pt"}
    if shards == 1:
        save_file(stored, str(root / "model.safetensors"), metadata=meta)
        return root
    per, extra = divmod(len(names), shards)  # the first `extra` shards hold one tensor more
    weight_map = {}
    start = 0
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        stop = start + per + (1 if i < extra else 0)
        chunk, start = names[start:stop], stop
        save_file({n: stored[n] for n in chunk}, str(root / file), metadata=meta)
        weight_map.update({n: file for n in chunk})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2) + "\n")
    return root


def _favour_printable(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Scale the LM-head rows so printable ASCII bytes get most of the probability mass.

    The weights are random, so this only makes the demo print readable characters instead of control bytes;
    the rows of other tokens (including eos) are shrunk, not removed.
    """
    head = tensors[cfg.weight_prefix + "lm_head.weight"]  # [vocab, hidden]
    scale = torch.full((head.shape[0], 1), 0.1)
    scale[ord(" "):ord("~") + 1] = 2.0
    tensors[cfg.weight_prefix + "lm_head.weight"] = head * scale


def write_tiny_checkpoint(directory: str | Path, seed: int = TINY_SEED, shards: int = 1,
                          text_overrides: dict[str, Any] | None = None, vision: bool = False) -> Path:
    """Write the tiny K3 checkpoint (config, weights, byte tokenizer) into ``directory``; returns it.

    vision: also write a tiny K3 vision tower + projector (``vision_tower.*``, ``mm_projector.*``, see
    :mod:`rocm_k3.model.vision.tiny`), its ``vision_config`` and a ``preprocessor_config.json``.
    """
    config = tiny_config(text_overrides)
    cfg = ModelConfig.from_hf_dict(config)
    tensors = random_tensors(cfg, seed)
    _favour_printable(tensors, cfg)
    from rocm_k3.model.vision.preprocess import PREPROCESSOR_FILE

    if vision:
        from rocm_k3.model.vision.prompt import IMAGE_PLACEHOLDER
        from rocm_k3.model.vision.tiny import TINY_PREPROCESSOR_CONFIG, tiny_vision_tensors_and_config

        vision_tensors, config["vision_config"] = tiny_vision_tensors_and_config(cfg.hidden_size, seed)
        config["image_placeholder"] = IMAGE_PLACEHOLDER
        config["media_placeholder_token_id"] = _TOKENIZER.special_tokens["<|media_pad|>"]
        tensors.update(vision_tensors)
    root = write_checkpoint(directory, config, tensors, shards)
    preprocessor = root / PREPROCESSOR_FILE
    if vision:
        preprocessor.write_text(json.dumps(TINY_PREPROCESSOR_CONFIG, indent=2) + "\n")
    else:
        preprocessor.unlink(missing_ok=True)  # a previous --vision checkpoint's
    embedded_byte_tokenizer(cfg.vocab_size).save(root)
    return root


def embedded_name() -> str:
    """The cache directory name of the packaged checkpoint: ``tiny-k3-trained-<12 hex digits of its sha256>``."""
    digest = hashlib.sha256()
    for name in EMBEDDED_FILES:
        file = EMBEDDED_DIR / name
        if not file.is_file():
            raise FileNotFoundError(f"the embedded checkpoint is incomplete: {file} is missing (rebuild it with "
                                    f"`rocm-k3 train-tiny {EMBEDDED_DIR}`)")
        digest.update(name.encode() + b"\0" + file.read_bytes())
    return f"{EMBEDDED_PREFIX}-{digest.hexdigest()[:12]}"


def ensure_embedded_model(cache_dir: str | Path | None = None) -> Path:
    """The embedded trained model's directory under ``cache_dir`` (default: settings.cache_dir), copied there from
    the package on first use.

    Copied into a temporary sibling directory whose completion marker is written last, then renamed into place,
    so a crash never leaves a half-written model that looks finished. A directory without the marker (an
    interrupted copy, a deleted file) is moved aside and copied again. Raises EmbeddedModelError naming the
    directory when the cache directory cannot be written.
    """
    base = Path(cache_dir) if cache_dir is not None else get_settings().cache_dir
    name = embedded_name()
    target = base / name
    if _is_complete(target):
        return target
    try:
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=name + ".", dir=base))
    except OSError as exc:
        raise EmbeddedModelError(
            f"cannot install the embedded model in the cache directory {base}: {exc.strerror or exc}; set "
            "ROCM_K3_CACHE_DIR to a writable directory, or pass --model / LLM(path) to use a checkpoint"
        ) from exc
    try:
        for file in EMBEDDED_FILES:
            shutil.copyfile(EMBEDDED_DIR / file, tmp / file)
        (tmp / COMPLETE_MARKER).write_text(name + "\n")
        _install(tmp, target)
    except OSError as exc:
        raise EmbeddedModelError(
            f"cannot write the embedded model to {target}: {exc.strerror or exc}; free space or set "
            "ROCM_K3_CACHE_DIR to another writable directory"
        ) from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(target: Path) -> bool:
    return (target / COMPLETE_MARKER).is_file() and (target / "config.json").is_file()


def _install(tmp: Path, target: Path) -> None:
    """Rename the finished build ``tmp`` to ``target``, moving a stale (unmarked) ``target`` aside first."""
    if target.exists() or target.is_symlink():
        if _is_complete(target):  # a concurrent builder finished first
            return
        stale = Path(tempfile.mkdtemp(prefix=target.name + ".stale.", dir=target.parent))
        try:
            os.replace(target, stale / "old")
        except FileNotFoundError:  # a concurrent builder moved it first
            pass
        finally:
            shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        if not _is_complete(target):  # not a concurrent builder that won the race
            raise
