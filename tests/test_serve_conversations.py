"""OpenAI's Conversations API (`/v1/conversations`) over real HTTP, through the
OpenAI client, and responses on a conversation (`conversation` in
`POST /v1/responses`): a response on one answers as the whole conversation sent
in `input` would, and adds its input and output to it, whichever scheduler
replica serves it; one response at a time (`conversation_locked`), a cancelled,
failed or abandoned one adding nothing and freeing the conversation; the
conversation's items listed, found and deleted; bad input a 4xx. (The view:
cluster/stored_conversations.py; the store: cluster/response_store.py.)"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray

from tests.conftest import served_app, wait_idle

ARGS = {
    "model": {"preset": "tiny", "arch": "qwen2"},
    "mode": "colocated",
    "colocated": {"replicas": 1, "num_cpus": 1},
    "engine": {"block_size": 16, "num_kv_blocks": 256},
    "limits": {"max_prompt_tokens": 600, "max_new_tokens": 2000},
    "pool_name": "test-pool-conversations",
    "scheduler_replicas": 2,  # (any replica serves a turn on any conversation)
}
MODEL = "tandem-tiny-qwen2"


@pytest.fixture(scope="module")
def base_url(serve_port):
    yield from served_app("conversations", ARGS, serve_port)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _items(client, conversation_id: str) -> list[dict]:
    return [item.model_dump(exclude_none=True) for item in
            client.conversations.items.list(conversation_id, order="asc", limit=100)]


def _texts(items: list[dict]) -> list[str]:
    return [item["content"][0]["text"] for item in items if item["type"] == "message"]


def test_responses_on_a_conversation_answer_as_its_whole_items_would_and_add_to_it(client):
    """Two turns on a conversation created with a first message: each the same
    greedy answer and input tokens as its items sent whole in `input`; the
    conversation then holds the first message, each turn's input and output."""
    conversation = client.conversations.create(items=[{"role": "user", "content": "Name a colour."}],
                                               metadata={"topic": "names"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "names"}
    sent, texts = [{"role": "user", "content": "Name a colour."}], ["Name a colour."]
    for question in ("And a fruit?", "And a tree?"):
        answer = client.responses.create(model=MODEL, conversation=conversation.id, input=question, temperature=0,
                                         max_output_tokens=6)
        sent.append({"role": "user", "content": question})
        twin = client.responses.create(model=MODEL, input=sent, temperature=0, max_output_tokens=6, store=False)
        assert answer.conversation.id == conversation.id and answer.previous_response_id is None
        assert answer.output_text == twin.output_text and answer.usage.input_tokens == twin.usage.input_tokens
        sent += [item.model_dump() for item in answer.output]
        texts += [question, answer.output_text]
    assert _texts(_items(client, conversation.id)) == texts
    assert client.responses.retrieve(answer.id).conversation.id == conversation.id


def test_a_streamed_response_adds_its_items_and_one_its_client_leaves_adds_none(client, base_url):
    conversation = client.conversations.create()
    *_, last = client.responses.create(model=MODEL, conversation={"id": conversation.id}, input="Count to three.",
                                       temperature=0, max_output_tokens=8, stream=True)
    final = last.response
    assert [item["type"] for item in _items(client, conversation.id)] == ["message", "message"]
    assert _items(client, conversation.id)[1]["id"] == final.output[-1].id
    with httpx.stream("POST", f"{base_url}/v1/responses", json={
            "conversation": conversation.id, "input": "Tell me a story.", "max_output_tokens": 500, "temperature": 0,
            "stream": True}) as left:  # (greedy: 500 tokens, no EOS; sampled, it once ended in 4)
        for index, _ in enumerate(left.iter_lines()):
            if index >= 12:
                break
    answer = _once_free(client, conversation.id, input="Hi", max_output_tokens=2)
    assert _texts(_items(client, conversation.id))[2:] == ["Hi", answer.output_text], "the left one added nothing"


def _once_free(client, conversation_id: str, within_s: float = 5.0, **request):
    """A response on the conversation, once the turn before is given back (in a
    task of its own, as a refused or left response ends)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return client.responses.create(model=MODEL, conversation=conversation_id, **request)
        except openai.BadRequestError as exc:
            assert exc.code == "conversation_locked" and time.monotonic() < deadline, exc
            time.sleep(0.1)


def test_a_response_refused_after_its_turn_began_frees_the_conversation(client):
    """... and one not stored (`store: false`) still adds its turn."""
    conversation = client.conversations.create()
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.responses.create(model="gpt-4o", conversation=conversation.id, input="Hi")
    with pytest.raises(openai.BadRequestError, match="input.0.role"):
        client.responses.create(model=MODEL, conversation=conversation.id, input=[{"role": "robot", "content": "x"}])
    answer = _once_free(client, conversation.id, input="Hi", max_output_tokens=2, store=False)
    assert _texts(_items(client, conversation.id)) == ["Hi", answer.output_text], "added, though not stored"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)


def test_a_conversation_takes_one_response_at_a_time(client):
    """A background response holds it (any replica refuses a second with
    `conversation_locked`) until cancelled, which frees it and adds nothing; a
    background response that completes adds its items as one in the foreground."""
    conversation = client.conversations.create(items=[{"role": "user", "content": "Tell me a story."}])
    queued = client.responses.create(model=MODEL, conversation=conversation.id, input="keep going", temperature=0,
                                     max_output_tokens=2000, background=True)  # (greedy: 2000 tokens, no EOS)
    assert queued.conversation.id == conversation.id
    for _ in range(2):  # (two scheduler replicas)
        with pytest.raises(openai.BadRequestError) as locked:
            client.responses.create(model=MODEL, conversation=conversation.id, input="more")
        assert locked.value.code == "conversation_locked" and locked.value.param == "conversation"
    assert client.responses.cancel(queued.id).status == "cancelled"
    pool = ray.get_actor(ARGS["pool_name"], namespace="tandem")
    [worker] = [member.handle for member in ray.get(pool.list_members.remote())]
    wait_idle(worker, within_s=4.0)
    assert _texts(_items(client, conversation.id)) == ["Tell me a story."]
    queued = client.responses.create(model=MODEL, conversation=conversation.id, input="Once", temperature=0,
                                     max_output_tokens=5, background=True)
    deadline = time.monotonic() + 60
    while (answer := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, answer.status
        time.sleep(0.2)
    assert answer.status == "incomplete"
    assert _texts(_items(client, conversation.id)) == ["Tell me a story.", "Once", answer.output_text]


def test_responses_racing_on_one_conversation_add_whole_turns_one_after_another(client):
    """Eight at once, across both replicas: each served or refused as locked,
    and the conversation is the served ones' turns, each whole (its input, then
    its output), one after another."""
    conversation = client.conversations.create()

    def one(k: int):
        try:
            return k, client.responses.create(model=MODEL, conversation=conversation.id, input=f"turn {k}",
                                              max_output_tokens=3, temperature=0)
        except openai.BadRequestError as exc:
            assert exc.code == "conversation_locked", exc
            return k, None

    with ThreadPoolExecutor(8) as pool:
        served = {f"turn {k}": answer.output[-1].id for k, answer in pool.map(one, range(8)) if answer is not None}
    items = _items(client, conversation.id)
    assert served and len(items) == 2 * len(served)
    turns = {items[k]["content"][0]["text"]: items[k + 1]["id"] for k in range(0, len(items), 2)}
    assert turns == served


def test_a_conversations_items_are_paged_found_and_deleted_and_it_is_updated_and_deleted(client, base_url):
    conversation = client.conversations.create(items=[{"role": "user", "content": f"line {k}"} for k in range(5)])
    added = client.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "line 5"}]}])
    assert [item.type for item in added.data] == ["message"] and added.data[0].id.startswith("msg_")
    page = client.conversations.items.list(conversation.id, limit=2)
    assert [item.content[0].text for item in page.data] == ["line 5", "line 4"] and page.has_more
    rest = client.conversations.items.list(conversation.id, limit=10, after=page.last_id)
    assert [item.content[0].text for item in rest.data] == [f"line {k}" for k in (3, 2, 1, 0)] and not rest.has_more
    back = httpx.get(f"{base_url}/v1/conversations/{conversation.id}/items", params={"before": rest.first_id})
    assert back.status_code == 400 and back.json()["error"]["param"] == "before", back.text  # (not the first page)
    first_id = rest.data[-1].id
    assert client.conversations.items.retrieve(first_id, conversation_id=conversation.id).content[0].text == "line 0"
    assert client.conversations.items.delete(first_id, conversation_id=conversation.id).id == conversation.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(first_id, conversation_id=conversation.id)
    assert len(_items(client, conversation.id)) == 5
    assert client.conversations.update(conversation.id, metadata={"k": "v"}).metadata == {"k": "v"}
    assert client.conversations.retrieve(conversation.id).metadata == {"k": "v"}
    assert client.conversations.delete(conversation.id).deleted
    for call in (lambda: client.conversations.retrieve(conversation.id),
                 lambda: client.conversations.delete(conversation.id),
                 lambda: client.conversations.items.list(conversation.id),
                 lambda: client.responses.create(model=MODEL, conversation=conversation.id, input="x")):
        with pytest.raises(openai.NotFoundError, match="not found"):
            call()
    response = httpx.get(f"{base_url}/v1/responses/{conversation.id}")
    assert response.status_code == 404, "a conversation's id is not a response's"


@pytest.mark.parametrize("path, body, message", [
    ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items"),
    ("/v1/conversations", {"metadata": {f"k{k}": "v" for k in range(17)}}, "16"),
    ("/v1/conversations", {"metadata": {"k": "v" * 513}}, "512"),
    ("/v1/conversations", {"items": [{"type": "input_image", "image_url": "x"}]}, "items.0"),
    ("/v1/conversations", {"items": [{"role": "robot", "content": "x"}]}, "items.0.role"),
    ("/v1/conversations/conv_none/items", {"items": []}, "items"),
    ("/v1/conversations/conv_none/items", {"items": [{"role": "user", "content": "x"}]}, "not found"),
    ("/v1/conversations/conv_none", {"metadata": {}}, "not found"),
    ("/v1/conversations", {"items": [{"id": "msg_1", "role": "user", "content": "x"}] * 2}, "Duplicate item"),
    ("/v1/responses", {"input": [{"id": "msg_1", "role": "user", "content": "x"}] * 2}, "Duplicate item"),
    ("/v1/responses", {"input": "x", "conversation": "conv_a", "previous_response_id": "resp_a"}, "give one"),
    ("/v1/responses", {"input": "x", "conversation": {"name": "c"}}, "conversation"),
    ("/v1/responses", {"input": "x", "conversation": "conv_none"}, "not found"),
])
def test_bad_requests_are_4xx_with_a_message(base_url, path, body, message):
    response = httpx.post(f"{base_url}{path}", json=body)
    assert 400 <= response.status_code < 500 and message in response.json()["error"]["message"], response.text


def test_an_item_whose_id_the_conversation_has_is_refused_and_nothing_is_added(client, base_url):
    """OpenAI's 400 (a client sending back an output item, id and all, as new
    input): GET and DELETE by id would find only the first of two."""
    conversation = client.conversations.create(items=[{"id": "msg_mine", "role": "user", "content": "hello"}])
    again = {"id": "msg_mine", "type": "message", "role": "user", "content": "hello again"}
    added = httpx.post(f"{base_url}/v1/conversations/{conversation.id}/items", json={"items": [again]})
    assert added.status_code == 400 and "Duplicate item found with id msg_mine" in added.json()["error"]["message"]
    answer = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, "conversation": conversation.id,
                                                          "input": [again], "max_output_tokens": 2})
    assert answer.status_code == 400 and "msg_mine" in answer.json()["error"]["message"], answer.text
    assert _texts(_items(client, conversation.id)) == ["hello"]
    response = client.responses.create(model=MODEL, conversation=conversation.id, input="go on", max_output_tokens=2)
    output_item = response.output[0].model_dump(exclude_none=True)  # (the conversation was freed)
    sent_back = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, "previous_response_id": response.id,
                                                             "input": [output_item], "max_output_tokens": 2})
    assert sent_back.status_code == 400 and output_item["id"] in sent_back.json()["error"]["message"]
