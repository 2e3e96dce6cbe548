"""Which tokenizer and which chat renderer a checkpoint gets.

``load_tokenizer(dir)``: ``rocm_k3_tokenizer.json`` -> the byte tokenizer (the embedded model); else
``tiktoken.model`` (+ ``tokenizer_config.json``) -> the K3 / Kimi Linear tiktoken tokenizer; else
``tokenizer.json`` -> the ``tokenizers`` package (None when it is not installed); else None (token ids only).

``load_chat_renderer(dir, tokenizer)``: config ``model_type`` "kimi_k3" or the byte tokenizer -> K3 XTML; else a
Jinja template (``chat_template.jinja`` or tokenizer_config's ``chat_template``) -> the K2-style renderer; else None.
"""

from __future__ import annotations

from pathlib import Path

from rocm_k3 import checkpoint_io
from rocm_k3.tokenizers.base import Tokenizer, TokenizerError, config_eos_ids, read_json_if_present
from rocm_k3.tokenizers.byte import TOKENIZER_FILE, ByteTokenizer
from rocm_k3.tokenizers.chat_base import ChatRenderer
from rocm_k3.tokenizers.hf import HF_TOKENIZER_FILE, HFTokenizer
from rocm_k3.tokenizers.k2_chat import K2ChatRenderer
from rocm_k3.tokenizers.k3_chat import K3ChatRenderer
from rocm_k3.tokenizers.kimi_tiktoken import TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE, KimiTiktokenTokenizer

K3_MODEL_TYPE = "kimi_k3"


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it has none this package can read (see the module docstring).

    The files are untrusted input: a path leaving the directory or a non-regular file (a fifo would block a read)
    is refused, and any unusable file raises TokenizerError naming it."""
    root = Path(checkpoint_dir)
    for name in (TOKENIZER_FILE, TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE, HF_TOKENIZER_FILE):
        checkpoint_io.require_regular(checkpoint_io.member(root, name), TokenizerError)
    try:
        return _load(root)
    except TokenizerError:
        raise
    except (ValueError, TypeError, OSError) as exc:
        raise TokenizerError(str(exc)) from exc


def _load(root: Path) -> Tokenizer | None:
    byte = ByteTokenizer.from_dir(root)
    if byte is not None:
        return byte
    if (root / TIKTOKEN_FILE).is_file():
        return KimiTiktokenTokenizer.from_dir(root, extra_eos_ids=config_eos_ids(root))
    return HFTokenizer.from_dir(root, extra_eos_ids=config_eos_ids(root))


def load_chat_renderer(checkpoint_dir: str | Path, tokenizer: Tokenizer | None) -> ChatRenderer | None:
    """The checkpoint's chat format over ``tokenizer``, or None (no tokenizer, or no known format)."""
    if tokenizer is None:
        return None
    root = Path(checkpoint_dir)
    config = read_json_if_present(root / "config.json") or {}
    if config.get("model_type") == K3_MODEL_TYPE or isinstance(tokenizer, ByteTokenizer):
        return K3ChatRenderer(tokenizer)
    return K2ChatRenderer.from_dir(root, tokenizer)
