"""Write trained tensors as a checkpoint in the embedded model's layout, loadable by ``rocm_k3.LLM(path)``.

The layout is the one :func:`rocm_k3.model.tiny.write_checkpoint` writes for the random tiny model:
``config.json`` (top-level ``kimi_k3`` with ``text_config`` and the MXFP4 ``quantization_config``),
``model.safetensors`` (bf16, fp32 for ``A_log`` / ``dt_bias`` / the router bias, routed experts as MXFP4
``weight_packed`` + ``weight_scale``) and ``rocm_k3_tokenizer.json``; plus ``training.json``, the recipe and the
measured losses (no timings, so the same seed writes the same bytes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rocm_k3.model.tiny import write_checkpoint
from rocm_k3.tokenizers.byte import ByteTokenizer
from rocm_k3.training.params import checkpoint_tensors

REPORT_FILE = "training.json"


def write_trained_checkpoint(directory: str | Path, config: dict[str, Any], params: Mapping[str, torch.Tensor],
                             tokenizer: ByteTokenizer, report: Mapping[str, Any]) -> Path:
    """Write config, weights (experts quantised to MXFP4), tokenizer and ``training.json``; returns the directory."""
    root = write_checkpoint(directory, config, checkpoint_tensors(params))
    tokenizer.save(root)
    (root / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return root
