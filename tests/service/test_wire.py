"""Responses assembled through the wire format equal the same messages built field by field."""

from hypothesis import given, settings
from hypothesis import strategies as st

from model import tokenizer
from protos.posenc.v1 import posenc_pb2 as pb
from service.rpc import set_tokens


def built(ids):
    return [pb.Token(id=i, piece=p) for i, p in zip(ids, tokenizer.pieces(ids), strict=True)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=300), st.lists(st.integers(0, 255), max_size=40))
def test_set_tokens_equals_building_each_token(ids, other):
    for message, field in ((pb.PredictResponse, "tokens"), (pb.ScoreResponse, "tokens"),
                           (pb.CompareResponse, "tokens"), (pb.CompareResponse, "permuted_tokens")):
        fast = message(model="m") if "model" in message.DESCRIPTOR.fields_by_name else message()
        slow = message()
        slow.CopyFrom(fast)
        set_tokens(fast, field, ids, tokenizer.pieces(ids))
        getattr(slow, field).extend(built(ids))
        if message is pb.CompareResponse:  # both repeated fields side by side keep their own order
            twin = "permuted_tokens" if field == "tokens" else "tokens"
            set_tokens(fast, twin, other, tokenizer.pieces(other))
            getattr(slow, twin).extend(built(other))
        assert fast == slow
        assert [t.id for t in getattr(fast, field)] == ids


def test_pieces_fast_path_matches_display():
    ascii_ids = list(range(128))
    assert tokenizer.pieces(ascii_ids) == [tokenizer.display(i) for i in ascii_ids]
    assert tokenizer.pieces(tokenizer.encode("a中")) == ["a", "<E4 1/3 中>", "<B8 2/3 中>", "<AD 3/3 中>"]


class _Ops:
    """Operations.predict's answer, fixed: what PosencApi.predict_wire assembles is under test here."""

    registry = None

    def __init__(self, predicted):
        self.predicted = predicted

    def predict(self, *args):
        return self.predicted


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 20), st.integers(0, 4), st.booleans())
def test_predict_wire_equals_the_message_built_field_by_field(layers, heads, rows, extra, strided):
    import numpy as np

    from service.jobs import Result
    from service.operations import Predicted
    from service.servicer import PosencApi, candidates

    rng = np.random.default_rng(rows * 31 + extra)
    att = rng.random((layers, heads, rows + extra, rows + 2 * extra), dtype=np.float32)
    view = att[..., extra:, ::2] if strided else att[..., extra:, :rows + extra]  # onnxruntime's rows, cut
    ids = rng.integers(0, 256, rows).tolist()
    result = Result(np.zeros((rows, 256), np.float32), view, [], 0.5, 1.5, 2)
    maps = [(layer, head, view[layer, head]) for layer in range(layers) for head in range(heads)]
    predicted = Predicted(ids, tokenizer.pieces(ids), [(3, 0.25, -1.386)], maps, result, 2.5, tokenizer)
    api = PosencApi.__new__(PosencApi)
    api.ops, api.registry = _Ops(predicted), None
    wire = api.predict_wire(pb.PredictRequest(model="m", prompt=pb.Prompt(text="x")), None)
    want = pb.PredictResponse(model="m", tokens=built(ids), top=candidates(predicted.top, tokenizer),
                              timing=pb.Timing(queue_ms=0.5, compute_ms=1.5, total_ms=2.5, batch_size=2))
    for layer, head, amap in maps:
        want.attention.add(layer=layer, head=head, shape=amap.shape, data=np.ascontiguousarray(amap).tobytes())
    assert pb.PredictResponse.FromString(wire) == want
