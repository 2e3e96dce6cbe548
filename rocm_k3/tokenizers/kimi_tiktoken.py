"""The K3 / Kimi Linear tokenizer from ``tiktoken.model`` + ``tokenizer_config.json``, without remote code.

``tiktoken.model`` holds one ``base64(bytes) rank`` line per mergeable token (163,584 for K3); the 256 ids above
the ranks are specials, named by ``tokenizer_config.json``'s ``added_tokens_decoder`` and, for unnamed slots,
``<|reserved_token_{id}|>`` (163,840 ids in all). Names a config lists elsewhere (``additional_special_tokens``)
but that have no slot never become ids: nothing at or past ``vocab_size`` is produced or accepted.

Pre-tokenisation is K3's 8-way pattern; the ``&&`` in it is character-class intersection, which tiktoken's Rust
regex engine implements (Python's ``regex`` module does only in V1 mode). Long inputs are cut the way the
checkpoint's own tokenizer cuts them: windows of 400,000 characters, then no run of whitespace or of
non-whitespace longer than 25,000 characters per piece.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import tiktoken

from rocm_k3.tokenizers.base import (
    SpecialIds,
    check_text,
    check_token_id,
    check_token_ids,
    fill_special_slots,
    read_json_object,
    special_split_pattern,
    split_specials,
    token_content,
)

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
NUM_SPECIAL_SLOTS = 256
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

# K3's (and K2's) pre-tokenizer: these 8 alternatives joined by "|", in this order.
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# The message-end token of each chat family: a generation stop id whenever the vocabulary has it.
END_OF_TURN_TOKENS = ("<|end_of_msg|>", "<|im_end|>")


class KimiTiktokenTokenizer(SpecialIds):
    """tiktoken BPE over ``mergeable_ranks`` (ids 0..n-1) plus ``special_tokens`` filling [n, n + 256).

    special_tokens: name -> id for the named specials; the other slots of the block get reserved names.
    eos_token_ids: generation stop ids (validated against the vocabulary); bos/pad: ids or None.
    max_encode_chars / max_run_chars: the long-input cuts (defaults as the checkpoint's tokenizer).
    """

    def __init__(self, mergeable_ranks: Mapping[bytes, int], special_tokens: Mapping[str, int], *,
                 eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None,
                 pad_token_id: int | None = None, name: str = "kimi", source: str = "kimi tokenizer",
                 max_encode_chars: int = MAX_ENCODE_CHARS, max_run_chars: int = MAX_RUN_CHARS) -> None:
        num_base = len(mergeable_ranks)
        if set(mergeable_ranks.values()) != set(range(num_base)):
            raise ValueError(f"{source}: mergeable ranks must be exactly 0..{num_base - 1}")
        missing = [b for b in range(256) if bytes((b,)) not in mergeable_ranks]
        if missing:
            raise ValueError(f"{source}: the single bytes {missing[:8]} have no rank (every byte must encode)")
        for field, value in (("max_encode_chars", max_encode_chars), ("max_run_chars", max_run_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}: expected a positive int, got {value!r}")
        specials = fill_special_slots(special_tokens, num_base, num_base + NUM_SPECIAL_SLOTS, source=source)
        super().__init__(num_base + NUM_SPECIAL_SLOTS, specials, eos_token_ids=eos_token_ids,
                         bos_token_id=bos_token_id, pad_token_id=pad_token_id, source=source)
        self._encoding = tiktoken.Encoding(name, pat_str=KIMI_PAT_STR, mergeable_ranks=dict(mergeable_ranks),
                                           special_tokens=specials)
        self._special_pattern = special_split_pattern(specials)
        self._max_chars = max_encode_chars
        self._max_run = max_run_chars
        self._long_run = re.compile(rf"\s{{{max_run_chars + 1},}}|\S{{{max_run_chars + 1},}}")

    @classmethod
    def from_dir(cls, directory: str | Path, *, extra_eos_ids: Sequence[int] = ()) -> KimiTiktokenTokenizer:
        """Read ``tiktoken.model`` and ``tokenizer_config.json`` of a checkpoint.

        Stop ids: the family's message-end token (``<|end_of_msg|>`` or ``<|im_end|>``) when present, then
        ``extra_eos_ids`` (the checkpoint's generation/config eos), then the config's ``eos_token``.
        """
        root = Path(directory)
        model_file, config_file = root / TIKTOKEN_FILE, root / TOKENIZER_CONFIG_FILE
        if not config_file.is_file():
            raise ValueError(f"{root}: {TIKTOKEN_FILE} needs {TOKENIZER_CONFIG_FILE} (its special tokens)")
        ranks = load_tiktoken_ranks(model_file)
        config = read_json_object(config_file)
        specials = special_tokens_from_config(config, len(ranks), source=str(config_file))
        full = fill_special_slots(specials, len(ranks), len(ranks) + NUM_SPECIAL_SLOTS, source=str(config_file))

        def named(field: str) -> int | None:
            name = token_content(config.get(field), field=field, source=str(config_file))
            if name is None:
                return None
            if name not in full:
                raise ValueError(f"{config_file}: {field} {name!r} is not one of its special tokens")
            return full[name]

        eos = [full[n] for n in END_OF_TURN_TOKENS if n in full] + list(extra_eos_ids)
        eos_token = named("eos_token")
        if eos_token is not None:
            eos.append(eos_token)
        return cls(ranks, specials, eos_token_ids=eos, bos_token_id=named("bos_token"),
                   pad_token_id=named("pad_token"), name=root.name or "kimi", source=str(config_file))

    # ---- the Tokenizer interface (ids and specials: SpecialIds) -----------------------------------------
    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        check_text(text)
        if not allow_special:
            return self._encode_ordinary(text)
        out: list[int] = []
        for piece, special in split_specials(text, self._special_pattern):
            if special:
                out.append(self._specials[piece])
            else:
                out.extend(self._encode_ordinary(piece))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(check_token_ids(ids, self._vocab_size), errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._encoding.decode_single_token_bytes(check_token_id(token_id, self._vocab_size))

    # ---- internals ---------------------------------------------------------------------------------------
    def _encode_ordinary(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self.split_long_input(text):
            out.extend(self._encoding.encode_ordinary(piece))
        return out

    def split_long_input(self, text: str) -> Iterator[str]:
        """The pieces long text is encoded in: ``max_encode_chars`` windows, each cut so that no run of
        whitespace or of non-whitespace in a piece is longer than ``max_run_chars`` (a run is cut every
        ``max_run_chars`` characters from its start)."""
        for start in range(0, len(text), self._max_chars):
            window = text[start:start + self._max_chars]
            if len(window) <= self._max_run:
                yield window
                continue
            cuts = [cut for run in self._long_run.finditer(window)
                    for cut in range(run.start() + self._max_run, run.end(), self._max_run)]
            prev = 0
            for cut in cuts:
                yield window[prev:cut]
                prev = cut
            yield window[prev:]


def load_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    """The ``base64(bytes) rank`` lines of a ``tiktoken.model``; a malformed line is a ValueError naming the file
    and line (the file is read here, never through tiktoken's download cache)."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ValueError(f"{file}: cannot read ({exc})") from exc
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{file}:{number}: expected 'base64-token rank', got {line[:60]!r}")
        try:
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{file}:{number}: expected 'base64-token rank', got {line[:60]!r}") from exc
        if token in ranks:
            raise ValueError(f"{file}:{number}: token {token!r} appears twice")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{file}: no ranks")
    if set(ranks.values()) != set(range(len(ranks))):
        raise ValueError(f"{file}: ranks must be exactly 0..{len(ranks) - 1} (each once)")
    return ranks


def special_tokens_from_config(config: Mapping[str, Any], num_base: int, *, source: str) -> dict[str, int]:
    """``added_tokens_decoder`` (``{"163584": {"content": "[BOS]", ...}, ...}``) as name -> id; every id must be a
    special slot [num_base, num_base + 256)."""
    table = config.get("added_tokens_decoder", {})
    if not isinstance(table, Mapping):
        raise ValueError(f"{source}: added_tokens_decoder: expected an object id -> token")
    out: dict[str, int] = {}
    stop = num_base + NUM_SPECIAL_SLOTS
    for key, entry in table.items():
        try:
            token_id = int(key)
        except ValueError as exc:
            raise ValueError(f"{source}: added_tokens_decoder: id {key!r} is not an integer") from exc
        if not num_base <= token_id < stop:
            raise ValueError(f"{source}: added_tokens_decoder: id {token_id} is outside the special slots "
                             f"[{num_base}, {stop}) of this vocabulary")
        name = token_content(entry, field=f"added_tokens_decoder[{key}]", source=source)
        if name is None:
            raise ValueError(f"{source}: added_tokens_decoder[{key}]: expected a token, got null")
        if name in out:
            raise ValueError(f"{source}: added_tokens_decoder: {name!r} has ids {out[name]} and {token_id}")
        out[name] = token_id
    return out
