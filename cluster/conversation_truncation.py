"""`truncation: "auto"` of OpenAI's Responses API: a conversation longer than the
prompt may be loses its oldest turns until it fits ("dropping items from the
beginning of the conversation", OpenAI's words), instead of being refused.

A turn starts at a user message, or at the system and developer messages right
before it (instructions given with that turn: a request continuing a response
with `[developer, user]` as its input), and holds what answered it (assistant
messages, their calls, the calls' outputs), so a call is never kept without the
message that made it nor an output without its call (templates render them
together).
A user message that came between a call and its output (the client spoke
before sending the output back) starts no turn: cut there, the output was
kept without its call.
The leading system and developer messages (the request's `instructions`) stay,
and so does the last turn: a conversation whose last turn alone is too long is
left for the prompt's own check to refuse. The fewest turns are dropped, found
by bisection over the turn boundaries (a prompt's length only shrinks as turns
go), so a conversation of n turns costs about log2(n) renderings and
tokenizations, one where it fits already.

A stored conversation (cluster/response_store.py) is kept whole; each request
continuing it is truncated anew.
"""

from __future__ import annotations

from typing import Callable

LEADING_ROLES = ("system", "developer")


def drop_oldest_turns(messages: list, fits: Callable[[list], bool]) -> list:
    """`messages` (chat messages: each has a `role`) as they are if they fit
    (`fits`), else with the fewest oldest turns dropped that make them fit, or
    all but the last turn if none does."""
    if fits(messages):
        return messages
    num_head = next((k for k, m in enumerate(messages) if m.role not in LEADING_ROLES), len(messages))
    head, rest = messages[:num_head], messages[num_head:]
    cuts = _turn_starts(rest)  # where a later turn starts
    low, high = 0, len(cuts) - 1  # the answer is among cuts[low:high + 1]; the last cut always stands
    while low < high:
        middle = (low + high) // 2
        if fits(head + rest[cuts[middle]:]):
            high = middle
        else:
            low = middle + 1
    return head + rest[cuts[low]:] if cuts else messages


def _turn_starts(messages: list) -> list[int]:
    """The indexes past the first where a turn starts: a user message, unless a
    tool's output after it answers a call made before it; or the system and
    developer messages right before such a user message, the first of them."""
    made_at: dict[str, int] = {}  # a call's id -> the index of the latest message that made it
    answers: dict[int, int] = {}  # a tool output's index -> its call's (the latest before it of that id:
    for k, message in enumerate(messages):  # clients reuse ids such as call_0 every turn)
        if message.role == "tool" and message.tool_call_id in made_at:
            answers[k] = made_at[message.tool_call_id]
        for call in message.tool_calls or ():
            if call.id is not None:
                made_at[call.id] = k
    earliest = len(messages)  # the earliest call answered from k on
    starts = []
    for k in range(len(messages) - 1, 0, -1):
        if k in answers:
            earliest = min(earliest, answers[k])
        elif messages[k].role == "user" and earliest >= k:
            start = k
            while start > 1 and messages[start - 1].role in LEADING_ROLES:
                start -= 1
            starts.append(start)
    return starts[::-1]
