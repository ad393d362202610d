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
