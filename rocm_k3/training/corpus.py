"""The training corpus of the embedded model: standard-library prose and generated K3 chats, as token ids with
target masks, split into a training set and a held-out set of the same distribution.

Prose documents (:mod:`rocm_k3.training.prose`) go to the held-out set by a stable hash of their text (so the
split does not depend on the seed), then are shuffled and packed into rows of at most ``prose_row_chars``
(documents separated by a blank line); every token of a prose row is a target. Chats
(:mod:`rocm_k3.training.chats`) are drawn from two independent seeded streams, one per split (``repeat`` chats
quote short sentences of the training prose), and rendered with
:class:`~rocm_k3.formats.k3_chat.K3ChatRenderer`; their assistant turns are the targets. Copy drills
(:mod:`rocm_k3.training.drills`, words from the training prose) are kept apart in ``Corpus.drills``: the training
loop runs its first steps on them; held-out drills join the held-out set.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import zlib
from collections.abc import Sequence

from rocm_k3.tokenizers.byte import ByteTokenizer
from rocm_k3.formats.k3_chat import K3ChatRenderer
from rocm_k3.training.chats import make_chat, render_training_chat
from rocm_k3.training.drills import DRILL, drill_rows
from rocm_k3.training.example import Example
from rocm_k3.training.prose import ProseDocument, prose_documents, stdlib_docstrings, word_list

PROSE = "prose"
__all__ = ["DRILL", "PROSE", "Corpus", "CorpusConfig", "Example", "build_corpus"]


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    """seed: chat draws and prose packing; chats / heldout_chats: chats per split; prose_row_chars: prose row
    length; heldout_every: one prose document in this many (by hash) is held out; drills / heldout_drills: copy
    drill rows (:mod:`rocm_k3.training.drills`) of at most drill_row_tokens tokens per split."""

    seed: int = 0
    chats: int = 2400
    heldout_chats: int = 96
    prose_row_chars: int = 512
    heldout_every: int = 20
    drills: int = 3200
    heldout_drills: int = 32
    drill_row_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("chats", "heldout_chats", "prose_row_chars", "heldout_every", "drills", "heldout_drills",
                     "drill_row_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: list[Example]
    heldout: list[Example]  # held-out prose, chats and drills
    words: frozenset[str]  # the words of all prose (the dictionary generated prose is measured against)
    drills: list[Example] = dataclasses.field(default_factory=list)  # training copy drills (the first steps)

    def summary(self) -> dict[str, dict[str, int]]:
        """Per split and kind: rows, tokens and target tokens."""
        out: dict[str, dict[str, int]] = {}
        for split, rows in (("train", self.train + self.drills), ("heldout", self.heldout)):
            counts: dict[str, int] = collections.Counter()
            for ex in rows:
                counts[f"{ex.kind}_rows"] += 1
                counts[f"{ex.kind}_tokens"] += len(ex.token_ids)
                counts[f"{ex.kind}_targets"] += sum(ex.target)
            out[split] = dict(sorted(counts.items()))
        return out


def build_corpus(config: CorpusConfig, tokenizer: ByteTokenizer,
                 docstrings: Sequence[tuple[str, str]] | None = None) -> Corpus:
    """The corpus (``docstrings``: the standard library's, collected when None)."""
    docs = prose_documents(stdlib_docstrings() if docstrings is None else docstrings)
    held = [d for d in docs if zlib.crc32(d.text.encode()) % config.heldout_every == 0]
    kept = [d for d in docs if zlib.crc32(d.text.encode()) % config.heldout_every != 0]
    rng = random.Random(f"prose-{config.seed}")
    renderer = K3ChatRenderer(tokenizer)
    sentences = repeatable_sentences(kept)
    train = _prose_rows(kept, config.prose_row_chars, rng, tokenizer) + _chat_rows(
        renderer, random.Random(f"chats-train-{config.seed}"), config.chats, sentences)
    heldout = _prose_rows(held, config.prose_row_chars, rng, tokenizer) + _chat_rows(
        renderer, random.Random(f"chats-heldout-{config.seed}"), config.heldout_chats, sentences)
    train_words = " ".join(d.text for d in kept).split()
    drills = drill_rows(random.Random(f"drills-train-{config.seed}"), tokenizer, train_words, config.drills,
                        config.drill_row_tokens)
    heldout += drill_rows(random.Random(f"drills-heldout-{config.seed}"), tokenizer, train_words,
                          config.heldout_drills, config.drill_row_tokens)
    return Corpus(train, heldout, word_list([d.text for d in docs]), drills)


def _prose_rows(docs: Sequence[ProseDocument], row_chars: int, rng: random.Random,
                tokenizer: ByteTokenizer) -> list[Example]:
    order = list(docs)
    rng.shuffle(order)
    rows, current = [], ""
    for doc in order:
        joined = f"{current}\n\n{doc.text}" if current else doc.text
        if current and len(joined) > row_chars:
            rows.append(current)
            joined = doc.text
        current = joined
    if current:
        rows.append(current)
    out = []
    for text in rows:
        ids = tuple(tokenizer.encode(text))
        out.append(Example(PROSE, ids, (True,) * len(ids)))
    return out


def repeatable_sentences(docs: Sequence[ProseDocument], max_chars: int = 100) -> list[str]:
    """The short first sentences of ``docs`` (what ``repeat`` chats ask the model to say back)."""
    out = []
    for doc in docs:
        first = doc.text.split("\n\n")[0]
        end = first.find(". ")
        sentence = first if end < 0 else first[:end + 1]
        if len(sentence) <= max_chars:
            out.append(sentence)
    return out


def _chat_rows(renderer: K3ChatRenderer, rng: random.Random, count: int, sentences: Sequence[str]) -> list[Example]:
    out = []
    for _ in range(count):
        chat = make_chat(rng, texts=sentences)
        rendered = render_training_chat(renderer, chat)
        out.append(Example(chat.kind, tuple(rendered.token_ids), tuple(rendered.target)))
    return out
