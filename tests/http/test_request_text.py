"""Request text every front refuses the same way, and OpenAI's stream usage (issue 47, items 4, 9 and 12):

- a JSON string holding a lone UTF-16 surrogate ("\\ud800" without its other half) is 400 naming its field on every
  route that takes JSON (the tokenizers library raised TypeError on it, the byte tokenizer UnicodeEncodeError: 500),
  and a pair (an emoji written as two escapes) is one character;
- a stop string longer than MAX_STOP_LENGTH characters is 400 naming `stop` on the OpenAI routes and posenc JSON's
  Generate, INVALID_ARGUMENT on gRPC's; one of that length is taken;
- with stream_options.include_usage every chunk before the last carries usage: null (OpenAI's; the openai SDK's
  Completion type reads them)."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from protos.posenc.v1 import posenc_pb2 as pb
from service.sampling import MAX_STOP_LENGTH

LONE = "\\ud800"  # as JSON writes it: the escape, not a character
MESSAGES = [{"role": "user", "content": "hi"}]


def raw(body: dict) -> bytes:
    """The body as JSON whose strings may hold an escaped lone surrogate (json.dumps would escape its backslash)."""
    return json.dumps(body).replace("@LONE@", LONE).encode()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "rope", "prompt": "ab@LONE@"}, "prompt"),
    ("/v1/completions", {"model": "rope", "prompt": ["ok", "@LONE@"]}, "prompt[1]"),
    ("/v1/completions", {"model": "rope", "prompt": "ab", "stop": ["x", "@LONE@"]}, "stop[1]"),
    ("/v1/chat/completions", {"model": "rope", "messages": [{"role": "user", "content": "@LONE@"}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "rope", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "@LONE@"}]}]}, "messages[0].content[0].text"),
    ("/v1/tokenize", {"model": "rope", "prompt": "@LONE@"}, "prompt"),
    ("/v1/detokenize", {"model": "rope@LONE@", "tokens": [65]}, "model"),
    ("/v1/completions", {"model": "rope", "prompt": "ab", "user": {"@LONE@": 1}}, "user"),  # a key
])
def test_a_lone_surrogate_is_400_naming_the_field_on_the_openai_routes(web, path, body, param):
    status, data = web.json("POST", path, raw(body))
    assert status == 400, data
    error = data["error"]
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", 400)
    assert f"field {param!r}" in error["message"] and "U+D800" in error["message"], error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/posenc/generate", {"model": "rope", "prompt": {"text": "@LONE@"}}, "prompt.text"),
    ("/v1/posenc/generate", {"model": "rope", "prompt": {"text": "ab"}, "stop": ["@LONE@"]}, "stop[0]"),
    ("/v1/posenc/tokenize", {"model": "rope", "text": "a@LONE@"}, "text"),
    ("/v1/posenc/predict", {"model": "rope", "prompt": {"text": "@LONE@"}}, "prompt.text"),
    ("/v2/models/rope/infer", {"inputs": [{"name": "input_ids@LONE@", "shape": [1, 1], "datatype": "INT64",
                                           "data": [65]}]}, "inputs[0].name"),
    ("/v2/models/rope/infer", {"inputs": [{"name": "input_ids", "shape": [1, 1], "datatype": "BYTES",
                                           "data": ["@LONE@"]}]}, "inputs[0].data[0]"),
])
def test_a_lone_surrogate_is_400_naming_the_field_on_the_posenc_and_kserve_routes(web, path, body, param):
    status, data = web.json("POST", path, raw(body))
    assert status == 400 and f"field {param!r}" in data["error"] and "U+D800" in data["error"], data


def test_raw_surrogate_bytes_are_refused_and_an_escaped_pair_is_one_character(web):
    # json.loads reads bytes with errors="surrogatepass": ED A0 80 (a surrogate's UTF-8 form) would be U+D800 too
    status, data = web.json("POST", "/v1/tokenize", b'{"model": "rope", "prompt": "a\xed\xa0\x80"}')
    assert (status, data["error"]["param"]) == (400, "prompt"), data
    status, data = web.json("POST", "/v1/tokenize", b'{"model": "rope", "prompt": "\\ud83d\\ude00 \\\\ud800"}')
    assert status == 200 and data["count"] == len("\U0001F600 \\ud800".encode()), data  # a byte model: its bytes
    status, data = web.json("POST", "/v1/completions", json.dumps({"model": "rope", "prompt": "\U0001F600",
                                                                   "max_tokens": 2}).encode())  # ensure_ascii
    assert status == 200 and data["usage"]["completion_tokens"] == 2, data


def test_a_good_request_is_answered_after_the_refusals(sdk):
    assert sdk.completions.create(model="rope", prompt="ab", max_tokens=2).usage.completion_tokens == 2


def test_a_stop_string_over_the_limit_is_refused_naming_stop_on_every_front(sdk, web, stub):
    args = dict(model="rope", prompt="abc", max_tokens=4, temperature=0)
    full = sdk.completions.create(**args).choices[0].text
    fits = "\x01" * MAX_STOP_LENGTH  # never generated: the text runs to max_tokens
    c = sdk.completions.create(**args, stop=["zz", fits])
    assert (c.choices[0].text, c.choices[0].finish_reason) == (full, "length")
    over = "\x01" * (MAX_STOP_LENGTH + 1)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=rf"at most {MAX_STOP_LENGTH} characters") as err:
            sdk.completions.create(**args, stop=["zz", over], stream=stream)
        assert err.value.body["param"] == "stop" and "stop[1] has" in err.value.body["message"]
    status, data = web.json("POST", "/v1/chat/completions", {"model": "rope", "messages": MESSAGES, "stop": over})
    assert status == 400  # (rope has no chat template: tests/http/test_chat_requests.py has one that does)
    status, data = web.json("POST", "/v1/posenc/generate", {"model": "rope", "prompt": {"text": "abc"},
                                                            "stop": [over]})
    assert status == 400 and f"at most {MAX_STOP_LENGTH} characters" in data["error"], data
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="abc"), max_new_tokens=4,
                                              stop=[over]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop" in err.value.details()
    kept = list(stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="abc"), max_new_tokens=4,
                                                 stop=[fits]), timeout=30))
    assert kept[-1].finish_reason == "length"


def events(web, body: dict) -> list[dict]:
    status, _, data = web.call("POST", "/v1/completions", body)
    assert status == 200, data
    lines = [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


def test_streamed_usage_is_null_in_every_chunk_but_the_last(web, sdk):
    body = {"model": "rope", "prompt": ["ab", "cd"], "max_tokens": 5, "temperature": 0, "stream": True,
            "logprobs": 1, "stream_options": {"include_usage": True}}
    *before, last = events(web, body)
    assert len(before) >= 4 and all("usage" in c and c["usage"] is None for c in before), before
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 4, "completion_tokens": 10,
                                                       "total_tokens": 14}
    # the openai SDK's Completion chunks: usage is a field each chunk sets, None but in the last
    *before, last = sdk.completions.create(model="rope", prompt="ab", max_tokens=5, stream=True,
                                           stream_options={"include_usage": True})
    assert all("usage" in c.model_fields_set and c.usage is None for c in before)
    assert last.usage is not None and last.usage.completion_tokens == 5
    # without include_usage, as OpenAI's: no usage key at all
    assert all("usage" not in c for c in events(web, body | {"stream_options": {"include_usage": False}}))
    assert all("usage" not in c for c in events(web, {k: v for k, v in body.items() if k != "stream_options"}))
