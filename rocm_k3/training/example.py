"""One training row: token ids and which of them are targets."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Example:
    """One training row: ``kind`` ("prose" or a chat kind), token ids and the target flag of each token."""

    kind: str
    token_ids: tuple[int, ...]
    target: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.target) or len(self.token_ids) < 2:
            raise ValueError(f"example: expected >= 2 tokens with one target flag each, got "
                             f"{len(self.token_ids)} tokens and {len(self.target)} flags")
