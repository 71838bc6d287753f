"""What a model writes where a call goes, in each of the three call formats
(cluster/answer_parts.py `known_call`, shared by cluster/hermes_calls.py,
llama_calls.py and mistral_calls.py): whatever it is, the answer is text or
calls, whole and streamed alike, never an exception (a 500 unstreamed, an error
chunk in a stream). Each case raised before a review found it; and tool_choice
"auto" without tools answers the text as written, whole as streamed."""

from __future__ import annotations

import pytest

from cluster.tool_calls import TOOL_CALL_FORMATS, StreamedCalls, Tool, chat_answer

TOOLS = [Tool(type="function", function={"name": "f", "parameters": {"type": "object"}})]


def _answers(text: str, fmt: str, tool_choice: str = "auto", parallel: bool = True):
    """The whole answer's content and calls, and the stream's deltas (text split in two)."""
    whole = chat_answer(text, "stop", TOOLS, tool_choice, parallel, TOOL_CALL_FORMATS[fmt])
    stream = StreamedCalls.of(TOOLS, tool_choice, parallel, TOOL_CALL_FORMATS[fmt])
    half = len(text) // 2
    deltas = [stream.delta(text[:half], False), stream.delta(text[half:], True)]
    return whole, deltas


def _streamed_content(deltas) -> str:
    return "".join((delta or {}).get("content") or "" for delta in deltas)


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": ["f"], "arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": {"a": 1}, "parameters": {}}'),
    ("mistral", '[{"name": ["f"], "arguments": {}}]'),
])
def test_a_name_that_is_not_a_string_is_text(fmt, text):
    """Looked up among the tools' names, a list or object raised TypeError (unhashable)."""
    whole, deltas = _answers(text, fmt)
    assert whole.calls is None and whole.content == text
    assert _streamed_content(deltas) == text


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_arguments_nested_just_under_pythons_limit_are_text_or_a_call(fmt):
    """`json.loads` read arguments nested a little under the recursion limit and
    `json.dumps`, writing them back, raised RecursionError (Llama's and Mistral's
    parsers: outside their guard)."""
    for depth in range(700, 1000):  # (where the two part depends on the stack the test runs on)
        inner = '{"a":' * depth + "1" + "}" * depth
        text = {"hermes": f'<tool_call>{{"name": "f", "arguments": {inner}}}</tool_call>',
                "llama3_json": f'{{"name": "f", "parameters": {inner}}}',
                "mistral": f'[{{"name": "f", "arguments": {inner}}}]'}[fmt]
        whole, deltas = _answers(text, fmt)
        assert whole.calls or whole.content == text


@pytest.mark.parametrize("tools", [None, []])
def test_auto_without_tools_answers_the_text_as_written_whole_and_streamed(tools):
    """The whole answer went through the call parser, which trims the text; the
    stream sent it as written."""
    text = "\n\nHello world\n"
    assert chat_answer(text, "stop", tools, "auto").content == text
    assert StreamedCalls.of(tools, "auto") is None  # (the stream: the text as it comes)
