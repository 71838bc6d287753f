"""A request's prompt checked against the deployment's limits before anything is
spent on it: its ids (`encode_prompt`: text encoded, ids as given), cut to their
last `keep_last` when asked (vLLM's truncate_prompt_tokens; -1: as many as the
limits below let this request have), each id in the vocabulary (the prompt's
and those its params name: logit_bias, allowed and stop token ids; and allowed
ids not all banned from the first draw by the model's end tokens under
min_new_tokens), and the prompt, the output and both together within `limits`
(cluster/config.py) and the model's context. Each refusal is an ApiError 400
that names the limit, and the output's length in words, not by one API's
field (max_tokens, max_completion_tokens, max_output_tokens, max_new_tokens:
each API that shares this check names it its own way). (A logit_bias id
outside the vocabulary was found by P's engine, after D had reserved blocks
for the request, and counted among the failed requests.)

An output length the client asked for is checked as asked: past the context,
it is refused, as OpenAI, vLLM and SGLang refuse it (it was served cut at the
context, which a client could not tell from a length it had chosen). One left
out (`SamplingParams.max_new_tokens_is_default`) is the default held to the
room the prompt leaves (`fitted_output`), as vLLM sizes an omitted max_tokens:
a long prompt is not refused for an output length nobody asked for."""

from __future__ import annotations


from actors.sampling_params import InvalidRequestError, SamplingParams
from actors.tokenization import encode_prompt
from cluster.api_models import ApiError
from cluster.config import LimitSettings


def prompt_ids_within_limits(
    tokenizer, limits: LimitSettings, max_model_len: int, prompt: str | list[int], params: SamplingParams, *,
    add_special_tokens: bool = True, keep_last: int | None = None, eos_token_ids: tuple[int, ...] = (),
    vocab_size: int | None = None,
) -> list[int]:
    """`vocab_size`: the ids both the model and the tokenizer know (the least of
    the model's `vocab_size` and `len(tokenizer)`; the tokenizer's when None):
    an id only the tokenizer knew passed here and failed on P's engine, after D
    had reserved for it; one only the model knew has no text to write."""
    ids = encode_prompt(tokenizer, prompt, add_special_tokens=add_special_tokens)
    if keep_last is not None:
        asked = None if params.max_new_tokens_is_default else params.max_new_tokens
        ids = ids[-(prompt_room(limits, max_model_len, output_room(asked, params.min_new_tokens))
                    if keep_last == -1 else keep_last):]
    if not ids:
        raise ApiError(400, "prompt is empty")
    vocab = len(tokenizer) if vocab_size is None else vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})")
    try:
        params.check_token_ids(vocab, eos_token_ids)  # the engine checks again, with its bad_words too
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc)) from None
    if len(ids) > limits.max_prompt_tokens:
        raise ApiError(400, f"prompt has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}")
    if len(ids) >= max_model_len:
        raise ApiError(400, f"prompt has {len(ids)} tokens; the model's context is {max_model_len}")
    new_tokens = fitted_output(limits, max_model_len, len(ids), params).max_new_tokens
    asked = "up to" if not params.max_new_tokens_is_default else "at least"  # (a default: its min_new_tokens)
    if new_tokens > limits.max_new_tokens:
        raise ApiError(400, f"the request asks for {asked} {new_tokens} new tokens; "
                            f"the limit is {limits.max_new_tokens}")
    total = len(ids) + new_tokens
    if total > max_model_len:
        raise ApiError(400, f"prompt has {len(ids)} tokens and the request asks for {asked} {new_tokens} new "
                            f"tokens: {total} tokens, past the model's context of {max_model_len}")
    if limits.max_total_tokens is not None and total > limits.max_total_tokens:
        raise ApiError(400, f"prompt plus the new tokens asked for is {total} tokens; "
                            f"the limit is {limits.max_total_tokens}")
    if len(params.stop) > limits.max_stop_sequences:
        raise ApiError(400, f"{len(params.stop)} stop sequences; the limit is {limits.max_stop_sequences}")
    return ids


def fitted_output(limits: LimitSettings, max_model_len: int, num_prompt: int,
                  params: SamplingParams) -> SamplingParams:
    """`params`, a default output length held to the room a prompt of
    `num_prompt` tokens leaves under the context and the limits (at least one
    token, and its min_new_tokens: where that is past the room, the checks
    above refuse it). An asked-for length is left as asked."""
    if not params.max_new_tokens_is_default:
        return params
    room = min(limits.max_new_tokens, max_model_len - num_prompt)
    if limits.max_total_tokens is not None:
        room = min(room, limits.max_total_tokens - num_prompt)
    new_tokens = max(min(params.max_new_tokens, room), params.min_new_tokens, 1)
    return params if new_tokens == params.max_new_tokens else params.with_max_new_tokens(new_tokens)


def output_room(asked: int | None, min_new_tokens: int) -> int:
    """The new tokens a prompt cut to fit must leave room for: those `asked`
    for, or, left out (None), the default's least (`min_new_tokens`, at least
    one): the default is fitted to what the prompt leaves (`fitted_output`), so
    a prompt is not cut for an output length nobody asked for."""
    return max(min_new_tokens, 1) if asked is None else asked


def prompt_room(limits: LimitSettings, max_model_len: int, max_new_tokens: int) -> int:
    """The most prompt tokens a request for `max_new_tokens` passes the checks above with
    (at least one: a request with no room is refused for its output's length).
    vLLM's -1 keeps the context's length, which leaves a prompt no room to
    generate in; here it keeps what the request can be served with, its output
    included."""
    room = min(limits.max_prompt_tokens, max_model_len - max_new_tokens)
    if limits.max_total_tokens is not None:
        room = min(room, limits.max_total_tokens - max_new_tokens)
    return max(room, 1)
