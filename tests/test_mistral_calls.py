"""Tool calls in Mistral's formats (cluster/mistral_calls.py), the array and the
named (tokenizer v11) layouts: whole and streamed, with and without the
`[TOOL_CALLS]` and `[ARGS]` tags (special tokens that a text decoded without
special tokens loses), the pattern strict tools hold an answer to, and the
format's choice (`tool_call_parser: mistral`)."""

from __future__ import annotations

import json
import random
import re

import pytest

from actors.json_schema import schema_regex
from actors.regex_dfa import compile_regex
from cluster.mistral_calls import ARGS, TOOL_CALLS, MistralStream, held_regex, parse, parse_held
from cluster.tool_calls import TOOL_CALL_FORMATS, StreamedCalls, Tool, chat_answer, tool_regex
from tests.call_streams import random_answers, streamed

NAMES = {"get_weather", "get_time"}
MISTRAL = TOOL_CALL_FORMATS["mistral"]


def call(name: str, arguments: dict | None = None) -> dict:
    return {"name": name, **({} if arguments is None else {"arguments": arguments})}


def calls(*items: dict) -> str:
    return json.dumps(list(items), ensure_ascii=False)


def named(name: str, arguments: dict, tags: bool = True) -> str:
    """A call in the v11 layout, its tags written or (decoded without special tokens) lost."""
    return (TOOL_CALLS + name + ARGS if tags else name) + json.dumps(arguments, ensure_ascii=False)


@pytest.mark.parametrize("text, expected", [
    (TOOL_CALLS + calls(call("get_weather", {"city": "Oslo"})), (None, [("get_weather", '{"city": "Oslo"}')])),
    (" " + calls(call("get_time"), call("get_weather", {"city": "Zürich"})) + "\n",  # no tag: it was a special token
     (None, [("get_time", "{}"), ("get_weather", '{"city": "Zürich"}')])),
    ("It is sunny.", ("It is sunny.", [])),
    ("Sure: " + calls(call("get_time")), ("Sure: " + calls(call("get_time")), [])),  # the whole answer or none
    (TOOL_CALLS + calls(call("rm_rf")), (TOOL_CALLS + calls(call("rm_rf")), [])),  # not one of the tools
    (calls(call("get_time")) + " and more", (calls(call("get_time")) + " and more", [])),
    (TOOL_CALLS + '[{"name": "get_time", "argu', (TOOL_CALLS + '[{"name": "get_time", "argu', [])),  # cut short
    (calls(call("get_time", [1])), (calls(call("get_time", [1])), [])),  # arguments not an object
    ("[1, 2, 3]", ("[1, 2, 3]", [])), ("[]", ("[]", [])),  # lists, not calls
    ("", (None, [])),
    # The named layout (v11), tags written or lost:
    (named("get_weather", {"city": "Oslo"}), (None, [("get_weather", '{"city": "Oslo"}')])),
    (" " + named("get_time", {}, tags=False) + named("get_weather", {"city": "Nice"}, tags=False) + " ",
     (None, [("get_time", "{}"), ("get_weather", '{"city": "Nice"}')])),
    (named("get_time", {}) + "\n" + named("get_time", {"tz": "UTC"}), (None, [("get_time", "{}"),
                                                                     ("get_time", '{"tz": "UTC"}')])),
    ("get_time is a tool.", ("get_time is a tool.", [])),
    (named("get_time", {}) + " and more", (named("get_time", {}) + " and more", [])),  # the whole answer or none
    (named("rm_rf", {}), (named("rm_rf", {}), [])), ("rm_rf{}", ("rm_rf{}", [])),  # not one of the tools
    (named("get_time", {}) + "[]", (named("get_time", {}) + "[]", [])),
    (TOOL_CALLS + "get_time" + ARGS + "[1]", (TOOL_CALLS + "get_time" + ARGS + "[1]", [])),  # not an object
    (TOOL_CALLS + 'get_time{"tz": "U', (TOOL_CALLS + 'get_time{"tz": "U', [])),  # cut short
    (ARGS + "{}", (ARGS + "{}", [])), ("get_ti", ("get_ti", [])),
    # Found by a review: text, then the tag (kept: `reads_special_tokens`) and calls, was all text
    ("I will check the weather." + named("get_weather", {"city": "Paris"}),
     ("I will check the weather.", [("get_weather", '{"city": "Paris"}')])),
    ("Let me look that up. " + TOOL_CALLS + calls(call("get_time")), ("Let me look that up.", [("get_time", "{}")])),
    ("See " + TOOL_CALLS + calls(call("rm_rf")), ("See " + TOOL_CALLS + calls(call("rm_rf")), [])),
    ("a [TOOLS] list", ("a [TOOLS] list", [])),
])
def test_an_answer_is_its_calls_or_its_text(text, expected):
    assert parse(text, NAMES) == expected


def test_without_parallel_calls_the_first_is_the_call_and_the_others_text():
    text = TOOL_CALLS + calls(call("get_time"), call("get_weather", {"city": "Oslo"}))
    assert parse(text, NAMES, parallel=False) == (calls(call("get_weather", {"city": "Oslo"})),
                                                  [("get_time", "{}")])
    text = named("get_time", {}) + " " + named("get_weather", {"city": "Oslo"})
    assert parse(text, NAMES, parallel=False) == (named("get_weather", {"city": "Oslo"}), [("get_time", "{}")])


def test_streamed_in_any_pieces_the_answer_is_the_same_as_whole():
    parts = [" ", "\n", "[", "]", ",", "[TOOL", TOOL_CALLS, "ok", calls(call("get_time")), calls(call("nope")),
             json.dumps(call("get_weather", {"city": "Nice"})), "é", "get_", "get_time", ARGS, "[AR", "{}",
             '{"tz": "UTC"}', named("get_weather", {"city": "Nice"}, tags=False)]
    for text, pieces in random_answers(parts, seed=7):
        for parallel in (True, False):
            assert streamed(MistralStream(NAMES, parallel), pieces) == parse(text, NAMES, parallel), pieces


def test_text_streams_and_calls_wait_for_the_end():
    text = MistralStream(NAMES)
    assert text.feed("  ") == [] and text.feed("It is") == ["It is"]
    held = MistralStream(NAMES)
    assert held.feed(TOOL_CALLS) == [] and held.feed(calls(call("get_time"))) == []
    assert held.finish() == [("get_time", "{}")]
    waits = MistralStream(NAMES)  # it may begin a named call: it waits till it can tell
    assert waits.feed("get_t") == [] and waits.feed("ime is") == ["get_time is"]


CITY = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 5}}}


def test_strict_tools_hold_an_answer_to_text_or_well_formed_calls():
    dfa = compile_regex(held_regex({"get_weather": schema_regex(CITY), "get_time": schema_regex({})}))
    assert dfa.fullmatch(TOOL_CALLS + calls(call("get_weather", {"city": "Oslo"}), call("get_time", {})))
    assert dfa.fullmatch(calls(call("get_time", {}))) and dfa.fullmatch("  Sunny, 12 C.") and dfa.fullmatch("")
    for bad in (calls(call("get_weather", {"city": "Toulouse"})), calls(call("rm_rf", {})), " [", "[x]",
                calls(call("get_time", {})) + " and", named("get_time", {})):
        assert not dfa.fullmatch(bad), bad
    one = compile_regex(held_regex({"get_time": schema_regex({})}, parallel=False))
    assert not one.fullmatch(calls(call("get_time", {}), call("get_time", {})))
    pattern = held_regex({"get_time": schema_regex({})})
    rng, texts = random.Random(2), ["[", "]", " ", "a", TOOL_CALLS, "{"]
    for _ in range(1000):  # texts of these pieces are no call: text, unless they begin with `[`
        text = "".join(rng.choice(texts) for _ in range(rng.randint(0, 5)))
        assert compile_regex(pattern).fullmatch(text) == (not text.lstrip().startswith("[")), repr(text)
        assert bool(re.fullmatch(pattern, text)) == compile_regex(pattern).fullmatch(text)


def test_a_held_answer_is_read_in_the_layout_its_pattern_admits():
    """Text that the pattern lets begin with a tool's name (its arguments not held
    to the schema) is text, not a named call; held arrays are calls."""
    unchecked = named("get_weather", {"city": "Toulouse"}, tags=False)
    assert compile_regex(held_regex({"get_weather": schema_regex(CITY)})).fullmatch(unchecked)
    assert parse_held(unchecked, NAMES) == (unchecked, [])
    assert parse(unchecked, NAMES).calls  # (an answer not held reads it as a call)
    array = TOOL_CALLS + calls(call("get_weather", {"city": "Oslo"}))
    assert parse_held(array, NAMES) == (None, [("get_weather", '{"city": "Oslo"}')])
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "strict": True,
                                                                   "parameters": CITY}})]
    answer = chat_answer(unchecked, "stop", tools, "auto", fmt=MISTRAL)
    assert answer.calls is None and answer.content == unchecked
    streamed = StreamedCalls.of(tools, "auto", fmt=MISTRAL)
    assert streamed.delta(unchecked, True) == {"content": unchecked}
    loose = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": CITY}})]
    assert chat_answer(unchecked, "stop", loose, "auto", fmt=MISTRAL).calls[0]["function"]["name"] == "get_weather"


def test_the_chat_answer_reads_mistral_calls():
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_time", "strict": True}})]
    assert compile_regex(tool_regex(tools, "auto", fmt=MISTRAL)).fullmatch(TOOL_CALLS + calls(call("get_time", {})))
    answer = chat_answer(TOOL_CALLS + calls(call("get_time", {})), "stop", tools, "auto", fmt=MISTRAL)
    assert answer.finish_reason == "tool_calls" and answer.calls[0]["function"]["name"] == "get_time"
    streamed = StreamedCalls.of(tools, "auto", fmt=MISTRAL)
    assert streamed.delta(TOOL_CALLS + calls(call("get_time")), False) == {}
    assert streamed.delta("", True)["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_calls_get_the_nine_letters_and_digits_ids_mistrals_templates_take_back():
    """Mistral's chat templates refuse a call id that is not 9 letters and digits:
    with OpenAI's `call_...` ids, every tool loop's second turn was a 400 (the
    template could not be applied)."""
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_time"}})]
    nine = re.compile(r"[A-Za-z0-9]{9}")
    answer = chat_answer(TOOL_CALLS + calls(call("get_time", {})), "stop", tools, "auto", fmt=MISTRAL)
    named = chat_answer("{}", "stop", tools, {"type": "function", "function": {"name": "get_time"}}, fmt=MISTRAL)
    streamed = StreamedCalls.of(tools, "auto", fmt=MISTRAL)
    streamed.delta(TOOL_CALLS + calls(call("get_time")), False)
    ids = [answer.calls[0]["id"], named.calls[0]["id"], streamed.delta("", True)["tool_calls"][0]["id"]]
    assert all(nine.fullmatch(each) for each in ids) and len(set(ids)) == 3, ids
    assert re.fullmatch(r"call_[0-9a-f]{24}", chat_answer('<tool_call>{"name": "get_time"}</tool_call>', "stop", tools,
                                                          "auto").calls[0]["id"])  # (Hermes: OpenAI's form)


def test_a_held_answers_tag_after_text_is_text():
    """Strict tools: the pattern's text may write the tag, and what follows it
    is unchecked; it stays text."""
    text = "Sure. " + TOOL_CALLS + calls(call("get_time"))
    assert parse_held(text, NAMES) == (text, [])


@pytest.mark.parametrize("tool_choice, parser, skips", [
    ("auto", "mistral", False), (None, "mistral", False), ("none", "mistral", True), ("auto", "hermes", True)])
def test_a_request_with_tools_decodes_mistrals_tag(tool_choice, parser, skips):
    """The tag that tells calls from the text before them is a special token:
    decoded without special tokens (the default), the text's end ran into the
    first call's name."""
    from actors.sampling_defaults import SamplingDefaults
    from cluster.api_models import ChatBody

    body = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], "tool_choice": tool_choice,
                                    "tools": [{"type": "function", "function": {"name": "get_time"}}]})
    assert body.sampling(16, SamplingDefaults(), None, TOOL_CALL_FORMATS[parser]).skip_special_tokens is skips
