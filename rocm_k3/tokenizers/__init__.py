"""Tokenizers: the embedded byte tokenizer, K3 / Kimi Linear from ``tiktoken.model``, a checkpoint's
``tokenizer.json``; incremental detokenization. :func:`load_tokenizer` chooses from a checkpoint directory. Chat
formats (renderers and output parsers) live one layer up, in :mod:`rocm_k3.formats`."""

from rocm_k3.tokenizers.base import Tokenizer, TokenizerError
from rocm_k3.tokenizers.byte import TOKENIZER_FILE, ByteTokenizer, embedded_byte_tokenizer
from rocm_k3.tokenizers.detokenizer import IncrementalDetokenizer
from rocm_k3.tokenizers.hf import HF_TOKENIZER_FILE, HFTokenizer
from rocm_k3.tokenizers.kimi_tiktoken import TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE, KimiTiktokenTokenizer
from rocm_k3.tokenizers.loader import load_tokenizer

__all__ = [
    "HF_TOKENIZER_FILE", "TIKTOKEN_FILE", "TOKENIZER_CONFIG_FILE", "TOKENIZER_FILE",
    "ByteTokenizer", "HFTokenizer", "IncrementalDetokenizer", "KimiTiktokenTokenizer", "Tokenizer", "TokenizerError",
    "embedded_byte_tokenizer", "load_tokenizer",
]
