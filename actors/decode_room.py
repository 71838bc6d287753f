"""The room a decode worker keeps free for the tokens its requests have yet to
generate.

A decode worker (D) reserves a prompt's blocks and its first token's slot in the
handshake (`Engine.reserve`); each later token's KV needs a slot too, and every
`block_size` tokens a new block. Granting reservations while blocks are free for
the prompts alone over-commits the pool: the running requests then outgrow it,
and D preempts them by recompute (actors/scheduler.py) to go on. Under a load
like the handshake benchmark's (a 64-block pool, 40-token prompts, 80 tokens out,
a request every 20 ms; a one-off probe), D preempted 234 times for 200 requests.

So D grants a reservation only while the pool, besides the prompt, has room for
the next `reserve_tokens` tokens (at most its `max_new_tokens`) of the new
request and of every request D holds already, running, preempted or reserved
(`EngineConfig.decode_reserve_tokens`). SGLang's decode side does the same: it
pre-allocates for a transfer only what its free KV leaves after a fixed budget of
future decode tokens for each request it holds (`num_reserved_decode_tokens`,
512 by default). Requests that run past the budget grow as before, and can still
be preempted. A handshake that does not fit waits in D's line
(actors/reservation_queue.py), where the scheduler's admission predicts its wait
(cluster/decode_lines.py) with the same rule (`growth_blocks`).
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.request import Request


def growth_blocks(num_tokens: int, num_generated: int, max_new_tokens: int, num_held_blocks: int,
                  reserve_tokens: int, block_size: int, max_model_len: int) -> int:
    """The blocks a request of `num_tokens` tokens (`num_generated` of them
    generated), holding `num_held_blocks`, may still need for its next tokens:
    at most `reserve_tokens` of them, and only up to `max_new_tokens` in all and
    the model's context (`max_model_len`, where the engine ends a request)."""
    num_more = max(min(max_new_tokens - num_generated, reserve_tokens), 0)
    return max(-(-min(num_tokens + num_more, max_model_len) // block_size) - num_held_blocks, 0)


def owed_blocks(requests: Iterable[Request], reserve_tokens: int, block_size: int, max_model_len: int) -> int:
    """The growth the pool keeps free for `requests` (those a decode engine holds)."""
    return sum(growth_blocks(r.num_tokens, len(r.output_token_ids), r.params.max_new_tokens, len(r.block_table),
                             reserve_tokens, block_size, max_model_len) for r in requests)


def reservation_tokens(num_prompt_tokens: int, max_new_tokens: int, reserve_tokens: int, max_model_len: int) -> int:
    """The tokens a new reservation needs room for: its prompt, its first token's
    slot, and its own next tokens (as `growth_blocks` counts them), within the
    model's context. (Uncapped, a prompt near the context with a large
    max_new_tokens asked for more blocks than a pool the engine accepted it for
    holds, and waited in D's line until its handshake failed.)"""
    return min(num_prompt_tokens + max(min(max_new_tokens, reserve_tokens), 1), max_model_len)
