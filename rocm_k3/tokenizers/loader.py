"""Which tokenizer a checkpoint gets (its chat format: :func:`rocm_k3.formats.load_chat_renderer`).

``load_tokenizer(dir)``: ``rocm_k3_tokenizer.json`` -> the byte tokenizer (the embedded model); else
``tiktoken.model`` (+ ``tokenizer_config.json``) -> the K3 / Kimi Linear tiktoken tokenizer; else
``tokenizer.json`` -> the ``tokenizers`` package (None when it is not installed); else None (token ids only).
"""

from __future__ import annotations

from pathlib import Path

from rocm_k3 import checkpoint_io
from rocm_k3.tokenizers.base import Tokenizer, TokenizerError, config_eos_ids
from rocm_k3.tokenizers.byte import TOKENIZER_FILE, ByteTokenizer
from rocm_k3.tokenizers.hf import HF_TOKENIZER_FILE, HFTokenizer
from rocm_k3.tokenizers.kimi_tiktoken import TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE, KimiTiktokenTokenizer


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

