"""The Conversations API's request bodies (`/v1/conversations`): a new
conversation (its first items, its metadata), new metadata, new items. Items are
the Responses API's input items, checked as a response's `input` is (only those
this server can serve: cluster/responses_body.py) and given ids as stored (an
id a client gives is one no other item of the conversation has); at
most `MAX_ITEMS` a request and `MAX_METADATA` metadata pairs, OpenAI's bounds.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cluster.responses_body import check_unique_ids, item_messages, stored_items

MAX_ITEMS = 20
MAX_METADATA = 16
MAX_KEY_CHARS, MAX_VALUE_CHARS = 64, 512


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
        if metadata is None:
            return metadata
        if len(metadata) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} pairs, not {len(metadata)}")
        for key, value in metadata.items():
            if len(key) > MAX_KEY_CHARS or len(value) > MAX_VALUE_CHARS:
                raise ValueError(f"keys of at most {MAX_KEY_CHARS} characters, values of at most {MAX_VALUE_CHARS}: "
                                 f"not {key[:MAX_KEY_CHARS + 1]!r}")
        return metadata


class NewConversation(_Metadata):
    items: list[dict] = Field(default_factory=list, max_length=MAX_ITEMS)
    metadata: dict[str, str] | None = None


class ConversationUpdate(_Metadata):
    metadata: dict[str, str]


class NewItems(BaseModel):
    model_config = ConfigDict(extra="ignore")
    items: list[dict] = Field(min_length=1, max_length=MAX_ITEMS)
