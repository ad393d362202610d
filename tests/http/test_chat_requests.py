"""/v1/chat/completions' own answers to issue 47's items, on a served imported model with a chat template (gemma-2-it's,
tests/hf/chat_templates.py; a Hugging Face tokenizer, which raised TypeError on a lone surrogate):

- a conversation longer than the model's positions is 400 naming `messages` (the field a chat request has), not
  `prompt`, unary or streamed;
- a lone surrogate in a message is 400 naming the message's field, here and on /v1/tokenize;
- with stream_options.include_usage every chunk before the last carries usage: null, as the openai SDK's
  ChatCompletionChunk has it;
- a stop string over MAX_STOP_LENGTH characters is 400 naming `stop`."""

from __future__ import annotations

import json

import openai
import pytest

from service.sampling import MAX_STOP_LENGTH
from tests.serving import start

pytestmark = pytest.mark.xdist_group("chat")  # beside tests/http/test_chat.py's worker (make test)
MESSAGES = [{"role": "user", "content": "dog bites man"}]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(an openai SDK client, the tests/http/conftest.py Http client) of a worker serving a tiny gemma-style chat
    model (its position limit: max_position_embeddings, 256)."""
    from export.hf import import_artifact
    from tests.hf.chat_templates import save_chat_model
    from tests.http.conftest import Http

    root = tmp_path_factory.mktemp("chat-requests")
    save_chat_model("gemma", root / "hf", seed=16)
    import_artifact(root / "hf", root / "artifacts" / "gemma", validation_max_length=16, interventions=False)
    srv = start(root / "artifacts", http_port=0)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    yield client, Http(srv.http_port)
    client.close()
    srv.stop(grace=1)


def test_a_conversation_past_the_models_positions_is_400_naming_messages(chat):
    client, web = chat
    long = [{"role": "user", "content": "dog bites man " * 200}]
    status, ids = web.json("POST", "/v1/tokenize", {"model": "gemma", "messages": long})
    assert status == 200 and ids["count"] > ids["max_model_len"] == 256
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="max_positions") as err:
            client.chat.completions.create(model="gemma", messages=long, max_tokens=2, stream=stream)
        assert err.value.body["param"] == "messages", err.value.body


def test_a_lone_surrogate_in_a_message_is_400_naming_it(chat):
    _, web = chat
    body = json.dumps({"model": "gemma", "messages": MESSAGES + [{"role": "assistant", "content": "@"}]})
    status, data = web.json("POST", "/v1/chat/completions", body.replace("@", "\\udc00").encode())
    assert (status, data["error"]["param"]) == (400, "messages[1].content"), data
    for prompt in ("a\\ud800", "\\ud83d"):
        status, data = web.json("POST", "/v1/tokenize", f'{{"model": "gemma", "prompt": "{prompt}"}}'.encode())
        assert (status, data["error"]["param"]) == (400, "prompt"), data
    status, data = web.json("POST", "/v1/tokenize", b'{"model": "gemma", "prompt": "\\ud83d\\ude00"}')
    assert status == 200 and data["count"] > 0, data  # a pair: one character


def test_streamed_chat_usage_is_null_in_every_chunk_but_the_last(chat):
    client, web = chat
    status, _, data = web.call("POST", "/v1/chat/completions", {
        "model": "gemma", "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
        "stream": True, "logprobs": True, "stream_options": {"include_usage": True}})
    assert status == 200
    lines = [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e]
    assert lines[-1] == "[DONE]"
    *before, last = [json.loads(e) for e in lines[:-1]]
    assert len(before) >= 3 and all("usage" in c and c["usage"] is None for c in before), before
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    for c in before + [last]:  # the openai SDK's type of a chat chunk takes each as it is
        chunk = openai.types.chat.ChatCompletionChunk.model_validate(c)
        assert "usage" in chunk.model_fields_set and chunk.model_dump(exclude_unset=True)["usage"] == c["usage"]
    *before, last = client.chat.completions.create(model="gemma", messages=MESSAGES, max_tokens=3, stream=True,
                                                   stream_options={"include_usage": True})
    assert all(c.usage is None and "usage" in c.model_fields_set for c in before) and last.usage is not None
    plain = client.chat.completions.create(model="gemma", messages=MESSAGES, max_tokens=3, stream=True)
    assert all("usage" not in c.model_fields_set for c in plain)  # not asked: no key, as OpenAI's


def test_a_stop_string_over_the_limit_is_400_naming_stop(chat):
    client, _ = chat
    args = dict(model="gemma", messages=MESSAGES, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**args, stop=["\x01" * MAX_STOP_LENGTH])  # never written: runs to length
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match=rf"at most {MAX_STOP_LENGTH} characters") as err:
        client.chat.completions.create(**args, stop="\x01" * (MAX_STOP_LENGTH + 1))
    assert err.value.body["param"] == "stop"
