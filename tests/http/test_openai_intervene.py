"""OpenAI completions and chat under posenc's `intervention` extension (the openai SDK's extra_body), against a real
worker: greedy tokens and their log-probabilities equal posenc.v1 Generate with the same intervention over gRPC,
unary and streamed; a bad field is openai.BadRequestError whose param names it."""

import numpy as np
import openai
import pytest

from protos.posenc.v1 import posenc_pb2 as pb
from tests.http.conftest import Http
from tests.serving import start

pytestmark = pytest.mark.xdist_group("openai-intervene")  # one worker imports the chat model once (make test)

PROMPT = [72, 101, 108, 108, 111, 32, 119]  # token ids: every position known
CASES = {  # name: (model, the extension's object, posenc.v1's Intervention)
    "shift+switch+ablation": ("rope", {"shift": 5, "positional_off": [1], "ablate_heads": [[0, 1], "1.2"]},
                              pb.Intervention(shift=5, positional_off=[1],
                                              ablate_heads=[pb.HeadRef(layer=0, head=1), pb.HeadRef(layer=1, head=2)])),
    "positions": ("learned", {"positions": [0, 2, 3, 4, 6, 7, 8], "next_position": 9},
                  pb.Intervention(positions=[0, 2, 3, 4, 6, 7, 8], next_position=9)),
    "stretch": ("alibi", {"stretch": 2}, pb.Intervention(stretch=2)),
    "scaling": ("rope", {"rope_scaling": {"rope_type": "linear", "factor": 2}},
                pb.Intervention(rope_scaling='{"rope_type": "linear", "factor": 2}')),
}


def generated(stub, model, ids, n, iv, ignore_eos=False):
    """posenc.v1 Generate's greedy tokens, their log-probabilities and its text under the intervention."""
    out = list(stub.Generate(pb.GenerateRequest(model=model, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)),
                                                max_new_tokens=n, intervention=iv, ignore_eos=ignore_eos),
                             timeout=60))
    return [r.token.id for r in out], [r.logprob for r in out], out[-1].text


@pytest.mark.parametrize("case", CASES)
def test_greedy_completion_under_an_intervention_equals_generate(sdk, stub, case):
    model, extension, iv = CASES[case]
    ids, logprobs, text = generated(stub, model, PROMPT, 6, iv)
    c = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                               extra_body={"intervention": extension})
    assert c.choices[0].text == text and c.usage.completion_tokens == len(ids) > 0
    np.testing.assert_allclose(c.choices[0].logprobs.token_logprobs, logprobs, atol=1e-5)
    plain = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    plain_lp = plain.choices[0].logprobs.token_logprobs
    assert len(plain_lp) != len(logprobs) or not np.allclose(plain_lp, logprobs, atol=1e-3)  # it changed something
    streamed = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                      extra_body={"intervention": extension})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text


def test_an_empty_intervention_is_the_plain_completion(sdk):
    a = sdk.completions.create(model="rope", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                               extra_body={"intervention": {}})
    b = sdk.completions.create(model="rope", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    assert a.choices[0].text == b.choices[0].text
    np.testing.assert_allclose(a.choices[0].logprobs.token_logprobs, b.choices[0].logprobs.token_logprobs, atol=1e-5)


@pytest.mark.parametrize("model, extension, param, words", [
    ("rope", {"shift": "far"}, "intervention.shift", "integer"),
    ("rope", {"shfit": 3}, "intervention.shfit", "unknown field"),
    ("rope", {"baseline": True}, "intervention.baseline", "Predict"),
    ("rope", {"positional_off": [2]}, "intervention.positional_off", "out of range"),
    ("rope", {"ablate_heads": [[0, 9]]}, "intervention.ablate_heads", "head 9"),
    ("rope", {"positions": [0, 1]}, "intervention.positions", "2 positions"),
    ("learned", {"shift": 12}, "intervention.positions", "16 positions"),
    ("cpe", {"shift": 1}, "intervention.positions", "cpe"),
    ("learned", {"positional_off": [0]}, "intervention.positional_off", "learned"),
    ("rope", {"rope_scaling": {"rope_type": "dynamic", "factor": 2}}, "intervention.rope_scaling", "Generate"),
    ("rope", [1, 2], "intervention", "dictionary"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_field_is_a_bad_request_naming_it(sdk, model, extension, param, words, stream):
    with pytest.raises(openai.BadRequestError) as err:
        c = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=stream,
                                   extra_body={"intervention": extension})
        list(c) if stream else None
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == param and words in body["message"], body


# --- chat: an imported model with a chat template -------------------------------------------------------------


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny LLaMA with gemma-2-it's chat template (tests/hf/chat_templates.py), imported and served: (the SDK
    client, the HTTP client, a posenc.v1 stub)."""
    import grpc

    from export.hf import import_artifact
    from protos.posenc.v1 import posenc_pb2_grpc
    from tests.hf.chat_templates import save_chat_model

    root = tmp_path_factory.mktemp("chat-intervene")
    save_chat_model("gemma", root / "hf", seed=16)
    import_artifact(root / "hf", root / "artifacts" / "gemma", validation_max_length=16)
    srv = start(root / "artifacts", http_port=0)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        yield client, Http(srv.http_port), posenc_pb2_grpc.PosencStub(channel)
    client.close()
    srv.stop(grace=1)


MESSAGES = [{"role": "user", "content": "dog bites man"}]


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_chat_under_an_intervention_equals_generate(chat, stream):
    client, web, stub = chat
    status, doc = web.json("POST", "/v1/tokenize", {"model": "gemma", "messages": MESSAGES})
    assert status == 200
    extension = {"shift": 40, "positional_off": [0], "ablate_heads": ["1.1"]}
    iv = pb.Intervention(shift=40, positional_off=[0], ablate_heads=[pb.HeadRef(layer=1, head=1)])
    ids, logprobs, text = generated(stub, "gemma", doc["tokens"], 8, iv, ignore_eos=True)
    _, plain_logprobs, _ = generated(stub, "gemma", doc["tokens"], 8, pb.Intervention(), ignore_eos=True)
    assert not np.allclose(logprobs, plain_logprobs, atol=1e-3)
    kw = {"model": "gemma", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "extra_body":
          {"intervention": extension, "ignore_eos": True}}
    if stream:
        content = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                          if c.choices)
    else:
        reply = client.chat.completions.create(logprobs=True, **kw)
        content = reply.choices[0].message.content
        np.testing.assert_allclose([t.logprob for t in reply.choices[0].logprobs.content], logprobs, atol=1e-5)
        assert reply.usage.completion_tokens == len(ids)
    assert content == text


def test_chat_refuses_a_baseline(chat):
    client = chat[0]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="gemma", messages=MESSAGES, max_tokens=2,
                                       extra_body={"intervention": {"baseline": True}})
    assert err.value.body["param"] == "intervention.baseline" and "Predict" in err.value.body["message"]
