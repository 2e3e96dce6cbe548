"""Tokenizers and chat renderers: the embedded byte tokenizer, K3 / Kimi Linear from ``tiktoken.model``, a
checkpoint's ``tokenizer.json``; the K3 XTML renderer and the K2-style Jinja renderer; incremental
detokenization. :func:`load_tokenizer` and :func:`load_chat_renderer` choose from a checkpoint directory."""

from rocm_k3.tokenizers.base import Tokenizer, TokenizerError
from rocm_k3.tokenizers.byte import TOKENIZER_FILE, ByteTokenizer, embedded_byte_tokenizer
from rocm_k3.tokenizers.chat_base import ChatRenderer, RenderedChat, ThinkingOptions, thinking_options
from rocm_k3.tokenizers.detokenizer import IncrementalDetokenizer
from rocm_k3.tokenizers.hf import HF_TOKENIZER_FILE, HFTokenizer
from rocm_k3.tokenizers.k2_chat import CHAT_TEMPLATE_FILE, K2ChatRenderer
from rocm_k3.tokenizers.k3_chat import K3ChatRenderer
from rocm_k3.tokenizers.kimi_tiktoken import TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE, KimiTiktokenTokenizer
from rocm_k3.tokenizers.loader import load_chat_renderer, load_tokenizer

__all__ = [
    "CHAT_TEMPLATE_FILE", "HF_TOKENIZER_FILE", "TIKTOKEN_FILE", "TOKENIZER_CONFIG_FILE", "TOKENIZER_FILE",
    "ByteTokenizer", "ChatRenderer", "HFTokenizer", "IncrementalDetokenizer", "K2ChatRenderer", "K3ChatRenderer",
    "KimiTiktokenTokenizer", "RenderedChat", "ThinkingOptions", "Tokenizer", "TokenizerError", "embedded_byte_tokenizer",
    "load_chat_renderer", "load_tokenizer", "thinking_options",
]
