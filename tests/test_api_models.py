"""The HTTP bodies' prompt fields on their own: which text gets the tokenizer's
special tokens, and how chat messages end (vLLM's fields and defaults)."""

from __future__ import annotations

import pydantic
import pytest

from cluster.api_models import ChatBody, CompletionBody, TokenizeBody

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
