"""The endpoints over what the Responses API stores: a stored response
(`GET`/`DELETE /v1/responses/{id}`, its `input_items`, `cancel`) and the
Conversations API (`/v1/conversations`, its items). Thin: each answers one call of
the scheduler replica's views (cluster/stored_responses.py,
cluster/stored_conversations.py), which its `app.state` holds (`stored`,
`conversations`, set as the replica starts); the app includes this router
(cluster/app.py), so these share its API key, body limit and JSON errors.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from cluster.api_models import ApiError
from cluster.conversations_body import ConversationUpdate, NewConversation, NewItems, checked_items
from cluster.openai_format import sse_response
from cluster.responses_format import new_id
from cluster.strict_json import StrictJsonRoute

router = APIRouter(route_class=StrictJsonRoute)  # as the app's (cluster/strict_json.py)


def _stored(request: Request):
    return request.app.state.stored  # cluster/stored_responses.py StoredResponses


def _conversations(request: Request):
    return request.app.state.conversations  # cluster/stored_conversations.py StoredConversations


# ---- stored responses ------------------------------------------------------------------
@router.get("/v1/responses/{response_id}")
async def stored_response(request: Request, response_id: str, stream: bool = False, starting_after: int = -1):
    """The response; with `stream`, a streamed background response's events
    replayed, after `starting_after` (a sequence number), to its last."""
    if stream:
        events = await _stored(request).replay(response_id, starting_after)
        return sse_response(events)
    return await _stored(request).get(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str):
    cancelled = await _stored(request).cancel(response_id)
    if cancelled["status"] == "cancelled":  # (one that finished first is left to store its end)
        request.app.state.background.stop(response_id)  # served here: stopped now, not at its next beat
    return cancelled


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    deleted = await _stored(request).delete(response_id)
    request.app.state.background.stop(response_id)
    return deleted


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(request: Request, response_id: str, limit: int = 20, order: str = "desc",
                               after: str | None = None, before: str | None = None):
    _refuse_before(before)
    return await _stored(request).input_items(response_id, limit, order, after)


# ---- conversations -----------------------------------------------------------------------
@router.post("/v1/conversations")
async def create_conversation(request: Request, body: NewConversation | None = None):
    body = body or NewConversation()
    conversation = {"id": new_id("conv"), "object": "conversation", "created_at": int(time.time()),
                    "metadata": body.metadata or {}}
    return await _conversations(request).create(conversation, checked_items(body.items))


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(request: Request, conversation_id: str):
    return await _conversations(request).get(conversation_id)


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(request: Request, conversation_id: str, body: ConversationUpdate):
    return await _conversations(request).update(conversation_id, body.metadata)


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(request: Request, conversation_id: str):
    return await _conversations(request).delete(conversation_id)


@router.post("/v1/conversations/{conversation_id}/items")
async def add_conversation_items(request: Request, conversation_id: str, body: NewItems):
    return await _conversations(request).add_items(conversation_id, checked_items(body.items))


@router.get("/v1/conversations/{conversation_id}/items")
async def conversation_items(request: Request, conversation_id: str, limit: int = 20, order: str = "desc",
                             after: str | None = None, before: str | None = None):
    _refuse_before(before)
    return await _conversations(request).items(conversation_id, limit, order, after)


def _refuse_before(before: str | None) -> None:
    """A `before` cursor (some clients send one, as OpenAI's first input-items
    listing took) is refused: dropped, as an unknown query parameter is, the
    client was given the first page again, and paging back never reached the
    items it asked for."""
    if before is not None:
        raise ApiError(400, "before is not supported: page with after, and order 'asc' to read the list the other "
                            "way", param="before")


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def conversation_item(request: Request, conversation_id: str, item_id: str):
    return await _conversations(request).item(conversation_id, item_id)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_conversation_item(request: Request, conversation_id: str, item_id: str):
    return await _conversations(request).delete_item(conversation_id, item_id)
