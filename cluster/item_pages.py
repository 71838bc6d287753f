"""Pages of stored items, as OpenAI lists a response's `input_items` and a
conversation's items: newest first unless `order` is "asc", `limit` of them,
after the item of id `after` (the last of the page before). Cut in the store's
actor (cluster/response_store.py), so that a page crosses to the scheduler
replica, not the whole list each time; light, as the store's process is: no
imports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Page:
    items: list[dict]
    has_more: bool = False
    after_found: bool = True  # False: no item of id `after` (the page then empty)


def items_page(items: list[dict], limit: int, order: str, after: str | None) -> Page:
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        start = next((k + 1 for k, item in enumerate(ordered) if item["id"] == after), None)
        if start is None:
            return Page([], after_found=False)
    return Page(ordered[start:start + limit], has_more=start + limit < len(ordered))


def listed(items: list[dict], has_more: bool = False) -> dict:
    """Items as OpenAI's list object."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}
