"""Stored responses (store: true), kept in memory for GET /v1/responses/{id} and for follow-ups that
name them as previous_response_id.

The store is bounded: past --max-stored-responses the least recently used one goes (a read or a
follow-up counts as a use), so a server that answers for weeks never grows without end. Each
entry keeps the whole conversation its response ended (every earlier input, its own input and its
output), so a follow-up still works after the responses before it were evicted or deleted. Only
the event loop touches the store: no lock.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict          # the response object as it was answered
    conversation: tuple     # input items, then the output's items: what a follow-up continues


class ResponseStore:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, stored: StoredResponse) -> None:
        if self.max_size == 0:
            return
        self._entries[stored.response["id"]] = stored
        self._entries.move_to_end(stored.response["id"])
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
