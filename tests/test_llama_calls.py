"""Tool calls in Llama 3's JSON format (cluster/llama_calls.py): whole and streamed,
the pattern strict tools hold an answer to, and the format's choice
(`tool_call_parser`; HTTP: tests/test_serve_reasoning.py)."""

from __future__ import annotations

import json
import random
import re
from typing import get_args

import pytest

from actors.json_schema import schema_regex
from actors.regex_dfa import compile_regex
from cluster.config import AppSettings
from cluster.llama_calls import PYTHON_TAG, LlamaStream, held_regex, parse
from cluster.tool_calls import TOOL_CALL_FORMATS, StreamedCalls, Tool, chat_answer, tool_regex
from tests.call_streams import random_answers, streamed

NAMES = {"get_weather", "get_time"}
LLAMA = TOOL_CALL_FORMATS["llama3_json"]


def call(name: str, parameters: dict | None = None, key: str = "parameters") -> str:
    return json.dumps({"name": name, **({} if parameters is None else {key: parameters})})


@pytest.mark.parametrize("text, expected", [
    (call("get_weather", {"city": "Oslo"}), (None, [("get_weather", '{"city": "Oslo"}')])),
    (f"{PYTHON_TAG}{call('get_time', {}, 'arguments')}", (None, [("get_time", "{}")])),
    (f" {call('get_time')}; {call('get_weather', {'city': 'Zürich'})}\n",
     (None, [("get_time", "{}"), ("get_weather", '{"city": "Zürich"}')])),
    ("It is sunny.", ("It is sunny.", [])),
    (f"Sure: {call('get_time')}", (f"Sure: {call('get_time')}", [])),  # calls are the whole answer or none
    (call("rm_rf", {}), (call("rm_rf", {}), [])),  # not one of the tools
    (f"{call('get_time')} and more", (f"{call('get_time')} and more", [])),
    ('{"name": "get_time", "parame', ('{"name": "get_time", "parame', [])),  # cut by max_tokens
    (call("get_time", [1]), (call("get_time", [1]), [])),  # parameters not an object
    (f"{call('get_time')};\n", (None, [("get_time", "{}")])),  # a `;` after the last (found by a review)
    ("", (None, [])),
])
def test_an_answer_is_its_calls_or_its_text(text, expected):
    assert parse(text, NAMES) == expected


def test_without_parallel_calls_the_first_is_the_call_and_the_rest_text():
    text = f"{call('get_time')}; {call('get_weather', {'city': 'Oslo'})}"
    assert parse(text, NAMES, parallel=False) == (call("get_weather", {"city": "Oslo"}), [("get_time", "{}")])


def test_streamed_in_any_pieces_the_answer_is_the_same_as_whole():
    parts = [" ", "\n", "{", "}", ";", "<|python", PYTHON_TAG, "ok", call("get_time"), call("nope"),
             call("get_weather", {"city": "Nice"}), "é"]
    for text, pieces in random_answers(parts, seed=5):
        for parallel in (True, False):
            assert streamed(LlamaStream(NAMES, parallel), pieces) == parse(text, NAMES, parallel), pieces


def test_a_run_of_blank_lines_before_the_answer_is_not_held_piece_by_piece():
    """Found by a review: held and joined at each piece, a model's blank lines
    took time quadratic in their number (1.8 s for 40000 pieces)."""
    stream = LlamaStream(NAMES)
    assert [each for _ in range(1000) for each in stream.feed("\n \n")] == [] and stream.pending == []
    assert stream.feed(call("get_time")) == [] and stream.finish() == [("get_time", "{}")]


def test_text_streams_and_calls_wait_for_the_end():
    text = LlamaStream(NAMES)
    assert text.feed("  <|py") == [] and text.feed("thon is") == ["<|python is"]
    calls = LlamaStream(NAMES)
    assert calls.feed(PYTHON_TAG) == [] and calls.feed(call("get_time")) == []
    assert calls.finish() == [("get_time", "{}")]


CITY = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 5}}}


def test_strict_tools_hold_an_answer_to_text_or_well_formed_calls():
    dfa = compile_regex(held_regex({"get_weather": schema_regex(CITY), "get_time": schema_regex({})}))
    assert dfa.fullmatch(f'{call("get_weather", {"city": "Oslo"})}; {call("get_time", {})}')
    assert dfa.fullmatch(f'{PYTHON_TAG}{call("get_time", {})}') and dfa.fullmatch("  Sunny, 12 C.")
    assert dfa.fullmatch("") and dfa.fullmatch("<|python") and dfa.fullmatch("x {")
    for bad in (call("get_weather", {"city": "Toulouse"}), call("rm_rf", {}), " {", f"{PYTHON_TAG} hi",
                f'{call("get_time", {})} and'):
        assert not dfa.fullmatch(bad), bad
    one = compile_regex(held_regex({"get_time": schema_regex({})}, parallel=False))
    assert not one.fullmatch(f'{call("get_time", {})}; {call("get_time", {})}')
    rng, texts = random.Random(1), ["{", "<", "<|python_tag", PYTHON_TAG, " ", "a", "|", "tag|>"]
    pattern = held_regex({"get_time": schema_regex({})})  # texts of these pieces can be no call: text only
    for _ in range(2000):
        text = "".join(rng.choice(texts) for _ in range(rng.randint(0, 5)))
        begun = text.lstrip()
        assert compile_regex(pattern).fullmatch(text) == (not begun.startswith(("{", PYTHON_TAG))), repr(text)
        assert bool(re.fullmatch(pattern, text)) == compile_regex(pattern).fullmatch(text)


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral"])
def test_a_strict_tools_call_after_any_whitespace_is_held_to_its_schema(fmt):
    """The parsers read an answer's start past the whitespace `str.lstrip` drops,
    the pattern past `\\s`'s ASCII alone: opened with a no-break space (or any of
    Unicode's), a call with arguments its schema refuses was text to the pattern
    and a call to the parser. Behind a reasoning block too."""
    from cluster import reasoning

    tools = [Tool.model_validate({"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 2}}, "required": ["n"]}}})]
    held = compile_regex(tool_regex(tools, "auto", True, TOOL_CALL_FORMATS[fmt]))
    thinking = compile_regex(reasoning.held_regex(tool_regex(tools, "auto", True, TOOL_CALL_FORMATS[fmt], None,
                                                             (reasoning.OPEN,))))
    bodies = ['{"name": "f", "parameters": {"n": 999}}', '[{"name": "f", "arguments": {"n": 999}}]', 'f{"n": 999}']
    for space in (chr(c) for c in range(0x3001) if chr(c).isspace()):
        for body in bodies:
            if held.fullmatch(space + body):
                assert not chat_answer(space + body, "stop", tools, "auto", True, TOOL_CALL_FORMATS[fmt]).calls
            assert not thinking.fullmatch(f"{space}{reasoning.OPEN}x{reasoning.CLOSE}{body}"), repr(space)
        assert held.fullmatch(f"{space}Sunny.")


def test_the_format_is_the_manifests_choice():
    assert set(get_args(AppSettings.model_fields["tool_call_parser"].annotation)) == set(TOOL_CALL_FORMATS)
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_time", "strict": True}})]
    assert compile_regex(tool_regex(tools, "auto", fmt=LLAMA)).fullmatch(call("get_time", {}))
    answer = chat_answer(call("get_time", {}), "stop", tools, "auto", fmt=LLAMA)
    assert answer.finish_reason == "tool_calls" and answer.calls[0]["function"]["name"] == "get_time"
    streamed = StreamedCalls.of(tools, "auto", fmt=LLAMA)
    assert streamed.delta(call("get_time"), False) == {}
    assert streamed.delta("", True)["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
