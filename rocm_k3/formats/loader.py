"""Which chat format a checkpoint gets.

``load_chat_renderer(dir, tokenizer)``: config ``model_type`` "kimi_k3" or the byte tokenizer -> K3 XTML; else a
Jinja template (``chat_template.jinja`` or tokenizer_config's ``chat_template``) -> the K2-style renderer; else None.
"""

from __future__ import annotations

from pathlib import Path

from rocm_k3.formats.chat_base import ChatRenderer
from rocm_k3.formats.k2_chat import K2ChatRenderer
from rocm_k3.formats.k3_chat import K3ChatRenderer
from rocm_k3.tokenizers.base import Tokenizer, read_json_if_present
from rocm_k3.tokenizers.byte import ByteTokenizer

K3_MODEL_TYPE = "kimi_k3"


def load_chat_renderer(checkpoint_dir: str | Path, tokenizer: Tokenizer | None) -> ChatRenderer | None:
    """The checkpoint's chat format over ``tokenizer``, or None (no tokenizer, or no known format)."""
    if tokenizer is None:
        return None
    root = Path(checkpoint_dir)
    config = read_json_if_present(root / "config.json") or {}
    if config.get("model_type") == K3_MODEL_TYPE or isinstance(tokenizer, ByteTokenizer):
        return K3ChatRenderer(tokenizer)
    return K2ChatRenderer.from_dir(root, tokenizer)
