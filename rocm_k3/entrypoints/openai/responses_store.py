"""The in-memory store of ``/v1/responses``: the last ``max_size`` responses (least recently used dropped first),
each with the conversation it ended (the chat messages, its own output included) so that a later request can
continue it with ``previous_response_id``, and the task of a background request (for ``cancel``)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any


@dataclasses.dataclass
class StoredResponse:
    """One response: its body (the Response object as sent), the chat messages it continues from plus its output
    as assistant / tool messages, and the running task of a background request (None once done)."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    task: asyncio.Task | None = None


class ResponseStore:
    """Bounded LRU map from response id to :class:`StoredResponse`."""

    def __init__(self, max_size: int) -> None:
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0:
            raise ValueError(f"responses_store_size: expected an int >= 0, got {max_size!r}")
        self.max_size = max_size
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.max_size == 0:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
