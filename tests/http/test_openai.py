"""OpenAI-compatible completions, driven by the official openai SDK against a real worker: greedy text equals
posenc.v1 Generate, log-probabilities equal Score, streams end with [DONE], errors are the SDK's exceptions."""

import json

import numpy as np
import openai
import pytest

from protos.posenc.v1 import posenc_pb2 as pb


def generate(stub, model, text, n, **kw):
    return list(stub.Generate(pb.GenerateRequest(model=model, prompt=pb.Prompt(text=text), max_new_tokens=n, **kw),
                              timeout=60))


def test_models_list(sdk, server):
    assert sorted(m.id for m in sdk.models.list().data) == sorted(server.registry.models)
    assert sdk.models.retrieve("rope").owned_by == "posenc"


def test_greedy_completion_equals_generate(sdk, stub):
    c = sdk.completions.create(model="rope", prompt="The cat sat", max_tokens=12, temperature=0)
    want = generate(stub, "rope", "The cat sat", 12)
    assert c.object == "text_completion" and c.model == "rope"
    assert c.choices[0].text == want[-1].text and c.choices[0].finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (11, 12, 23)


def test_a_list_of_prompts_gets_one_choice_each(sdk, stub):
    prompts = ["dog bites man", "man bites dog"]
    c = sdk.completions.create(model="alibi", prompt=prompts, max_tokens=6, temperature=0)
    assert [x.index for x in c.choices] == [0, 1]
    assert [x.text for x in c.choices] == [generate(stub, "alibi", p, 6)[-1].text for p in prompts]


def test_stream_ends_with_done_and_adds_up_to_the_text(sdk, web):
    args = dict(model="rope", prompt="Once upon", max_tokens=10, temperature=0)
    whole = sdk.completions.create(**args).choices[0].text
    chunks = list(sdk.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    status, headers, body = web.call("POST", "/v1/completions", {**args, "stream": True,
                                                                 "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[-3][len("data: "):])["usage"]["completion_tokens"] == 10


def test_echo_with_logprobs_scores_the_prompt_like_score(sdk, stub):
    text = "pos, enc."
    c = sdk.completions.create(model="learned", prompt=text, max_tokens=0, echo=True, logprobs=1)
    lp = c.choices[0].logprobs
    assert c.choices[0].text == text and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    score = stub.Score(pb.ScoreRequest(model="learned", prompt=pb.Prompt(text=text)), timeout=30)
    np.testing.assert_allclose(lp.token_logprobs[1:], list(score.logprobs), atol=1e-5)
    assert all(c.choices[0].text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens, strict=True))
    assert all(len(top) == 1 and max(top.values()) >= lp.token_logprobs[i] - 1e-6
               for i, top in enumerate(lp.top_logprobs) if top is not None)


def test_generated_logprobs_equal_generate_and_top_candidates(sdk, stub):
    c = sdk.completions.create(model="alibi", prompt="abc", max_tokens=5, temperature=0, logprobs=3)
    want = generate(stub, "alibi", "abc", 5)
    lp = c.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, [m.logprob for m in want], atol=1e-5)
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the top one
    streamed = list(sdk.completions.create(model="alibi", prompt="abc", max_tokens=5, temperature=0, logprobs=3,
                                           stream=True))
    got = [x.choices[0].logprobs.token_logprobs[0] for x in streamed if x.choices[0].logprobs]
    np.testing.assert_allclose(got, [m.logprob for m in want], atol=1e-5)


def test_stop_cuts_the_text_before_the_stop_string(sdk, stub):
    full = generate(stub, "rope", "stop here", 20)[-1].text
    stop = full[5:7]
    c = sdk.completions.create(model="rope", prompt="stop here", max_tokens=20, temperature=0, stop=[stop])
    assert c.choices[0].text == full[:full.find(stop)] and c.choices[0].finish_reason == "stop"
    streamed = "".join(x.choices[0].text for x in sdk.completions.create(
        model="rope", prompt="stop here", max_tokens=20, temperature=0, stop=stop, stream=True))
    assert streamed == c.choices[0].text


def test_seeded_sampling_equals_generate_with_the_seed(sdk, stub):
    args = dict(model="rope", prompt="random", max_tokens=8, temperature=1.0, seed=7)
    a, b = (sdk.completions.create(**args).choices[0].text for _ in range(2))
    assert a == b == generate(stub, "rope", "random", 8, temperature=1.0, seed=7)[-1].text


def test_errors_are_the_sdk_exceptions(sdk):
    with pytest.raises(openai.NotFoundError, match="not chat models"):
        sdk.chat.completions.create(model="rope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        sdk.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens") as err:
        sdk.completions.create(model="rope", prompt="x", max_tokens=10**6)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="logprobs") as err:
        sdk.completions.create(model="rope", prompt="x", logprobs=9)
    assert err.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError, match="prompt"):
        sdk.completions.create(model="rope", prompt=[])
