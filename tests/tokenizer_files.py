"""Tokenizer files the tokenizer tests write themselves (no download).

``write_kimi_tokenizer(dir, table, words)`` writes a ``tiktoken.model`` in the released layout (163,584 ranks:
the 256 bytes, every prefix of each word in ``words`` so that each word is one token, then filler tokens no
text can reach) and a ``tokenizer_config.json`` whose ``added_tokens_decoder`` is ``table`` (id -> name).
K3_TABLE is K3's special-token table (SERVING_SPEC 1.3), K2_TABLE the K2 / Kimi Linear one.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

NUM_RANKS = 163_584
VOCAB_SIZE = NUM_RANKS + 256

K3_TABLE = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|end_of_msg|>", 163587: "<|open|>", 163588: "<|close|>",
    163589: "<|sep|>", 163590: "[start_header_id]", 163591: "[end_header_id]", 163593: "[EOT]",
    163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>", 163605: "<|media_pad|>",
    163649: "<osagent_mode>", 163838: "[UNK]", 163839: "[PAD]",
}
K3_NOT_SPECIAL = ("<|open|>", "<|close|>", "<|sep|>")  # marked "special": false in the released config

K2_TABLE = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>", 163588: "<|im_assistant|>",
    163590: "<|start_header_id|>", 163591: "<|end_header_id|>", 163593: "[EOT]", 163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>", 163596: "<|tool_calls_section_end|>", 163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>", 163599: "<|tool_call_end|>", 163601: "<|im_middle|>",
    163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>", 163605: "<|media_pad|>",
    163606: "<think>", 163607: "</think>", 163838: "[UNK]", 163839: "[PAD]",
}
# K3's tokenization_kimi.py still lists K2's names (HF discussion #65); none of them may become an id.
K2_ONLY_NAMES = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                 "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"]

# The K3 tag names and attribute pieces as single tokens, as in the real vocabulary.
XTML_WORDS = ["message", "think", "response", "tools", "call", "argument", "json", " role", " type", " tool",
              " index", " key", " name", '="', '"', "system", "user", "assistant", "tool"]


def rank_table(words: Iterable[str]) -> dict[bytes, int]:
    """256 byte ranks, then every prefix (2+ bytes) of each word, shorter prefixes first, then filler to
    NUM_RANKS (4-byte tokens led by 0xF8, which no UTF-8 text contains)."""
    ranks = {bytes((b,)): b for b in range(256)}
    prefixes = {w.encode()[:k] for w in words for k in range(2, len(w.encode()) + 1)}
    for token in sorted(prefixes, key=lambda p: (len(p), p)):
        ranks[token] = len(ranks)
    filler = 0
    while len(ranks) < NUM_RANKS:
        ranks[b"\xf8" + filler.to_bytes(3, "big")] = len(ranks)
        filler += 1
    return ranks


def write_kimi_tokenizer(directory: Path, table: Mapping[int, str], words: Iterable[str] = XTML_WORDS, *,
                         not_special: Iterable[str] = (), extra_config: Mapping | None = None) -> dict[bytes, int]:
    """Write ``tiktoken.model`` and ``tokenizer_config.json`` into ``directory``; returns the ranks."""
    directory.mkdir(parents=True, exist_ok=True)
    ranks = rank_table(words)
    lines = (f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items())
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    skip = set(not_special)
    config = {
        "added_tokens_decoder": {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": name not in skip}
                                 for i, name in table.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer",
        **(extra_config or {}),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ranks


def write_k3_tokenizer(directory: Path, words: Iterable[str] = ()) -> dict[bytes, int]:
    """The K3 files, with K2's names in additional_special_tokens as the released config has them."""
    return write_kimi_tokenizer(directory, K3_TABLE, [*XTML_WORDS, *words], not_special=K3_NOT_SPECIAL,
                                extra_config={"additional_special_tokens": K2_ONLY_NAMES})


def write_config(directory: Path, model_type: str, eos_token_id: int | list[int]) -> None:
    (directory / "config.json").write_text(json.dumps({"model_type": model_type, "eos_token_id": eos_token_id}))


# A small template in the K2 shape of SERVING_SPEC 2.3 (written for these tests; Kimi Linear's renderer).
K2_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>"
    "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}<|im_end|>{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'user' -%}<|im_user|>{%- elif message['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>{%- endif -%}\n"
    "{{ message.get('name') or message['role'] }}<|im_middle|>"
    "{%- if message['role'] == 'tool' -%}## Return of {{ message['tool_call_id'] }}{{ '\\n' }}{%- endif -%}"
    "{{ message['content'] or '' }}"
    "{%- if message.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{{ call['function']['arguments'] }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "<|im_end|>\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)
