"""Tool calls read out of a model's answer in Hermes' format (cluster/hermes_calls.py),
whole and streamed, the pattern strict tools hold it to, and the chat choice's
message they make (cluster/tool_calls.py)."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from actors.json_schema import schema_regex
from actors.regex_dfa import compile_regex
from cluster.hermes_calls import CLOSE, OPEN, HermesStream, held_regex, parse
from cluster.tool_calls import StreamedCalls, Tool, chat_answer, tool_regex
from tests.call_streams import random_answers, streamed

NAMES = {"get_weather", "get_time"}


def block(name: str, arguments: dict | None = None, **extra) -> str:
    value = {"name": name, **({} if arguments is None else {"arguments": arguments}), **extra}
    return f"{OPEN}\n{json.dumps(value)}\n{CLOSE}"


def test_blocks_naming_a_tool_are_calls_and_the_rest_is_text():
    text = f"Let me look.\n{block('get_weather', {'city': 'Zürich'})}\n{block('get_time')}\n"
    assert parse(text, NAMES) == ("Let me look.", [("get_weather", '{"city": "Zürich"}'), ("get_time", "{}")])
    assert parse(block("get_time", {}), NAMES) == (None, [("get_time", "{}")])  # nothing else: null content
    assert parse("  just text \n", NAMES) == ("just text", [])
    assert parse("", NAMES) == (None, [])


@pytest.mark.parametrize("bad", [
    block("rm_rf", {}),  # not one of the tools
    block("get_time", arguments="now"),  # arguments not an object
    f"{OPEN}\n{{\"name\": \"get_time\", \"arguments\": {{}}\n{CLOSE}",  # JSON not closed
    f"{OPEN}\n[\"get_time\"]\n{CLOSE}",  # not an object
    f"{OPEN}\n{{\"name\": \"get_time\"",  # the block never closed (cut by max_tokens)
    "<tool_ca",  # a tag's start at the end
    f"{CLOSE} stray",
    # Found by a review: arguments under another key were a call with none; NaN and 1e999 came back
    # as arguments no JSON parser reads; a lone surrogate's escape made the whole answer a 500
    block("get_weather", args={"city": "Oslo"}),
    block("get_time", {}, parameters={}),
    f'{OPEN}\n{{"name": "get_weather", "arguments": {{"n": NaN}}}}\n{CLOSE}',
    f'{OPEN}\n{{"name": "get_weather", "arguments": {{"n": 1e999}}}}\n{CLOSE}',
    f'{OPEN}\n{{"name": "get_weather", "arguments": {{"q": "\\ud83d"}}}}\n{CLOSE}',
])
def test_a_block_that_is_not_a_call_stays_in_the_text_as_written(bad):
    assert parse(f"Before {bad}", NAMES) == (f"Before {bad}".strip(), [])
    assert parse(f"{block('get_time')} {bad}", NAMES) == (bad.strip(), [("get_time", "{}")])


def test_a_last_block_whose_close_tag_never_came_is_a_call_if_its_body_is_one():
    """The model stopped (or a stop string "</tool_call>" cut it) before the close
    tag: the answer was the call's markup, finish_reason "stop"."""
    text = f"Looking.\n{OPEN}\n" + '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    assert parse(text, NAMES) == ("Looking.", [("get_weather", '{"city": "Oslo"}')])
    assert parse(f"{block('get_time')}{OPEN}{{}}", NAMES, parallel=False) == (f"{OPEN}{{}}", [("get_time", "{}")])


def test_arguments_under_parameters_are_read_as_llamas_are():
    text = block("get_weather", parameters={"city": "Oslo"})
    assert parse(text, NAMES) == (None, [("get_weather", '{"city": "Oslo"}')])
    described = block("get_weather", {"city": "Oslo"}, description="the weather")  # other keys let be, as vLLM
    assert parse(described, NAMES) == (None, [("get_weather", '{"city": "Oslo"}')])


def test_without_parallel_calls_only_the_first_block_is_a_call():
    text = f"{block('get_time')}\n{block('get_weather', {'city': 'Oslo'})}"
    assert parse(text, NAMES, parallel=False) == (block("get_weather", {"city": "Oslo"}), [("get_time", "{}")])


def _streamed(pieces: list[str], parallel: bool = True) -> tuple:
    return tuple(streamed(HermesStream(NAMES, parallel), pieces))


def test_streamed_in_any_pieces_the_answer_is_the_same_as_whole():
    """Random answers of text, calls, bad blocks and partial tags, cut at random
    places (single characters too): the pieces together parse as the whole does."""
    parts = [" ", "\n", "ok", "<", "<tool", "</tool_call>", "<tool_call>", "tool_call>", block("get_time"),
             block("get_weather", {"city": "Nice"}), block("nope", {}), f"{OPEN}{{bad}}{CLOSE}", "é 👋",
             block("get_weather", {"city": f'a{CLOSE}"<</tool\\'}), f'{OPEN} {{"a": "<"}} <{CLOSE}']
    for text, pieces in random_answers(parts, seed=7, max_parts=8, max_cuts=6):
        for parallel in (True, False):
            assert _streamed(pieces, parallel) == tuple(parse(text, NAMES, parallel)), (pieces, parallel)
        assert _streamed(list(text)) == tuple(parse(text, NAMES))


def test_text_streams_before_the_call_block_closes():
    stream = HermesStream(NAMES)
    assert stream.feed("Checking the weather") == ["Checking the weather"]
    assert stream.feed(" now.\n<tool") == [" now."]  # the tag's start and the line break held back
    assert stream.feed('_call>\n{"name": "get_time", "arguments": {}}') == []
    assert stream.feed("\n</tool_call>") == [("get_time", "{}")]
    assert stream.finish() == []


TOOLS = [Tool.model_validate({"type": "function", "function": {"name": name}}) for name in sorted(NAMES)]


def test_an_auto_answer_that_calls_ends_with_tool_calls():
    answer = chat_answer(f"Sure. {block('get_time')}", "stop", TOOLS, None)  # no tool_choice: "auto"
    assert answer.content == "Sure." and answer.finish_reason == "tool_calls"
    assert [c["function"] for c in answer.calls] == [{"name": "get_time", "arguments": "{}"}]
    assert chat_answer("Sure.", "stop", TOOLS, "auto") == ("Sure.", None, "stop")
    assert chat_answer(f"{block('get_time')} and", "length", TOOLS, "auto").finish_reason == "length"
    assert chat_answer(block("get_time"), "stop", TOOLS, "none") == (block("get_time"), None, "stop")


def test_streamed_auto_deltas_number_their_calls():
    calls = StreamedCalls.of(TOOLS, "auto")
    deltas = [calls.delta(piece, False) for piece in ("Hi ", block("get_time"), block("get_weather", {}), " ")]
    deltas.append(calls.delta("", True))
    assert deltas[0] == {"content": "Hi"} and deltas[-1] == {}
    assert [(d["tool_calls"][0]["index"], d["tool_calls"][0]["function"]["name"]) for d in deltas[1:3]] == [
        (0, "get_time"), (1, "get_weather")]
    assert calls.finish_reason("stop") == "tool_calls" and StreamedCalls.of(TOOLS, "none") is None


CITY = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 5}},
        "additionalProperties": False}


def _held_reference(text: str, parallel: bool) -> bool:
    """Whether `text` is an answer the held pattern allows: every `<tool_call>`
    tag opens a block laid out as the template writes one, of arguments valid
    for CITY."""
    call = re.compile(re.escape(f'{OPEN}\n{{"name": "get_weather", "arguments": ') + r'(\{"city": "(?:[^"\\]|\\.)*"\})'
                      + re.escape(f"}}\n{CLOSE}"))
    position, num_calls = text.find(OPEN), 0
    while position >= 0:
        found = call.match(text, position)
        if found is None or len(json.loads(found.group(1))["city"]) > 5:
            return False
        position, num_calls = text.find(OPEN, found.end()), num_calls + 1
    return parallel or num_calls <= 1


def test_strict_tools_hold_an_auto_answer_to_text_and_well_formed_calls():
    rng = random.Random(3)
    good = [block("get_weather", {"city": city}) for city in ("Oslo", "", "Nice", "Zü")]
    parts = [*good, block("get_weather", {"city": "Toulouse"}), block("get_time", {}), "<", "<tool_call", OPEN, "a",
             "\n", "_call>", "é", f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "x"}}}}']
    for parallel in (True, False):
        dfa = compile_regex(held_regex({"get_weather": schema_regex(CITY)}, parallel))
        for _ in range(1500):
            text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 5)))
            assert dfa.fullmatch(text) == _held_reference(text, parallel), (text, parallel)
        state = dfa.walk(1, f"Checking {OPEN}".encode())  # a tag opened: a call's layout, nothing else
        assert np.nonzero(dfa.transitions[state])[0].tolist() == [ord("\n")]


def test_only_strict_tools_hold_an_auto_answer():
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    strict = {"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": True}}
    assert tool_regex([Tool.model_validate(weather)], "auto") is None
    clock = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})  # held too, once one is strict
    pattern = tool_regex([Tool.model_validate(strict), clock], None)  # OpenAI's default: auto
    dfa = compile_regex(pattern)
    assert dfa.fullmatch(f'Sure.\n{block("get_weather", {"city": "Oslo"})}\n{block("get_time", {})}')
    assert not dfa.fullmatch(block("get_weather", {"city": "Toulouse"}))
    assert not compile_regex(tool_regex([Tool.model_validate(strict)], "auto", parallel=False)).fullmatch(
        block("get_weather", {"city": "a"}) * 2)


def test_a_required_answer_that_is_not_calls_of_the_tools_is_text():
    """Held to its pattern only a cut answer is not calls; any other shape is text too."""
    for text in ('{"name": "get_time", "parameters": {}}', '[{"name": "rm_rf", "parameters": {}}]', "[]", '["x"]'):
        assert chat_answer(text, "stop", TOOLS, "required") == (text, None, "stop"), text
    whole = chat_answer('[{"name": "get_time", "parameters": {}}]', "stop", TOOLS, "required")
    assert whole.content is None and whole.calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_a_close_tag_inside_an_arguments_string_is_the_arguments_not_the_blocks_end():
    """A strict call's pattern lets a string hold `</tool_call>`; the block ended
    at it, and the call came back as text. A body that is not a JSON object still
    ends at its first close tag."""
    written = {"text": f"ends with {CLOSE} and \\\" {CLOSE}"}
    text = f"Writing.\n{block('get_weather', written)}\n"
    expected = ("Writing.", [("get_weather", json.dumps(written))])
    assert parse(text, NAMES) == expected
    for whole, pieces in random_answers([text], seed=3, max_parts=1, num_answers=50):
        assert streamed(HermesStream(NAMES), pieces) == (expected if whole else (None, []))
    not_json = f'{OPEN}she said "hi{CLOSE}{block("get_time", {})}'
    assert parse(not_json, NAMES) == (f'{OPEN}she said "hi{CLOSE}', [("get_time", "{}")])
    # Streamed a few characters at a time, a long call whose arguments hold the tag (each
    # piece searched the body again from its start, and from there for each tag inside a
    # string: 23 s of the event loop for 30 KB, 0.012 s whole; the body is now read once)
    written = {"path": "a.py", "content": f"# {CLOSE} \\ \" x\n" * 400}
    text = block("get_weather", written)
    expected = (None, [("get_weather", json.dumps(written))])
    assert streamed(HermesStream(NAMES), [text[i:i + 3] for i in range(0, len(text), 3)]) == expected
