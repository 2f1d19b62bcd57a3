"""The Responses API's store, as vLLM keeps one with VLLM_ENABLE_RESPONSES_API_STORE=1: finished
responses asked to be stored (`store`, true by default), each with the input items that led to
it, so that a later request's `previous_response_id` continues the conversation and
GET /v1/responses/{id} (and its input_items) and DELETE find it. In memory, the latest
STORED_RESPONSES of them (vLLM keeps every one, and warns of the memory it takes); used on the
event loop only."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as it was answered
    input_items: list[dict]  # the conversation before its output: earlier turns' items, then its input

    @property
    def conversation(self) -> list[dict]:
        """What a request continuing it starts from: its input items, then its output items."""
        return self.input_items + self.response["output"]


class ResponseStore:
    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, input_items: list[dict]) -> None:
        self._responses[response["id"]] = StoredResponse(response, input_items)
        self._responses.move_to_end(response["id"])
        while len(self._responses) > self.capacity:  # the oldest go first
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
