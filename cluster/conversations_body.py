"""The Conversations API's request bodies (`/v1/conversations`): a new
conversation (its first items, its metadata), new metadata, new items. Items are
the Responses API's input items, checked as a response's `input` is (only those
this server can serve: cluster/responses_body.py) and given ids as stored (an
id a client gives is one no other item of the conversation has); at
most `MAX_ITEMS` a request and OpenAI's bounds on metadata (`bounded_metadata`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cluster.responses_body import bounded_metadata, check_unique_ids, item_messages, stored_items

MAX_ITEMS = 20


def checked_items(items: list[dict]) -> list[dict]:
    """`items` as stored (each with an id); 400s for one this server cannot serve."""
    item_messages([(f"items.{k}", item) for k, item in enumerate(items)])
    check_unique_ids(items, param="items")
    return stored_items(items)


class _Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @field_validator("metadata", check_fields=False)
    @classmethod
    def _bounded(cls, metadata):
        return bounded_metadata(metadata)


class NewConversation(_Metadata):
    items: list[dict] = Field(default_factory=list, max_length=MAX_ITEMS)
    metadata: dict[str, str] | None = None


class ConversationUpdate(_Metadata):
    metadata: dict[str, str]


class NewItems(BaseModel):
    model_config = ConfigDict(extra="ignore")
    items: list[dict] = Field(min_length=1, max_length=MAX_ITEMS)
