"""Property-based fuzzing of the HTTP routes: random and malformed bodies get a documented status (never a 500),
and the worker answers a good request afterwards.  (A 500 would carry a request id that is in the log:
test_contract.py checks that path.)"""

import json
from urllib.parse import quote

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DOCUMENTED = {200, 400, 404, 405, 413, 422, 429, 504}
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
MODELS = ["rope", "alibi", "learned", "sinusoidal"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=20))
anything = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=5),
                                                      st.dictionaries(st.text(max_size=8), c, max_size=5)),
                        max_leaves=20)
names = st.one_of(st.sampled_from(MODELS), st.text(max_size=12), st.just("../rope"), st.just("rope\x00"))
ints = st.one_of(st.integers(-3, 70), st.integers(-2**65, 2**65))
maybe = lambda s: st.one_of(st.just(None), s, anything)  # noqa: E731 - a field: absent, plausible or anything
prompts = st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3),
                    st.lists(st.integers(-5, 300), max_size=20),
                    st.lists(st.lists(st.integers(-5, 300), max_size=5), max_size=3))


def check(web, status, data):
    assert status in DOCUMENTED, (status, data[:300])
    if status != 200:
        assert "error" in json.loads(data), data[:300]
    assert web.call("POST", "/v1/posenc/predict", {"model": "rope", "prompt": {"text": "ok"}})[0] == 200


def post(web, path, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, data = web.call("POST", path, raw)
    return status, data


@FUZZ
@given(body=st.one_of(anything, st.binary(max_size=200)),
       path=st.sampled_from(["/v2/models/rope/infer", "/v1/completions", "/v1/chat/completions",
                             "/v1/posenc/predict", "/v1/posenc/generate", "/v1/posenc/score",
                             "/v1/posenc/compare", "/v1/posenc/encoding", "/v1/posenc/models"]))
def test_any_body_on_any_route(web, body, path):
    check(web, *post(web, path, body))


@FUZZ
@given(model=names, prompt=maybe(prompts), max_tokens=maybe(ints), temperature=maybe(st.floats()),
       top_p=maybe(st.floats()), logprobs=maybe(ints), echo=maybe(st.booleans()), stream=maybe(st.booleans()),
       stop=maybe(st.lists(st.text(max_size=3), max_size=5)), seed=maybe(ints), n=maybe(ints))
def test_completions(web, model, prompt, max_tokens, temperature, top_p, logprobs, echo, stream, stop, seed, n):
    body = {k: v for k, v in dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                  top_p=top_p, logprobs=logprobs, echo=echo, stream=stream, stop=stop, seed=seed,
                                  n=n).items() if v is not None}
    check(web, *post(web, "/v1/completions", body))


tensor = st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["input_ids", "attention_mask"]), anything),
                                "shape": st.one_of(st.lists(st.integers(-2, 40), max_size=4), anything),
                                "datatype": st.one_of(st.sampled_from(["INT64", "INT32", "FP32", "BOOL", "BYTES"]),
                                                      anything)},
                               optional={"data": st.one_of(st.lists(st.integers(-300, 300), max_size=60), anything),
                                         "parameters": st.one_of(st.fixed_dictionaries(
                                             {"binary_data_size": st.integers(-8, 64)}), anything)})


@FUZZ
@given(model=names, inputs=st.lists(tensor, max_size=3), outputs=maybe(st.lists(st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["logits", "attentions"]), st.text(max_size=5))}), max_size=3)),
       binary=st.binary(max_size=64), header=st.booleans())
def test_kserve_infer(web, model, inputs, outputs, binary, header):
    head = json.dumps({"inputs": inputs, **({"outputs": outputs} if outputs is not None else {})}).encode()
    extra = {"inference-header-content-length": str(len(head))} if header else {}
    status, _, data = web.call("POST", f"/v2/models/{quote(model, safe='')}/infer",
                               head + (binary if header else b""), extra)
    check(web, status, data)


@FUZZ
@given(model=names, prompt=maybe(st.fixed_dictionaries({}, optional={"text": anything, "tokens": anything})),
       top_k=maybe(ints), attention=maybe(st.sampled_from(["ATTENTION_FULL", "ATTENTION_LAST_ROW", 7, "NOPE"])),
       layers=maybe(st.lists(ints, max_size=3)), route=st.sampled_from(["predict", "score", "generate", "encoding"]),
       length=maybe(ints), max_new_tokens=maybe(ints))
def test_posenc_json(web, model, prompt, top_k, attention, layers, route, length, max_new_tokens):
    fields = dict(model=model, prompt=prompt, top_k=top_k, attention=attention, layers=layers)
    if route == "encoding":
        fields = dict(model=model, length=length)
    elif route == "generate":
        fields = dict(model=model, prompt=prompt, max_new_tokens=max_new_tokens, top_k=top_k)
    elif route == "score":
        fields = dict(model=model, prompt=prompt)
    check(web, *post(web, f"/v1/posenc/{route}", {k: v for k, v in fields.items() if v is not None}))


@FUZZ
@given(path=st.text(alphabet="/abcv12{}%.", max_size=30), method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
def test_random_routes(web, path, method):
    status, _, data = web.call(method, "/" + quote(path.lstrip("/"), safe="/{}%"), b"{}" if method != "GET" else None)
    check(web, status, data)
