"""Copy drills: short rows that teach the tiny model to copy from its context before it sees the chats.

Every chat answer needs a copy of something in the user's message (a city, the numbers of a sum, a currency),
and a model cannot copy until it has a retrieval circuit (attention or a delta-rule state that, given the
current token, returns what followed it earlier). Measured on this model (hidden 128, 2 CPU cores, 2048-token
steps): trained on the chat corpus alone for 800 steps it copies nothing ("Repeat after me: Paris, Tokyo" is not
repeated, and answers ignore the question); trained on these drills alone, the loss on the copied half sits at
~2.0 nats/token for ~200 steps, then drops to 0.75 by step 400 (83 % of the copied tokens right, teacher-forced).
So training starts with :attr:`~rocm_k3.training.loop.TrainConfig.drill_steps` steps of drills.

A drill row is ``piece => piece`` lines (``\\n``-separated) up to ``row_tokens`` tokens; only the second copy of
each piece is a target (the first is unpredictable). Pieces: lists of cities, random lowercase words, sums and
amounts with currency codes, and runs of words from the training prose, so the circuit forms on the kinds of
text the chats make it copy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rocm_k3.tokenizers.byte import ByteTokenizer
from rocm_k3.training.chats import CITIES, RATES
from rocm_k3.training.example import Example

DRILL = "drill"
SEPARATOR = " => "
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_CURRENCIES = sorted({c for pair in RATES for c in pair})


def drill_piece(rng: random.Random, words: Sequence[str]) -> str:
    """One text to copy."""
    kind = rng.random()
    if kind < 0.3:
        return ", ".join(rng.sample(CITIES, rng.randint(1, 3)))
    if kind < 0.55:
        return " ".join("".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 8)))
                        for _ in range(rng.randint(1, 4)))
    if kind < 0.75:
        if rng.random() < 0.5:
            return f"{rng.randint(0, 99)} {rng.choice('+-*')} {rng.randint(0, 99)}"
        return f"{rng.choice((1, 5, 10, 20, 25, 50, 100, 250, 500, 1000))} {rng.choice(_CURRENCIES)}"
    if not words:
        return rng.choice(CITIES)
    start = rng.randrange(len(words))
    return " ".join(words[start:start + rng.randint(2, 6)])


def drill_row(rng: random.Random, tokenizer: ByteTokenizer, words: Sequence[str], row_tokens: int) -> Example:
    """One row of ``piece => piece`` lines, at most ``row_tokens`` tokens (at least one line)."""
    ids: list[int] = []
    target: list[bool] = []
    while True:
        piece = drill_piece(rng, words)
        first, second = tokenizer.encode(piece + SEPARATOR), tokenizer.encode(piece + "\n")
        if ids and len(ids) + len(first) + len(second) > row_tokens:
            break
        ids += first + second
        target += [False] * len(first) + [True] * len(second)
    return Example(DRILL, tuple(ids), tuple(target))


def drill_rows(rng: random.Random, tokenizer: ByteTokenizer, words: Sequence[str], count: int,
               row_tokens: int) -> list[Example]:
    """``count`` drill rows; ``words``: a word sequence to draw prose runs from (in order)."""
    return [drill_row(rng, tokenizer, words, row_tokens) for _ in range(count)]
