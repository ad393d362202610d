"""OpenAI completions' semantics with a real worker and the openai SDK: what a completion reports comes from the
decode loop (no second forward pass, no Predict per token), a list of prompts shares the loop, the fields are
OpenAI's own (top_p 0, stop lists, echo of token ids, text offsets in characters), and every refusal names the
HTTP field before the first byte of a stream."""

import json

import openai
import pytest

from model import tokenizer
from service.registry import Limits
from tests.serving import slow_runs, start


def test_top_p_zero_is_greedy(sdk):
    greedy = sdk.completions.create(model="rope", prompt="The cat", max_tokens=12, temperature=0).choices[0].text
    for seed in (1, 2, 3):
        c = sdk.completions.create(model="rope", prompt="The cat", max_tokens=12, temperature=1.0, top_p=0,
                                   seed=seed)
        assert c.choices[0].text == greedy


def test_sixteen_stop_strings_are_taken_and_more_are_refused_naming_stop(sdk):
    args = dict(model="rope", prompt="abc", max_tokens=8, temperature=0)
    full = sdk.completions.create(**args).choices[0].text
    absent = [f"zz{i}" for i in range(14)] + ["\x00"]  # what lm-evaluation-harness sends, and more
    assert len(full) >= 4 and not any(s in full for s in absent + ["\x01"])
    c = sdk.completions.create(**args, stop=absent + ["\x01"])  # none of the sixteen in the text
    assert (c.choices[0].text, c.choices[0].finish_reason) == (full, "length")
    c = sdk.completions.create(**args, stop=absent + [full[2:4]])
    assert (c.choices[0].text, c.choices[0].finish_reason) == (full[:full.find(full[2:4])], "stop")
    with pytest.raises(openai.BadRequestError, match="stop") as err:
        sdk.completions.create(**args, stop=absent + ["\x01", "one more"])
    assert err.value.body["param"] == "stop"


@pytest.fixture(scope="module")
def no_stops(one_model_dir):
    """A worker started with --max-stop-strings 0."""
    srv = start(one_model_dir, http_port=0, limits=Limits(max_stop_strings=0))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    yield client
    client.close()
    srv.stop(grace=1)


def test_max_stop_strings_zero_refuses_every_stop_string(no_stops):
    c = no_stops.completions.create(model="rope", prompt="abc", max_tokens=3, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 3
    for stop in ("x", ["x"]):
        with pytest.raises(openai.BadRequestError, match="--max-stop-strings") as err:
            no_stops.completions.create(model="rope", prompt="abc", max_tokens=3, stop=stop)
        assert err.value.body["param"] == "stop"


def test_max_tokens_null_runs_to_the_servers_cap_or_the_models_limit(sdk, web, server):
    """OpenAI's spec and vLLM take max_tokens: null as no count of its own: the server's --max-new-tokens (64 here),
    or the model's position limit where that comes first (the learned table), finish_reason "length" either way."""
    cap = server.registry.limits.max_new_tokens
    c = sdk.completions.create(model="rope", prompt="abc", max_tokens=None, temperature=0)
    assert (c.usage.completion_tokens, c.choices[0].finish_reason) == (cap, "length")
    status, body = web.json("POST", "/v1/completions", {"model": "rope", "prompt": "abc", "max_tokens": None,
                                                        "temperature": 0})  # null on the wire, as sent here
    assert status == 200 and body["usage"]["completion_tokens"] == cap
    table = server.registry.models["learned"].max_positions
    assert table is not None and table - 5 < cap
    c = sdk.completions.create(model="learned", prompt=[65] * (table - 5), max_tokens=None, temperature=0)
    assert (c.usage.completion_tokens, c.choices[0].finish_reason) == (5, "length")
    with pytest.raises(openai.BadRequestError, match="max_tokens") as err:
        sdk.completions.create(model="rope", prompt="abc", max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"logprobs": 9}, "logprobs"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": "x" * 500}, "prompt"),
    ({"n": 2}, "n"),
])
def test_a_bad_field_is_a_400_naming_it_even_streamed_with_echo(web, body, param):
    for extra in ({}, {"stream": True, "echo": True}):
        status, _, data = web.call("POST", "/v1/completions", {"model": "rope", "prompt": "abc", **body, **extra})
        assert status == 400, data
        assert json.loads(data)["error"]["param"] == param


def test_echo_of_token_ids_is_their_text_and_offsets_count_characters(sdk):
    ids = tokenizer.encode("中a")
    c = sdk.completions.create(model="rope", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = c.choices[0].logprobs
    assert c.choices[0].text == "中a"
    assert lp.tokens == ["bytes:\\xe4", "bytes:\\xb8", "bytes:\\xad", "a"]
    assert lp.text_offset == [0, 0, 0, 1]


def test_logprobs_need_no_room_past_the_prompt_limit(sdk, server):
    """A prompt at the server's limit (200 tokens here) with logprobs: the log-probabilities come from the decode
    loop, so nothing runs prompt + completion through the model again."""
    limit = server.registry.limits.max_prompt_tokens
    c = sdk.completions.create(model="rope", prompt=[65] * limit, max_tokens=4, temperature=0, logprobs=2,
                               echo=True)
    assert len(c.choices[0].logprobs.tokens) == limit + 4


def test_a_streamed_completion_with_logprobs_runs_the_model_as_often_as_without(sdk, server):
    """With speculation (the default) and without it: with plain steps, one prefill row and 15 decode rows each."""
    engine = server.registry.engine("alibi")
    default = engine.batch.speculate
    runs = {}
    try:
        for speculate in (default, 0):
            engine.batch.speculate = speculate
            for logprobs in (None, 5):
                before = engine.stats.rows_run
                chunks = list(sdk.completions.create(model="alibi", prompt="count the runs", max_tokens=16,
                                                     temperature=0, logprobs=logprobs, stream=True))
                runs[speculate, logprobs] = engine.stats.rows_run - before
                assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == \
                    (16 if logprobs else 0)
    finally:
        engine.batch.speculate = default
    assert default > 0 and runs[default, None] == runs[default, 5] <= 16
    assert runs[0, None] == runs[0, 5] == 16


def test_a_list_of_prompts_enters_the_decode_loop_together(sdk, server):
    prompts = ["one", "two two", "three three three", "four"]
    alone = [sdk.completions.create(model="rope", prompt=p, max_tokens=10, temperature=0).choices[0].text
             for p in prompts]
    engine = server.registry.engine("rope")
    previous = slow_runs(engine, 0.01)
    try:
        steps = engine.stats.steps
        c = sdk.completions.create(model="rope", prompt=prompts, max_tokens=10, temperature=0)
        taken = engine.stats.steps - steps
    finally:
        engine.use(previous)
    assert [x.index for x in c.choices] == [0, 1, 2, 3]
    assert [x.text for x in c.choices] == alone
    assert taken < 2 * 9, "the prompts were generated one after another"


def test_too_many_prompts_are_refused_naming_prompt(sdk, server):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model="rope", prompt=["x"] * 1000, max_tokens=1)
    assert err.value.body["param"] == "prompt"


def test_an_unknown_model_is_a_404(web):
    status, _, data = web.call("POST", "/v1/completions", {"model": "no-such-model", "prompt": "x"})
    assert status == 404 and "no-such-model" in json.loads(data)["error"]["message"]
