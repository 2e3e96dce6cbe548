"""rocm-k3's tokenizers as a vLLM tokenizer: the embedded byte tokenizer (``rocm_k3_tokenizer.json``) and the K3 /
Kimi Linear ``tiktoken.model`` tokenizer, with the K3 XTML chat format rendered by rocm-k3's renderer.

Registered as vLLM's ``kimi_k3`` tokenizer mode (the mode vLLM picks for the K3 architecture, whose renderer calls
``apply_chat_template(..., tokenize=True)``), so ``--model DIR`` needs no tokenizer flag. A directory with neither
file falls back to vLLM's HF tokenizer.

Token strings (``convert_ids_to_tokens``, ``get_vocab``): a normal token is its bytes read as Latin-1 (one
character per byte, so partial UTF-8 sequences survive incremental detokenization); a special token is its name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rocm_k3.tokenizers.base import Tokenizer
from rocm_k3.tokenizers.byte import TOKENIZER_FILE
from rocm_k3.tokenizers.kimi_tiktoken import TIKTOKEN_FILE
from rocm_k3.tokenizers.loader import load_tokenizer
from rocm_k3.formats.k3_chat import K3ChatRenderer

# Message keys rocm-k3's renderer reads (vLLM adds bookkeeping keys such as "tool" / "index" to tool messages).
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")


class RocmK3Tokenizer:
    """vLLM's ``TokenizerLike`` over a rocm-k3 :class:`~rocm_k3.tokenizers.base.Tokenizer`."""

    def __init__(self, tokenizer: Tokenizer, name_or_path: str, truncation_side: str = "left") -> None:
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path
        self._truncation_side = truncation_side
        self._renderer = K3ChatRenderer(tokenizer) if "<|open|>" in tokenizer.special_tokens else None
        self._specials = dict(tokenizer.special_tokens)
        self._special_names = {i: n for n, i in self._specials.items()}
        self._vocab: dict[str, int] | None = None

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | Path, *args, trust_remote_code: bool = False,
                        revision: str | None = None, download_dir: str | None = None, **kwargs):
        root = Path(path_or_repo_id)
        if not ((root / TOKENIZER_FILE).is_file() or (root / TIKTOKEN_FILE).is_file()):
            from vllm.tokenizers.hf import CachedHfTokenizer

            return CachedHfTokenizer.from_pretrained(path_or_repo_id, *args, trust_remote_code=trust_remote_code,
                                                     revision=revision, download_dir=download_dir, **kwargs)
        return cls(load_tokenizer(root), str(path_or_repo_id), kwargs.get("truncation_side", "left"))

    # ---- ids and names --------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def max_token_id(self) -> int:
        return self.tokenizer.vocab_size - 1

    @property
    def max_chars_per_token(self) -> int:
        return max(max(len(n) for n in self._specials), 16)

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        eos = self.tokenizer.eos_token_ids
        return eos[0] if eos else None

    @property
    def pad_token_id(self) -> int | None:
        return self.tokenizer.pad_token_id

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self._specials)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._specials.values())

    @property
    def is_fast(self) -> bool:
        return True

    @property
    def truncation_side(self) -> str:
        return self._truncation_side

    def __len__(self) -> int:
        return self.vocab_size

    def __hash__(self) -> int:
        return hash(id(self))

    def num_special_tokens_to_add(self) -> int:
        return 0

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self._specials)

    def get_vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = {self._token(i): i for i in range(self.vocab_size)}
        return dict(self._vocab)

    # ---- text <-> ids ---------------------------------------------------------------------------------------
    def encode(self, text: str, truncation: bool | None = None, max_length: int | None = None,
               add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text)
        if truncation and max_length is not None and len(ids) > max_length:
            ids = ids[-max_length:] if self._truncation_side == "left" else ids[:max_length]
        return ids

    def __call__(self, text: str | list[str], text_pair: str | None = None, add_special_tokens: bool = True,
                 truncation: bool = False, max_length: int | None = None):
        from transformers import BatchEncoding

        if text_pair is not None:
            raise ValueError("rocm-k3's tokenizer does not encode text pairs")
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t, truncation, max_length, add_special_tokens) for t in texts]
        ids_out = ids[0] if isinstance(text, str) else ids
        mask = [1] * len(ids[0]) if isinstance(text, str) else [[1] * len(i) for i in ids]
        return BatchEncoding({"input_ids": ids_out, "attention_mask": mask})

    def decode(self, ids: Sequence[int] | int, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_names]
        return self.tokenizer.decode(ids)

    def _token(self, token_id: int) -> str:
        name = self._special_names.get(token_id)
        return name if name is not None else self.tokenizer.token_bytes(token_id).decode("latin-1")

    def convert_ids_to_tokens(self, ids: Sequence[int], skip_special_tokens: bool = False) -> list[str]:
        return [self._token(i) for i in ids if not (skip_special_tokens and i in self._special_names)]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        if isinstance(tokens, str):
            return self.get_vocab()[tokens]
        vocab = self.get_vocab()
        return [vocab[t] for t in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        raw = b"".join(t.encode("utf-8") if t in self._specials else t.encode("latin-1") for t in tokens)
        return raw.decode("utf-8", errors="replace")

    # ---- chat -------------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            **kwargs) -> str | list[int]:
        """K3 XTML through rocm-k3's renderer: token ids (``tokenize=True``, what vLLM's K3 renderer asks) or
        the prompt text. Reads ``add_generation_prompt``, ``thinking``, ``thinking_effort``, ``tool_choice`` and
        ``response_format``; a message the renderer cannot take is a ValueError naming the field."""
        if self._renderer is None:
            raise ValueError(f"{self.name_or_path}: this tokenizer has no K3 chat control tokens (<|open|>, ...)")
        clean = []
        for m in messages:
            m = dict(m)
            if "reasoning" in m and "reasoning_content" not in m:
                m["reasoning_content"] = m.pop("reasoning")
            clean.append({k: m[k] for k in _MESSAGE_KEYS if m.get(k) is not None})
        chat = self._renderer.render(
            clean, tools=tools or None, tool_choice=kwargs.get("tool_choice"),
            response_format=kwargs.get("response_format"), thinking=kwargs.get("thinking"),
            thinking_effort=kwargs.get("thinking_effort"),
            add_generation_prompt=kwargs.get("add_generation_prompt", True))
        return list(chat.token_ids) if kwargs.get("tokenize", False) else chat.text
