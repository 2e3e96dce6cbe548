"""N-gram (prompt lookup) proposer: integers only, runs in the scheduler.

For n from ``max_n`` down to ``min_n``: find the most recent earlier occurrence of the sequence's last n tokens
and propose the (up to k) tokens that followed it. No match: no draft.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``token_ids`` (empty when no n-gram of the tail recurs)."""
    total = len(token_ids)
    if k <= 0 or total < 2:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = list(token_ids[total - n:])
        for start in range(total - n - 1, -1, -1):  # most recent match first
            if token_ids[start] == tail[0] and list(token_ids[start:start + n]) == tail:
                follow = token_ids[start + n:start + n + k]
                if follow:
                    return list(follow)
    return []
