"""A scheduler replica's view of the stored conversations: OpenAI's Conversations
API (`/v1/conversations`: a conversation object, its metadata and its items) over
the store actor's calls (cluster/response_store.py), and a response's turn on one
(`conversation` in `POST /v1/responses`).

A response given `conversation` goes on from the conversation's items, as if they
came first in its `input`; once it has completed (or was cut at its token limit)
its input and output items are added to the conversation, so the next response on
it goes on from there; one that failed or was cancelled adds nothing. A
conversation takes one response at a time: another meanwhile is refused with
OpenAI's `conversation_locked` (400: retry once the first has finished). The turn
is held for at most the request's timeout and a margin (`TURN_MARGIN_S`), so a
replica that dies mid-response frees its conversations by then; a background
response's turn ends with it (cancelled, or lost: cluster/background_responses.py).

Unlike `previous_response_id` (a chain of responses, which branches where two
responses continue one), a conversation is one list, items added and deleted by
id, whatever answered them. OpenAI keeps a conversation until deleted; here the
store's bound evicts the least recently used (cluster/response_store.py).
"""

from __future__ import annotations

import asyncio
import contextlib

from actors.background import background_task
from cluster.api_models import ApiError
from cluster.item_pages import listed
from cluster.stored_responses import StoredResponses, check_page, listed_page

TURN_MARGIN_S = 60.0  # a turn's lease past the request's timeout (a background response waits to be admitted)


class StoredConversations:
    """The Conversations API's semantics (404s, OpenAI's shapes, turns) over the
    store's calls, made through `stored` (the same store and its retries)."""

    def __init__(self, stored: StoredResponses, request_timeout_s: float) -> None:
        self.stored = stored
        self.turn_lease_s = request_timeout_s + TURN_MARGIN_S
        self._ending: set = set()  # turns ended in tasks of their own (held: the loop keeps weak references)

    async def create(self, conversation: dict, items: list[dict]) -> dict:
        await self._found(conversation["id"], lambda store: store.create_conversation.remote(conversation, items),
                          _too_large("items"))
        return conversation

    async def get(self, conversation_id: str) -> dict:
        """The conversation's object (GET's answer)."""
        return await self._found(conversation_id, lambda store: store.conversation_object.remote(conversation_id))

    async def update(self, conversation_id: str, metadata: dict) -> dict:
        return await self._found(conversation_id,
                                 lambda store: store.update_conversation.remote(conversation_id, metadata),
                                 _too_large("metadata"))

    async def delete(self, conversation_id: str) -> dict:
        await self._found(conversation_id, lambda store: store.delete_conversation.remote(conversation_id),
                          _not_found(conversation_id))
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def add_items(self, conversation_id: str, items: list[dict]) -> dict:
        """The items added, as OpenAI lists them."""
        added = await self._found(conversation_id, lambda store: store.add_items.remote(conversation_id, items),
                                  _too_large("items"))
        if isinstance(added, str):
            raise ApiError(400, f"Duplicate item found with id {added}: the conversation has one. Remove duplicate "
                                "items from your input and try again.", param="items")
        return listed(items)

    async def items(self, conversation_id: str, limit: int = 20, order: str = "desc", after: str | None = None) -> dict:
        check_page(limit, order)
        page = await self._found(conversation_id, lambda store: store.conversation_items.remote(
            conversation_id, limit, order, after))
        return listed_page(page, after, f"conversation {conversation_id!r}")

    async def item(self, conversation_id: str, item_id: str) -> dict:
        return await self._found(conversation_id,
                                 lambda store: store.conversation_item.remote(conversation_id, item_id),
                                 _item_not_found(conversation_id, item_id))

    async def delete_item(self, conversation_id: str, item_id: str) -> dict:
        """The conversation without the item (OpenAI answers the conversation)."""
        return await self._found(conversation_id, lambda store: store.delete_item.remote(conversation_id, item_id),
                                 _item_not_found(conversation_id, item_id))

    async def turn(self, conversation_id: str, response_id: str) -> ConversationTurn:
        """`response_id`'s turn on the conversation, begun: its items, to go on
        from; a 404 where it is not stored, OpenAI's 400 where another response's
        turn it is."""
        if not self.stored.enabled:
            raise ApiError(400, "conversation: this server stores no conversations (response_store_mib is 0); "
                                "send the whole conversation in `input`", param="conversation")
        try:
            found = await self.stored.call(
                lambda store: store.begin_turn.remote(conversation_id, response_id, self.turn_lease_s))
        except asyncio.CancelledError:  # (its client left as the store gave it the turn: it held it for its lease)
            self.abandon_turn(conversation_id, response_id)
            raise
        if found.missing_id is not None:
            raise _not_found(conversation_id, param="conversation")
        if found.running_id is not None:
            raise ApiError(400, "Another process is currently operating on this conversation (response "
                                f"{found.running_id!r}). Please retry in a few seconds.", param="conversation",
                           code="conversation_locked")
        return ConversationTurn(self, conversation_id, response_id, found.items)

    def abandon_turn(self, conversation_id: str, response_id: str) -> None:
        """The turn over, nothing added: the store told in a task of its own."""
        task = background_task(self.stored.call(
            lambda store: store.end_turn.remote(conversation_id, response_id, None)))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _found(self, conversation_id: str, remote, refused: ApiError | None = None):
        """`remote(store)`'s answer about the conversation: a 404 where it is
        None (not stored), `refused` where it is False."""
        if not self.stored.enabled:
            raise ApiError(400, "this server stores no conversations (response_store_mib is 0)")
        answer = await self.stored.call(remote)
        if answer is None:
            raise _not_found(conversation_id)
        if answer is False:
            raise refused
        return answer


class ConversationTurn:
    """A response's turn on a conversation, begun (`StoredConversations.turn`,
    `items` what it goes on from), ended once: by the store, as the response is
    kept there (`handed_on`: `ResponseStore.keep`, or for a background one
    `finish`, `cancel`, ...), or by `abandon` (nothing added; the response never
    ended: refused, or left by its client)."""

    def __init__(self, view: StoredConversations, conversation_id: str, response_id: str,
                 items: list[dict]) -> None:
        self.view, self.conversation_id, self.response_id = view, conversation_id, response_id
        self.items = items
        self.is_over = False

    def abandon(self) -> None:
        """The turn over, nothing added (from anywhere: a closing stream's
        `finally` too; the store is told in a task of its own)."""
        if not self.is_over:
            self.is_over = True
            self.view.abandon_turn(self.conversation_id, self.response_id)

    def over_with(self, events) -> TurnEvents:
        """`events`, a streamed response's, then the turn abandoned if they ended
        before it did (`TurnEvents`)."""
        return TurnEvents(self, events)

    def handed_on(self) -> None:
        """The store ends it, from now on."""
        self.is_over = True


class TurnEvents:
    """A streamed response's events on a conversation turn: closed (they close
    `events`), failed, read to their end, or dropped unread, the turn is
    abandoned unless the store ended it. Dropped unread: a client gone before
    its stream's body started. An async generator never started runs no
    `finally`, so that turn held the conversation until its lease ran out."""

    def __init__(self, turn: ConversationTurn, events) -> None:
        self.turn, self.events = turn, events
        try:  # (the finalizer may run on any thread, where a cycle's collection comes)
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.events.__anext__()
        except BaseException:  # (their end too: the store ended the turn before the last event)
            self.turn.abandon()
            raise

    async def aclose(self) -> None:
        try:
            await self.events.aclose()
        finally:
            self.turn.abandon()

    def __del__(self) -> None:
        if not self.turn.is_over and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # (its loop closed: the process is ending)
                self._loop.call_soon_threadsafe(self.turn.abandon)


def _not_found(conversation_id: str, param: str = "conversation_id") -> ApiError:
    return ApiError(404, f"Conversation with id {conversation_id!r} not found.", param=param)


def _too_large(param: str) -> ApiError:
    return ApiError(400, f"{param}: the conversation would be too large to store (response_store_mib)", param=param)


def _item_not_found(conversation_id: str, item_id: str) -> ApiError:
    return ApiError(404, f"Item with id {item_id!r} not found in conversation {conversation_id!r}.", param="item_id")
