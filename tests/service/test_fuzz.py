"""Property-based fuzzing of every RPC: any request gets OK or a documented status, never INTERNAL or UNKNOWN,
and the server answers a good request afterwards.  Strings the protobuf client refuses to encode (lone
surrogates, invalid UTF-8) are sent as hand-made wire bytes.

A hang fails: the worker caps every request at SERVER_CAP seconds (--max-request-seconds) and answers
DEADLINE_EXCEEDED itself when its cap passes; the client waits CLIENT_TIMEOUT, several times longer, so a
DEADLINE_EXCEEDED from the client's own timer (gRPC's "Deadline Exceeded") means the worker did not answer."""

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.variants import REGISTRY
from protos.inference import grpc_service_pb2 as kv
from protos.inference import grpc_service_pb2_grpc
from protos.posenc.v1 import posenc_pb2 as pb
from service.registry import Limits
from service.rpc import wire_field
from tests.serving import start

DOCUMENTED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
              "DEADLINE_EXCEEDED"}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
MODELS = sorted(REGISTRY)  # every variant, cpe, xl and deberta included
SERVER_CAP = 5.0
CLIENT_TIMEOUT = 25.0


@pytest.fixture(scope="module")
def server(tiny_artifacts):
    """This module's worker: every request capped at SERVER_CAP seconds by the worker itself."""
    root, _ = tiny_artifacts
    srv = start(root, max_batch=8, max_wait_ms=5.0,
                limits=Limits(max_prompt_tokens=200, max_new_tokens=64, max_request_s=SERVER_CAP))
    yield srv
    srv.stop(grace=1)


int32 = st.integers(-2**31, 2**31 - 1)
small = st.integers(-5, 300)
numbers = st.one_of(int32, small)
doubles = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-5, 5))
names = st.one_of(st.sampled_from(MODELS), st.text(max_size=20), st.just("../rope"), st.just("rope\x00"))
texts = st.one_of(st.text(max_size=200), st.text(alphabet="ab \x00\n", max_size=300), st.just(""))
ids = st.lists(st.one_of(st.integers(0, 255), int32), max_size=300)


def prompt(draw_text, draw_ids, use_ids):
    return pb.Prompt(tokens=pb.TokenIds(ids=draw_ids)) if use_ids else pb.Prompt(text=draw_text)


prompts = st.builds(prompt, texts, ids, st.booleans())


def outcome(fn) -> str:
    try:
        result = fn()
        if hasattr(result, "__next__"):  # a stream: read it all
            list(result)
        return "OK"
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and err.details() == "Deadline Exceeded":
            return "HANG (the client's timer ran out: the worker never answered)"
        return err.code().name


def healthy(stub):
    assert stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ok")), timeout=CLIENT_TIMEOUT).top


def check(code, stub):
    assert code in DOCUMENTED, code
    healthy(stub)


@FUZZ
@given(model=names, p=prompts, top_k=numbers, attention=st.integers(-3, 5), layers=st.lists(numbers, max_size=5),
       heads=st.lists(numbers, max_size=5))
def test_predict(stub, model, p, top_k, attention, layers, heads):
    req = pb.PredictRequest(model=model, prompt=p, top_k=top_k, attention=attention, layers=layers, heads=heads)
    check(outcome(lambda: stub.Predict(req, timeout=CLIENT_TIMEOUT)), stub)


@FUZZ
@given(model=names, p=prompts)
def test_score(stub, model, p):
    check(outcome(lambda: stub.Score(pb.ScoreRequest(model=model, prompt=p), timeout=CLIENT_TIMEOUT)), stub)


@FUZZ
@given(model=names, p=prompts, n=st.one_of(st.integers(-3, 70), int32), temperature=doubles,
       top_k=numbers, top_p=doubles, seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
       stop=st.lists(st.text(max_size=5), max_size=3))
def test_generate(stub, model, p, n, temperature, top_k, top_p, seed, stop):
    req = pb.GenerateRequest(model=model, prompt=p, max_new_tokens=n, temperature=temperature, top_k=top_k,
                             top_p=top_p, stop=stop, **({} if seed is None else {"seed": seed}))
    check(outcome(lambda: stub.Generate(req, timeout=CLIENT_TIMEOUT)), stub)


@FUZZ
@given(p=prompts, permuted=st.one_of(st.none(), prompts), models=st.lists(names, max_size=4), top_k=numbers)
def test_compare(stub, p, permuted, models, top_k):
    req = pb.CompareRequest(prompt=p, models=models, top_k=top_k)
    if permuted is not None:
        req.permuted.CopyFrom(permuted)
    check(outcome(lambda: stub.Compare(req, timeout=CLIENT_TIMEOUT)), stub)


@FUZZ
@given(model=names, text=texts)
def test_tokenize(stub, model, text):
    check(outcome(lambda: stub.Tokenize(pb.TokenizeRequest(model=model, text=text), timeout=CLIENT_TIMEOUT)), stub)


@FUZZ
@given(model=names, length=st.one_of(st.integers(-3, 250), int32))
def test_encoding(stub, model, length):
    req = pb.EncodingRequest(model=model, length=length)
    check(outcome(lambda: stub.Encoding(req, timeout=CLIENT_TIMEOUT)), stub)


DATATYPES = ["INT64", "INT32", "FP32", "FP64", "BYTES", "BOOL", "UINT8", "", "int64", "INT64 "]


@st.composite
def infer_inputs(draw):
    tensor = kv.ModelInferRequest.InferInputTensor(
        name=draw(st.sampled_from(["input_ids", "attention_mask", "past_key_values.0.key", "x", ""])),
        datatype=draw(st.sampled_from(DATATYPES)), shape=draw(st.lists(st.integers(-2, 40), max_size=4)))
    kind = draw(st.integers(0, 3))
    if kind == 0:
        tensor.contents.int64_contents.extend(draw(st.lists(st.integers(-2**63, 2**63 - 1), max_size=80)))
    elif kind == 1:
        tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=40)))
    elif kind == 2:
        tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=8), max_size=4)))
    return tensor, (draw(st.binary(max_size=300)) if kind == 3 else None)


@FUZZ
@given(model=names, inputs=st.lists(infer_inputs(), max_size=3), outputs=st.lists(st.text(max_size=12), max_size=3),
       version=st.sampled_from(["", "1", "2", "x"]))
def test_kserve_model_infer(channel, stub, model, inputs, outputs, version):
    kserve = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
    req = kv.ModelInferRequest(model_name=model, model_version=version,
                               outputs=[kv.ModelInferRequest.InferRequestedOutputTensor(name=o) for o in outputs])
    raws = [raw for _, raw in inputs if raw is not None]
    for tensor, raw in inputs:
        if raw is not None:
            tensor.ClearField("contents")
        req.inputs.append(tensor)
    if raws and len(raws) == len(inputs):  # raw contents are all-or-nothing in the protocol
        req.raw_input_contents.extend(raws)
    check(outcome(lambda: kserve.ModelInfer(req, timeout=CLIENT_TIMEOUT)), stub)


@FUZZ
@given(model=names, version=st.text(max_size=4))
def test_kserve_metadata_calls(channel, stub, model, version):
    kserve = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
    for method, request in ((kserve.ModelMetadata, kv.ModelMetadataRequest),
                            (kserve.ModelConfig, kv.ModelConfigRequest), (kserve.ModelReady, kv.ModelReadyRequest)):
        check(outcome(lambda m=method, r=request: m(r(name=model, version=version), timeout=CLIENT_TIMEOUT)), stub)


@FUZZ
@given(text=st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0xFFFF), max_size=40),
       junk=st.binary(max_size=8))
def test_invalid_surrogates_and_raw_utf8(channel, stub, text, junk):
    raw = text.encode("utf-8", "surrogatepass") + junk  # lone surrogates encode to invalid UTF-8
    body = wire_field(1, b"rope") + wire_field(2, wire_field(1, raw))  # PredictRequest{model, prompt{text}}
    call = channel.unary_unary("/posenc.v1.Posenc/Predict", request_serializer=None, response_deserializer=None)
    check(outcome(lambda: call(body, timeout=CLIENT_TIMEOUT)), stub)


def methods(streaming: bool) -> list[str]:
    """Every method of posenc.v1 and KServe v2 that the worker serves (the descriptors, not a hand-made list)."""
    found = []
    for descriptor, service in ((pb.DESCRIPTOR, "Posenc"), (kv.DESCRIPTOR, "GRPCInferenceService")):
        svc = descriptor.services_by_name[service]
        found += [f"/{svc.full_name}/{m.name}" for m in svc.methods if m.server_streaming == streaming]
    return found


def test_every_method_is_fuzzed_with_raw_bodies():
    assert len(methods(False)) == 14 and "/posenc.v1.Posenc/Profile" in methods(False)
    assert methods(True) == ["/posenc.v1.Posenc/Generate"]


@pytest.mark.parametrize("method", methods(streaming=False))
@FUZZ
@given(body=st.binary(max_size=200))
def test_raw_random_bodies(channel, stub, method, body):
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    check(outcome(lambda: call(body, timeout=CLIENT_TIMEOUT)), stub)


@pytest.mark.parametrize("method", methods(streaming=True))
@FUZZ
@given(body=st.binary(max_size=200))
def test_raw_random_bodies_on_streams(channel, stub, method, body):
    call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
    check(outcome(lambda: call(body, timeout=CLIENT_TIMEOUT)), stub)


def test_a_hang_is_a_failure_not_a_deadline(stub, server):
    """The check itself: a worker that does not answer within the client's timeout reads as a hang."""
    import threading

    from tests.serving import hook

    engine, release = server.registry.engine("rope"), threading.Event()
    previous = hook(engine, lambda work: release.wait(30))  # wedged until released
    try:
        code = outcome(lambda: stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="wedged")),
                                            timeout=1))
    finally:
        release.set()
        engine.use(previous)
    assert code.startswith("HANG") and code not in DOCUMENTED
