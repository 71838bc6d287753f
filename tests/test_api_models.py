"""The HTTP bodies on their own: which text gets the tokenizer's special tokens,
how chat messages end (vLLM's fields and defaults) and what their content may be,
what reaches SamplingParams."""

from __future__ import annotations

import json

import pydantic
import pytest

from actors.regex_dfa import compile_regex
from actors.sampling_defaults import SamplingDefaults
from actors.sampling_params import InvalidRequestError
from cluster.api_models import ChatBody, ChatMessage, CompletionBody, TokenizeBody, choice_params
from cluster.sglang_body import GenerateBody
from cluster.tool_calls import TOOL_CALL_FORMATS, StreamedCalls, Tool, chat_answer

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_completion_gets_special_tokens_and_a_chat_does_not_unless_asked():
    assert CompletionBody(prompt="x").add_special_tokens is True
    assert CompletionBody(prompt="x", add_special_tokens=False).add_special_tokens is False
    assert ChatBody(messages=MESSAGES).add_special_tokens is False
    assert ChatBody(messages=MESSAGES, add_special_tokens=True).add_special_tokens is True
    # /tokenize stands for either body: its default is that body's
    assert TokenizeBody(prompt="x").add_special_tokens is True
    assert TokenizeBody(messages=MESSAGES).add_special_tokens is False
    assert TokenizeBody(prompt="x", add_special_tokens=False).add_special_tokens is False


def test_a_chat_opens_an_assistant_turn_or_continues_the_last_message():
    body = ChatBody(messages=MESSAGES)
    assert (body.add_generation_prompt, body.continue_final_message) == (True, False)
    ChatBody(messages=MESSAGES, add_generation_prompt=False, continue_final_message=True)
    for body in (ChatBody, TokenizeBody):
        with pytest.raises(pydantic.ValidationError, match="continue_final_message needs add_generation_prompt"):
            body(messages=MESSAGES, continue_final_message=True)


def test_a_message_is_its_text_parts_and_other_parts_are_refused():
    parts = [{"type": "text", "text": "Look at"}, {"type": "text", "text": "this."}]
    assert ChatMessage(role="user", content=parts).text() == "Look at\nthis."  # vLLM's join, for a text model
    for part, message in [({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, "'image_url' is not"),
                          ({"type": "input_audio", "input_audio": {}}, "'input_audio' is not"),
                          ({"text": "no type"}, "None is not"), ({"type": "text"}, "text as a string")]:
        with pytest.raises(pydantic.ValidationError, match=message):
            ChatMessage(role="user", content=parts + [part])


def test_vllms_output_fields_reach_the_sampling_params():
    defaults = SamplingDefaults()
    for body in (CompletionBody(prompt="x", bad_words=["the", "fox"]),
                 ChatBody(messages=MESSAGES, bad_words=["the", "fox"])):
        assert body.sampling(16, defaults).bad_words == ("the", "fox")
    assert CompletionBody(prompt="x").sampling(16, defaults).bad_words == ()
    assert CompletionBody(prompt="x", truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    with pytest.raises(pydantic.ValidationError, match="truncate_prompt_tokens"):
        CompletionBody(prompt="x", truncate_prompt_tokens=-2)


def test_prompt_logprobs_are_whole_responses_only():
    defaults = SamplingDefaults()
    assert ChatBody(messages=MESSAGES, prompt_logprobs=2).sampling(16, defaults).prompt_logprobs == 2
    assert CompletionBody(prompt="x", prompt_logprobs=5, echo=True, logprobs=1).sampling(16, defaults) \
        .prompt_logprobs == 5  # the more of the two; echo's lists keep their own 1
    with pytest.raises(pydantic.ValidationError, match="prompt_logprobs is not available with stream"):
        CompletionBody(prompt="x", prompt_logprobs=1, stream=True)


def test_the_seeds_flat_body_takes_every_sampling_field():
    """Beside the prompt, as the seeds write it, with SGLang's sampling_params
    (`ignore_eos` there was ignored: a body's unknown keys are)."""
    body = GenerateBody(text="x", max_new_tokens=3, ignore_eos=True, stop_token_ids=[5], min_new_tokens=2,
                        logit_bias={"7": 1.5}, no_stop_trim=True, skip_special_tokens=False,
                        sampling_params={"max_new_tokens": 3, "stop": ["y"], "seed": 4})
    (params,) = body.sampling(16, SamplingDefaults())
    assert (params.max_new_tokens, params.ignore_eos) == (3, True)
    assert (params.stop_token_ids, params.min_new_tokens) == ((5,), 2)
    assert params.logit_bias == ((7, 1.5),) and params.include_stop_str_in_output and not params.skip_special_tokens
    assert (params.seed, params.stop) == (4, ("y",))  # from sampling_params: not set flat
    flat_n = GenerateBody(text=["x", "y"], n=2, sampling_params=[{"n": 2}, {"seed": 3}])  # n for every prompt
    assert flat_n.num_choices == 2 and flat_n.answers_a_list


@pytest.mark.parametrize("flat, in_params", [({"max_new_tokens": 5}, {"max_new_tokens": 3}),
                                             ({"stop": "x"}, {"stop": ["x", "y"]}),
                                             ({"n": 2}, {"n": 3})])
def test_a_sampling_field_given_flat_and_in_sampling_params_with_two_values_is_refused(flat, in_params):
    """Either could be the one meant: the 5 tokens beside the prompt were served
    over sampling_params' 3, without a word. Given twice alike, it is served."""
    (name,) = flat
    with pytest.raises(pydantic.ValidationError, match=f"{name} is given twice, .* beside the prompt and .* in "
                                                       "sampling_params: give it once"):
        GenerateBody.model_validate({"text": ["a", "b"], "sampling_params": [{}, in_params], **flat})
    GenerateBody.model_validate({"text": "a", "sampling_params": flat, **flat})
    GenerateBody.model_validate({"text": "a", "sampling_params": {"stop": ["x"]}, "stop": "x"})  # (one stop string)



def test_tools_ask_for_a_pattern_only_when_a_call_is_required_or_named():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}}
    assert ChatBody(messages=MESSAGES, tools=[]).output_regex() is None  # no tools: a text answer
    assert ChatBody(messages=MESSAGES, tools=[tool], tool_choice="none").output_regex() is None
    assert ChatBody(messages=MESSAGES, tools=[tool], tool_choice="none").template_tools() is None
    named = ChatBody(messages=MESSAGES, tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.asks_structure and compile_regex(named.output_regex()).fullmatch('{"x": 12}')
    one = ChatBody(messages=MESSAGES, tools=[tool], tool_choice="required", parallel_tool_calls=False)
    dfa = compile_regex(one.output_regex())
    assert dfa.fullmatch('[{"name": "f", "parameters": {"x": 1}}]')
    assert not dfa.fullmatch('[{"name": "f", "parameters": {"x": 1}}, {"name": "f", "parameters": {"x": 2}}]')
    assert ChatBody(messages=MESSAGES, tool_choice="auto").output_regex() is None  # auto without tools (was a 500)
    auto = ChatBody(messages=MESSAGES, tools=[tool])  # OpenAI's default with tools: "auto", parsed after
    assert auto.output_regex() is None and auto.template_tools() == [tool]
    for function in (None, "f", ["f"], {}):  # (not an object: an AttributeError, a 500)
        with pytest.raises(InvalidRequestError, match="tool_choice must be"):
            ChatBody(messages=MESSAGES, tools=[tool], tool_choice={"type": "function", "function": function}
                     ).output_regex()


def test_required_calls_hold_tools_whose_parameters_have_definitions():
    """A pydantic model's nested models are `$defs`: nested in the array of calls
    `"required"` holds an answer to, a tool's `$ref` pointed at that array's root,
    where they were not, and the request was a 400 (named or auto: served). Two
    tools' definitions of one name stay each their own."""
    address = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    ship = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
        "$defs": {"Address": address}}}}
    wait = {"type": "function", "function": {"name": "wait", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/definitions/Address"}}, "required": ["at"],
        "definitions": {"Address": {"type": "integer"}}}}}
    dfa = compile_regex(ChatBody(messages=MESSAGES, tools=[ship, wait], tool_choice="required").output_regex())
    assert dfa.fullmatch('[{"name": "ship", "parameters": {"to": {"city": "Oslo"}}}, '
                         '{"name": "wait", "parameters": {"at": 3}}]')
    assert not dfa.fullmatch('[{"name": "wait", "parameters": {"at": {"city": "Oslo"}}}]')
    assert not dfa.fullmatch('[{"name": "ship", "parameters": {"to": 3}}]')


def test_twenty_strict_tools_of_their_own_schemas_compile():
    """An agent's tools, each strict with its own arguments (the OpenAI Agents SDK
    makes function tools strict; the Responses API's are by default): the
    subset construction builds 5179 states, merged 2121. The bound on states
    is the merged automaton's (each state a request reaches costs a walk of
    the vocabulary); until the twenty-seventh session it was the built one's,
    and these tools were refused."""
    def tool(i: int) -> dict:
        kinds = ["string", "integer", "boolean", "number", "string"]
        properties = {f"p{i}_{j}": {"type": kinds[(i + j) % 5]} for j in range(5)}
        properties |= {"mode": {"type": "string", "enum": ["a", "b", "c"]}, "items": {"type": "array", "items": {
            "type": "string"}}}
        return {"type": "function", "function": {"name": f"tool_{i}", "strict": True, "parameters": {
            "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}
    dfa = compile_regex(ChatBody(messages=MESSAGES, tools=[tool(i) for i in range(20)]).output_regex())
    call = {"name": "tool_13", "arguments": {"p13_0": 1.5, "p13_1": "x", "p13_2": "y", "p13_3": 2, "p13_4": True,
                                             "mode": "b", "items": ["z"]}}
    assert len(dfa.accepting) < 2500 and dfa.fullmatch(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    assert not dfa.fullmatch(f"<tool_call>\n{json.dumps({**call, 'name': 'tool_12'})}\n</tool_call>")


CITY = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 5}},
        "additionalProperties": False}


@pytest.mark.parametrize("strict", [False, True])
def test_a_response_format_beside_tools_holds_the_text_and_leaves_the_calls(strict):
    """tool_choice "auto" with a response_format (the OpenAI Agents SDK's agent
    with an output type): calls alone, in the served model's layout, arguments
    of their schema when a tool is strict (else any JSON object), or text of the
    format; the answer read back as calls or as that text. Before, the format
    held the whole answer (no call could be made) or, with a strict tool, the
    request was refused. Where a call is asked for, its pattern alone holds the
    answer (the format is for a later turn's text)."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": strict}}
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}}}
    body = ChatBody(messages=MESSAGES, tools=[weather], response_format=answer)
    content = '{"summary": "sunny"}'
    calls = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
             "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
             "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'}
    tools = [Tool.model_validate(weather)]
    for name, call_text in calls.items():
        fmt = TOOL_CALL_FORMATS[name]
        dfa = compile_regex(body.output_regex(fmt))
        assert dfa.fullmatch(content) and dfa.fullmatch(call_text), name
        assert not dfa.fullmatch("It is sunny.") and not dfa.fullmatch(f"Sure. {call_text}"), name
        assert dfa.fullmatch(call_text.replace('"Oslo"', '"Toulouse", "days": 3')) is not strict, name
        assert chat_answer(content, "stop", tools, None, fmt=fmt) == (content, None, "stop"), name
        called = chat_answer(call_text, "stop", tools, None, fmt=fmt)
        assert called.content is None and called.finish_reason == "tool_calls", name
        assert [c["function"]["name"] for c in called.calls] == ["get_weather"], name
    assert not compile_regex(ChatBody(messages=MESSAGES, tools=[weather], response_format=answer,
                                      parallel_tool_calls=False).output_regex()).fullmatch(calls["hermes"] * 2)
    forced = ChatBody(messages=MESSAGES, tools=[weather], tool_choice="required", response_format=answer)
    assert forced.output_regex() == ChatBody(messages=MESSAGES, tools=[weather], tool_choice="required").output_regex()
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert compile_regex(ChatBody(messages=MESSAGES, tools=[weather], tool_choice=named, response_format=answer)
                         .output_regex()).fullmatch('{"city": "Oslo"}')
    with pytest.raises(InvalidRequestError, match="give one way"):  # a guided field holds calls and all
        ChatBody(messages=MESSAGES, tools=[weather], tool_choice="required", guided_regex="x").output_regex()
    if not strict:  # tools whose arguments are free share one branch: twenty cost what one does (in twenty
        # branches of their own the automaton would grow with their number)
        many = [{"type": "function", "function": {"name": f"tool_{i}"}} for i in range(20)]
        sizes = [len(compile_regex(ChatBody(messages=MESSAGES, tools=tools, response_format=answer).output_regex())
                     .accepting) for tools in (many[:1], many)]
        assert sizes[1] < sizes[0] + 40, sizes


def test_an_answer_of_calls_ends_for_tool_calls_but_a_named_functions_for_stop():
    """OpenAI's reasons, and vLLM's: "tool_calls" for calls under tool_choice
    "required" (it was "stop", and agent loops that wait for "tool_calls" missed
    the call) as under "auto"; "stop" for a named function's call; a cut answer
    keeps "length"."""
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": CITY}})]
    calls = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert chat_answer(calls, "stop", tools, "required").finish_reason == "tool_calls"
    assert chat_answer(calls[:-5], "length", tools, "required").finish_reason == "length"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat_answer('{"city": "Oslo"}', "stop", tools, named).finish_reason == "stop"
    streamed = StreamedCalls.of(tools, "required")
    assert streamed.delta(calls[:20], False) is None and streamed.delta(calls[20:], True)["tool_calls"]
    assert streamed.finish_reason("stop") == "tool_calls"
    cut = StreamedCalls.of(tools, "required")
    assert cut.delta(calls[:-5], True) == {"content": calls[:-5]} and cut.finish_reason("length") == "length"
    streamed_named = StreamedCalls.of(tools, named)
    assert streamed_named.delta('{"city": "Oslo"}', True)["tool_calls"]
    assert streamed_named.finish_reason("stop") == "stop"


def test_top_k_minus_one_is_off_as_in_vllm():
    """vLLM's documented "off" was refused (ge=0) by the OpenAI bodies; /generate took it."""
    defaults = SamplingDefaults(top_k=20)  # (a checkpoint's generation_config that sets it: Qwen's)
    for body in (ChatBody(messages=MESSAGES, top_k=-1), CompletionBody(prompt="x", top_k=-1)):
        assert body.sampling(4, defaults).top_k == 0
    assert ChatBody(messages=MESSAGES).sampling(4, defaults).top_k == 20
    with pytest.raises(ValueError, match="top_k"):
        ChatBody(messages=MESSAGES, top_k=-2)


def test_a_seed_is_any_64_bit_integer_as_in_vllm():
    """-1 (which clients send) and other negative seeds were refused; each is
    folded into the draws' [0, 2**63), reproducibly; past 64 bits is refused."""
    seeds = [CompletionBody(prompt="x", seed=seed).sampling(4, SamplingDefaults()).seed
             for seed in (-1, -(2**63), 2**63 - 1, 7)]
    assert seeds == [2**63 - 1, 0, 2**63 - 1, 7]
    params = CompletionBody(prompt="x", seed=-1).sampling(4, SamplingDefaults())
    assert [p.seed for p in choice_params(params, 2)] == [2**63 - 1, 0]  # (n's choices, seed + i)
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(InvalidRequestError, match="seed must be a 64-bit integer"):
            CompletionBody(prompt="x", seed=seed).sampling(4, SamplingDefaults())


def test_a_copy_with_another_seed_or_length_is_the_params_checked_whole():
    """`with_seed` and `with_max_new_tokens` check only what they change (a copy
    checked whole took 0.06 s for a 150k-entry logit_bias, a batch's 64 of them
    3.7 s of the event loop); what they give is what a whole check gives."""
    import dataclasses

    from actors.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=8, min_new_tokens=2, logit_bias={5: 1.0, 3: -2.0}, temperature=0.5,
                            seed=4)
    assert params.with_seed(-1) == dataclasses.replace(params, seed=-1)
    assert params.with_seed(None) == dataclasses.replace(params, seed=None)
    assert params.with_max_new_tokens(3) == dataclasses.replace(params, max_new_tokens=3)
    with pytest.raises(InvalidRequestError, match="seed must be a 64-bit integer"):
        params.with_seed(2**63)
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be an integer >= max"):
        params.with_max_new_tokens(1)


def test_a_batch_sharing_its_sampling_params_makes_them_once():
    body = GenerateBody.model_validate({"text": ["a"] * 8, "sampling_params": {"logit_bias": {"5": 1.0}}})
    made = body.sampling(16, SamplingDefaults())
    assert len(made) == 8 and all(params is made[0] for params in made)
    apart = GenerateBody.model_validate({"text": ["a", "b"], "sampling_params": [{"seed": 1}, {"seed": 2}]})
    assert [params.seed for params in apart.sampling(16, SamplingDefaults())] == [1, 2]


@pytest.mark.parametrize("key", ["1_0", " 5", "+7", "5.0", "x", ""])
def test_a_logit_bias_key_is_a_token_ids_digits(key):
    """Read as Python reads an int, "1_0" was token 10, " 5" and "+7" ids too."""
    with pytest.raises(ValueError, match="logit_bias key must be a token id"):
        CompletionBody.model_validate({"prompt": "x", "logit_bias": {key: 1.0}})
    with pytest.raises(ValueError, match="logit_bias key must be a token id"):
        GenerateBody.model_validate({"text": "x", "sampling_params": {"logit_bias": {key: 1.0}}})
    assert CompletionBody.model_validate({"prompt": "x", "logit_bias": {"12": 1.0}}).logit_bias == {12: 1.0}


def test_generates_flat_top_k_is_held_to_the_range_of_sampling_params():
    """Sent flat, -5 was served as off; inside sampling_params, a 400."""
    with pytest.raises(ValueError, match="top_k"):
        GenerateBody.model_validate({"text": "x", "top_k": -5})


# Found by a review: each was served (as a default, a coerced value, or with the field ignored)
def test_null_in_a_field_that_takes_none_is_its_default():
    """OpenAI's SDK sends null for an argument given as None: `"n": null` was a 400."""
    chat = ChatBody.model_validate({"messages": MESSAGES, "n": None, "stream": None, "logprobs": None,
                                    "frequency_penalty": None, "presence_penalty": None})
    assert (chat.n, chat.stream, chat.logprobs, chat.frequency_penalty) == (1, False, False, 0.0)
    assert CompletionBody.model_validate({"prompt": "x", "echo": None}).echo is False
    assert ChatMessage.model_validate({"role": "assistant", "content": None}).content is None  # (it takes null)


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", True, "max_tokens must be a number, not true"),
    ("n", True, "n must be a number"), ("seed", False, "seed must be a number"),
    ("temperature", "0.5", "temperature must be a number, not a string"),
    ("stream", "yes", "stream must be true or false, not a string"),
    ("logprobs", 1, "logprobs must be true or false, not a number"),
    ("logit_bias", {"5": True}, "valid number"), ("logit_bias", {"5": "1"}, "valid number"),
    ("logit_bias", {"5": 100, "05": -100}, "logit_bias names token 5 twice"),
    ("stream_options", {"include_usage": "false"}, "valid boolean"),
    ("stream_options", {"include_usage": True, "continuous_usage_stats": True}, "continuous_usage_stats is not"),
    ("stream_options", {"include_usag": True}, "Extra inputs"),
])
def test_a_field_of_the_wrong_json_type_is_refused_not_coerced(field, value, message):
    """pydantic's lax mode served `"max_tokens": true` as 1, `"temperature": "0.5"`
    as 0.5, `"stream": "yes"` as a stream, and two keys of one token as the later."""
    with pytest.raises(pydantic.ValidationError, match=message):
        ChatBody.model_validate({"messages": MESSAGES, "stream": True, field: value})


@pytest.mark.parametrize("body", [ChatBody, CompletionBody])
def test_a_whitespace_pattern_for_guided_json_is_refused_not_dropped(body):
    """vLLM's `guided_whitespace_pattern` changes what it writes; taken here, it was dropped."""
    fields = {"messages": MESSAGES} if body is ChatBody else {"prompt": "x"}
    with pytest.raises(pydantic.ValidationError, match="guided_whitespace_pattern is not supported"):
        body.model_validate({**fields, "guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]*"})


def test_an_assistants_refusal_part_sent_back_is_text():
    """Found by a review: OpenAI's refused turn sent back was a 400 ("the model
    reads text only"); vLLM reads its refusal as text."""
    body = ChatBody.model_validate({"messages": [
        *MESSAGES, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
        {"role": "user", "content": "why?"}]})
    assert body.messages[1].text() == "I can't help with that."
    with pytest.raises(pydantic.ValidationError, match="a refusal content part is an assistant's"):
        ChatBody.model_validate({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]})
    with pytest.raises(pydantic.ValidationError, match="needs its refusal as a string"):
        ChatBody.model_validate({"messages": [{"role": "assistant", "content": [{"type": "refusal", "text": "x"}]}]})


@pytest.mark.parametrize("body", [{"seed": 1, "sampling_params": {"sampling_seed": 2}},
                                  {"sampling_params": {"seed": 1, "sampling_seed": 2}}])
def test_generate_refuses_two_seeds(body):
    """Found by a review: `seed` was served, `sampling_seed` dropped without a word."""
    with pytest.raises(pydantic.ValidationError, match="seed and sampling_seed name one seed"):
        GenerateBody.model_validate({"text": "a", **body})
    same = GenerateBody.model_validate({"text": "a", "sampling_params": {"seed": 3, "sampling_seed": 3}})
    assert same.sampling(16, SamplingDefaults())[0].seed == 3


def test_generate_takes_max_new_tokens_0_as_the_prompt_alone():
    body = GenerateBody.model_validate({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 0}, {}]})
    assert body.prompts_only() == [True, False]
    assert [p.max_new_tokens for p in body.sampling(16, SamplingDefaults())] == [1, 128]


def test_generate_takes_a_null_max_new_tokens_as_up_to_the_context_within_the_limits():
    """SGLang serves `max_new_tokens: null` up to the context; it was SGLang's
    default of 128, as an omitted one is. Held, as an omitted one is, to the room
    the prompt leaves."""
    from cluster.config import LimitSettings
    from cluster.prompt_limits import fitted_output

    body = GenerateBody.model_validate({"text": ["a", "b", "c"], "sampling_params": [
        {"max_new_tokens": None}, {}, {"max_new_tokens": 300}]})
    unbounded, omitted, asked = body.sampling(500, SamplingDefaults())
    assert (unbounded.max_new_tokens, unbounded.max_new_tokens_is_default) == (500, True)
    assert (omitted.max_new_tokens, omitted.max_new_tokens_is_default) == (128, True)
    assert (asked.max_new_tokens, asked.max_new_tokens_is_default) == (300, False)
    limits = LimitSettings(max_new_tokens=500)
    assert fitted_output(limits, 2048, 1700, unbounded).max_new_tokens == 348  # the context's room
    assert fitted_output(limits, 2048, 10, unbounded).max_new_tokens == 500  # the limit
    flat = GenerateBody.model_validate({"text": "a", "max_new_tokens": None})  # (beside the prompt: not given)
    assert flat.sampling(500, SamplingDefaults())[0].max_new_tokens == 128


def test_completions_refuse_token_ids_for_token_texts_as_chat_does():
    with pytest.raises(pydantic.ValidationError, match="return_tokens_as_token_ids is not supported"):
        CompletionBody.model_validate({"prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": True})
    assert ChatBody.model_validate({"messages": MESSAGES, "stream": True,
                                    "stream_options": {"include_usage": True}}).include_usage


def test_chats_reasoning_effort_is_the_templates_variable():
    """It was taken and dropped (the Responses API's `reasoning.effort` reached the template)."""
    body = ChatBody.model_validate({"messages": MESSAGES, "reasoning_effort": "low"})
    assert body.chat_template_kwargs == {"reasoning_effort": "low"}
    both = ChatBody.model_validate({"messages": MESSAGES, "reasoning_effort": "low",
                                    "chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": False}})
    assert both.chat_template_kwargs == {"reasoning_effort": "high", "enable_thinking": False}  # (the explicit one)


@pytest.mark.parametrize("body, message", [
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens\n.*greater than or equal to 1"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 100},
     r"min_tokens \(100\) must be <= max_tokens \(0\)"),
])
def test_a_bad_output_length_is_named_as_the_client_sent_it(body, message):
    """The errors said the engine's `max_new_tokens`, or the 1 an echo's 0 is run as."""
    with pytest.raises(pydantic.ValidationError, match=message):
        (ChatBody if "messages" in body else CompletionBody).model_validate(body)
    assert ChatBody.model_validate({"messages": MESSAGES, "max_tokens": 0, "max_completion_tokens": 5})  # (this one)
    chat = ChatBody.model_validate({"messages": MESSAGES, "max_completion_tokens": 5, "min_tokens": 10})
    with pytest.raises(InvalidRequestError, match=r"min_tokens \(10\) must be <= max_completion_tokens \(5\)"):
        chat.sampling(16, SamplingDefaults())
