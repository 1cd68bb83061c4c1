"""The Responses API's stored responses (``store``, on by default): the last ``MAX_STORED`` in
memory, least recently used first out, each with the conversation a follow-up continues
(``previous_response_id``). A restart forgets them."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED = 1000


@dataclass
class Stored:
    response: dict[str, Any]  # as /v1/responses answered it
    messages: list[dict[str, Any]]  # its conversation as chat messages: the input's, then its output's


class ResponseStore:
    def __init__(self, max_stored: int = MAX_STORED) -> None:
        self.max_stored = max_stored
        self._stored: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, stored: Stored) -> None:
        response_id = stored.response["id"]
        self._stored[response_id] = stored
        self._stored.move_to_end(response_id)
        while len(self._stored) > self.max_stored:
            self._stored.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        stored = self._stored.get(response_id)
        if stored is not None:
            self._stored.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._stored.pop(response_id, None) is not None
