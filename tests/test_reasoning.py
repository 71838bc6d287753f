"""A reasoning model's <think> block apart from its answer (cluster/reasoning.py):
whole and streamed, the patterns that hold the answer after it, the chat deltas,
and the chat body's template variables (HTTP: tests/test_serve_reasoning.py)."""

from __future__ import annotations

import json
import random

import pytest

from actors.regex_dfa import compile_regex
from actors.sampling_defaults import SamplingDefaults
from actors.sampling_params import InvalidRequestError
from cluster.api_models import ChatBody
from cluster.reasoning import (CLOSE, OPEN, Reasoning, ReasoningDeltas, ReasoningStream, held_regex,
                               num_reasoning_tokens, split)
from cluster.tool_calls import StreamedCalls, Tool

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("text, opened, expected", [
    ("<think>\nLet me see.\n</think>\n\nFour.", False, ("Let me see.", "Four.")),
    ("  <think>x</think>", False, ("x", None)),  # thought, then no answer
    ("<think>cut short by max_tokens", False, ("cut short by max_tokens", None)),
    ("Four.", False, (None, "Four.")),  # no block: all answer
    ("Four. <think>x</think>", False, (None, "Four. <think>x</think>")),  # a block later is the answer's text
    ("<thi", False, (None, "<thi")),
    ("<think></think>Four.", False, (None, "Four.")),
    ("Let me see.\n</think>\n\nFour.", True, ("Let me see.", "Four.")),  # the prompt opened the block
    ("still thinking", True, ("still thinking", None)),
    ("", False, (None, None)),
])
def test_the_block_is_the_reasoning_and_the_rest_the_answer(text, opened, expected):
    assert split(text, opened) == expected


def test_streamed_in_any_pieces_the_split_is_the_same_as_whole():
    rng = random.Random(11)
    parts = [OPEN, CLOSE, "<", "</", "<th", "</thi", "think>", "\n", " ", "ok", "é", "<tool_call>"]
    for _ in range(500):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 8)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        for opened in (False, True):
            stream = ReasoningStream(opened)
            out = [each for piece in pieces for each in stream.feed(piece)] + stream.finish()
            joined = tuple("".join(p for part, p in out if part == kind) or None for kind in ("reasoning", "content"))
            assert joined == split(text, opened), (pieces, opened)


def test_a_run_of_blank_lines_before_the_answer_is_not_held_piece_by_piece():
    """Found by a review: held and stripped at each piece, a model's blank lines
    took time quadratic in their number (1.4 s for 40000 pieces)."""
    stream = ReasoningStream()
    assert [each for _ in range(1000) for each in stream.feed("\n \n")] == [] and stream.pending == ""
    assert stream.feed("<think>x</think>\ny") == [("reasoning", "x"), ("content", "y")]


def test_reasoning_streams_before_its_block_closes():
    stream = ReasoningStream()
    assert stream.feed("<thi") == []  # may be the tag
    assert stream.feed("nk>\nLet me") == [("reasoning", "Let me")]
    assert stream.feed(" see.\n</th") == [("reasoning", " see.")]  # the closing tag's start held back
    assert stream.feed("ink>\n\nFour") == [("content", "Four")]
    assert stream.finish() == []


def test_a_pattern_holds_the_answer_after_the_reasoning():
    answer = r'\{"n": [0-9]\}'
    dfa = compile_regex(held_regex(answer))
    assert dfa.fullmatch('{"n": 4}') and dfa.fullmatch('<think>\nSo, 4 </thi nk>.\n</think>\n\n{"n": 4}')
    assert not dfa.fullmatch('<think>a</think>b</think>{"n": 4}')  # the block ends at its first </think>
    assert not dfa.fullmatch('<think>a</think>{"n": 42}')
    opened = compile_regex(held_regex(answer, opened=True))
    assert opened.fullmatch('hmm</think>{"n": 4}') and not opened.fullmatch('{"n": 4}')
    written = r"<think>\n[a-z]+\n</think>\n\n[A-Z]"  # a pattern that says what the reasoning is to be
    assert held_regex(written, written=True) == written
    body = ChatBody(messages=MESSAGES, guided_regex=written)
    assert body.sampling(16, SamplingDefaults(), Reasoning(False)).regex == written


@pytest.mark.parametrize("anchored", [r"^[0-9]+$", r"\A[0-9]+\Z", r"^[0-9]+$|^none$", r"(?s)^[0-9]+$|^.none$"])
@pytest.mark.parametrize("opened", [False, True])
def test_a_clients_anchored_pattern_holds_the_answer_after_the_reasoning(anchored, opened):
    """Wrapped after the reasoning, `^...$` stood mid-pattern: a 400 for a pattern
    the same server took with its reasoning parser off."""
    body = ChatBody(messages=MESSAGES, guided_regex=anchored)
    dfa = compile_regex(body.sampling(16, SamplingDefaults(), Reasoning(opened)).regex)
    thought = "hmm</think>\n" if opened else "<think>hmm</think>\n"
    assert dfa.fullmatch(thought + "42") and not dfa.fullmatch(thought + "4x2") and not dfa.fullmatch(thought)


def test_chat_deltas_give_reasoning_then_the_answer_or_its_calls():
    deltas = ReasoningDeltas(Reasoning(opened=False))
    assert [deltas.delta(piece, False) for piece in ("<think>", "Hm.", "</think>\n", "Hi")] + [
        deltas.delta("", True)] == [{}, {"reasoning_content": "Hm."}, {}, {"content": "Hi"}, {}]
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_time"}})]
    calls = ReasoningDeltas(Reasoning(opened=True), StreamedCalls.of(tools, "auto"))
    first = calls.delta('Time?</think><tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True)
    assert first["reasoning_content"] == "Time?" and first["tool_calls"][0]["function"]["name"] == "get_time"
    assert calls.finish_reason("stop") == "tool_calls"


def test_a_named_functions_call_streams_after_the_reasoning_and_not_at_all_if_cut_in_it():
    """Its call went out with the first chunk, ahead of the reasoning, and stood,
    arguments "", when the answer was cut while it reasoned or was empty after it
    (whole: no call)."""
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_weather"}})]
    named = {"type": "function", "function": {"name": "get_weather"}}
    cut = ReasoningDeltas(Reasoning(opened=False), StreamedCalls.of(tools, named))
    deltas = [cut.delta(piece, False) for piece in ("<think>", "\nThe user", " wants")] + [cut.delta("", True)]
    assert not any("tool_calls" in delta or "content" in delta for delta in deltas)
    assert "".join(delta.get("reasoning_content", "") for delta in deltas) == "The user wants"
    empty = ReasoningDeltas(Reasoning(opened=False), StreamedCalls.of(tools, named))
    deltas = [empty.delta(piece, False) for piece in ("<think>", "Hm.", "</think>\n")] + [empty.delta("", True)]
    assert not any("tool_calls" in delta or "content" in delta for delta in deltas)
    full = ReasoningDeltas(Reasoning(opened=False), StreamedCalls.of(tools, named))
    deltas = [full.delta(piece, False) for piece in ("<think>", "Hm.", "</think>", '{"city": ', '"Bern"}')]
    deltas.append(full.delta("", True))
    assert [i for i, delta in enumerate(deltas) if "tool_calls" in delta][0] == 3  # (with the answer's first text)
    calls = [delta["tool_calls"][0] for delta in deltas if "tool_calls" in delta]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(call["function"]["arguments"] for call in calls) == '{"city": "Bern"}'


def test_chat_template_kwargs_are_the_templates_variables_only():
    assert ChatBody(messages=MESSAGES, chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs
    with pytest.raises(ValueError, match="tools cannot be set here"):
        ChatBody(messages=MESSAGES, chat_template_kwargs={"tools": []})


def test_a_reasoning_chats_pattern_is_held_after_the_reasoning():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = ChatBody(messages=MESSAGES, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    plain, thinking = (body.sampling(16, SamplingDefaults(), reasoning) for reasoning in (None, Reasoning(False)))
    assert compile_regex(plain.regex).fullmatch(json.dumps({"n": 3}))
    assert not compile_regex(plain.regex).fullmatch('<think>x</think>{"n": 3}')
    assert compile_regex(thinking.regex).fullmatch('<think>x</think>{"n": 3}')
    assert ChatBody(messages=MESSAGES).sampling(16, SamplingDefaults(), Reasoning(False)).regex is None
    with pytest.raises(InvalidRequestError):
        ChatBody(messages=MESSAGES, guided_regex="(").sampling(16, SamplingDefaults(), Reasoning(False))


@pytest.mark.parametrize("fmt, call", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"town": 5}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"town": 5}}'),
    ("mistral", '[{"name": "get_weather", "arguments": {"town": 5}}]'),
])
def test_strict_tools_hold_a_call_after_the_reasoning_in_every_format(fmt, call):
    """Llama's and Mistral's strict patterns let free text begin with `<`, so they
    were kept as written (as a client's pattern that says what the reasoning is to
    be): after the reasoning a call was free text, its arguments unchecked."""
    from cluster.tool_calls import TOOL_CALL_FORMATS

    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}]
    body = ChatBody(messages=MESSAGES, tools=tools)
    held = compile_regex(body.sampling(64, SamplingDefaults(), Reasoning(False), TOOL_CALL_FORMATS[fmt]).regex)
    good = call.replace('{"town": 5}', '{"city": "Bern"}')
    assert held.fullmatch(f"<think>\nweather?\n</think>\n\n{good}") and held.fullmatch(good)
    assert not held.fullmatch(f"<think>\nweather?\n</think>\n\n{call}")
    assert held.fullmatch("<think>\nhm\n</think>\n\nIt is sunny.")  # (text after the reasoning: free)


def test_reasoning_tokens_run_through_the_closing_tag(tiny_qwen2_dir):
    """The usage's reasoning tokens: up to and with the token that completes
    `</think>`, all of an answer cut inside the block, none of one without it."""
    from actors.tokenization import load_tokenizer

    tokenizer = load_tokenizer(tiny_qwen2_dir)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    thought, answer = encode("<think>\nsome thought here\n</think>"), encode("\n\nThe answer.")
    assert num_reasoning_tokens(tokenizer, thought + answer) == len(thought)
    assert num_reasoning_tokens(tokenizer, thought[:-2]) == len(thought) - 2  # cut inside the block
    assert num_reasoning_tokens(tokenizer, answer) == 0
    assert num_reasoning_tokens(tokenizer, encode("thinking on\n</think>") + answer, opened=True) == len(
        encode("thinking on\n</think>"))
