"""Interventions through a real worker (posenc.v1 on a loopback port, the tiny artifacts' intervention graphs in
onnxruntime), held to statements that do not come from posenc's code: which encodings are relative (the papers
define them by position differences: RoPE, ALiBi, T5, Shaw, Transformer-XL and DeBERTa; learned, sinusoidal and FIRE
read absolute positions or the query's own), a stretch by s undone by linear scaling by s, and the PyTorch model
given the same positions.  Bad input gets INVALID_ARGUMENT naming the field; a model without an intervention graph
FAILED_PRECONDITION."""

import json

import grpc
import numpy as np
import pytest
import torch

from protos.posenc.v1 import posenc_pb2 as pb
from tests.model.helpers import tiny_model

RELATIVE = ["rope", "alibi", "t5", "shaw", "xl", "deberta"]
ABSOLUTE = ["learned", "sinusoidal", "fire"]
PROMPT = [5, 9, 20, 33, 2, 7]


def predict(stub, model, iv=None, ids=PROMPT, **kw):
    req = pb.PredictRequest(model=model, prompt=pb.Prompt(tokens=pb.TokenIds(ids=ids)), top_k=5, **kw)
    if iv is not None:
        req.intervention.CopyFrom(iv)
    return stub.Predict(req)


def logp_of(resp):
    return {c.token.id: c.logprob for c in resp.top}


@pytest.mark.parametrize("variant", RELATIVE)
def test_a_uniform_shift_leaves_a_relative_encoding_unchanged(stub, variant):
    r = predict(stub, variant, pb.Intervention(shift=7, baseline=True))
    assert list(r.effect.positions) == [7 + i for i in range(len(PROMPT))]
    assert r.effect.has_baseline and r.effect.kl_divergence < 1e-9, r.effect.kl_divergence
    assert [c.token.id for c in r.top] == [c.token.id for c in r.effect.baseline_top]


@pytest.mark.parametrize("variant", ABSOLUTE)
def test_a_uniform_shift_changes_an_absolute_encoding(stub, variant):
    r = predict(stub, variant, pb.Intervention(shift=7, baseline=True))
    assert r.effect.kl_divergence > 1e-6, r.effect.kl_divergence  # the relative ones: below 1e-9


def test_rope_past_a_thousand_positions_is_unchanged_to_float32_rounding(stub):
    r = predict(stub, "rope", pb.Intervention(shift=1000, baseline=True))
    assert r.effect.kl_divergence < 1e-6
    for a, b in zip(r.top, r.effect.baseline_top, strict=True):
        assert a.token.id == b.token.id and abs(a.logprob - b.logprob) < 1e-3


def test_a_stretch_by_s_under_linear_scaling_by_s_is_the_plain_model(stub):
    """Linear scaling divides every frequency by s (position interpolation), so positions s*i under it rotate by
    the angles of positions i."""
    plain = predict(stub, "rope")
    r = predict(stub, "rope", pb.Intervention(stretch=3, rope_scaling=json.dumps({"rope_type": "linear",
                                                                                   "factor": 3.0})))
    assert list(r.effect.positions) == [3 * i for i in range(len(PROMPT))]
    for a, b in zip(r.top, plain.top, strict=True):
        assert a.token.id == b.token.id and abs(a.logprob - b.logprob) < 1e-5
    stretched = predict(stub, "rope", pb.Intervention(stretch=3, baseline=True))
    assert stretched.effect.kl_divergence > 1e-5  # the stretch alone moves the answer


@pytest.mark.parametrize("variant", ["rope", "learned", "alibi", "t5", "fire", "xl"])
def test_served_positions_equal_the_pytorch_model_given_them(stub, variant):
    positions = [0, 1, 3, 4, 8, 9]
    r = predict(stub, variant, pb.Intervention(positions=positions), attention=pb.ATTENTION_FULL)
    model = tiny_model(variant)
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), position_ids=torch.tensor([positions]))
    want = torch.log_softmax(out.logits[0, -1], -1)
    for c in r.top:
        assert abs(c.logprob - float(want[c.token.id])) < 1e-4
    maps = {(m.layer, m.head): np.frombuffer(m.data, "<f4").reshape(m.shape) for m in r.attention}
    for (layer, head), amap in maps.items():
        np.testing.assert_allclose(amap, out.attentions[0, layer, head].numpy(), atol=3e-5)


def test_a_layer_switched_off_and_an_ablated_head_equal_the_pytorch_model_so_changed(stub):
    from model.attention import Intervention

    model = tiny_model("alibi")
    on, keep = torch.ones(1, 2), torch.ones(1, 2, 4)
    on[0, 1], keep[0, 0, 3] = 0.0, 0.0
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), intervention=Intervention(on, keep))
        plain = model(torch.tensor([PROMPT]))
    r = predict(stub, "alibi", pb.Intervention(positional_off=[1], ablate_heads=[pb.HeadRef(layer=0, head=3)],
                                               baseline=True))
    want = torch.log_softmax(out.logits[0, -1], -1)
    for c in r.top:
        assert abs(c.logprob - float(want[c.token.id])) < 1e-4
    # independent of posenc's switch: layer 1 without its bias attends by content alone, which for ALiBi's model
    # (no other positional term) is the same whatever the positions
    assert r.effect.kl_divergence > 1e-6
    assert (out.logits - plain.logits).abs().max() > 1e-4


def test_generate_continues_from_the_positions_given(stub):
    positions, start, n = [0, 2, 4, 6, 8, 10], 20, 6
    tokens = [x.token.id for x in stub.Generate(pb.GenerateRequest(
        model="rope", prompt=pb.Prompt(tokens=pb.TokenIds(ids=PROMPT)), max_new_tokens=n,
        intervention=pb.Intervention(positions=positions, next_position=start)))]
    model, ids, pos = tiny_model("rope"), list(PROMPT), list(positions)
    want = []
    with torch.no_grad():
        for i in range(n):
            out = model(torch.tensor([ids]), position_ids=torch.tensor([pos]))
            want.append(int(out.logits[0, -1].argmax()))
            ids.append(want[-1])
            pos.append(start + i)
    assert tokens == want


def test_score_reports_each_tokens_change(stub):
    r = stub.Score(pb.ScoreRequest(model="learned", prompt=pb.Prompt(tokens=pb.TokenIds(ids=PROMPT)),
                                   intervention=pb.Intervention(shift=5, baseline=True)))
    plain = stub.Score(pb.ScoreRequest(model="learned", prompt=pb.Prompt(tokens=pb.TokenIds(ids=PROMPT))))
    np.testing.assert_allclose(r.effect.baseline_logprobs, plain.logprobs, atol=1e-5)
    np.testing.assert_allclose(r.effect.logprob_change, np.subtract(r.logprobs, plain.logprobs), atol=1e-5)
    assert max(abs(x) for x in r.effect.logprob_change) > 1e-4


def test_profile_with_a_baseline_gives_both(stub):
    r = stub.Profile(pb.ProfileRequest(model="rope", prompt=pb.Prompt(tokens=pb.TokenIds(ids=PROMPT)),
                                       intervention=pb.Intervention(positional_off=[0, 1], baseline=True)))
    plain = stub.Profile(pb.ProfileRequest(model="rope", prompt=pb.Prompt(tokens=pb.TokenIds(ids=PROMPT))))
    np.testing.assert_allclose(np.frombuffer(r.effect.baseline_profile, "<f4"), np.frombuffer(plain.values, "<f4"),
                               atol=1e-6)
    assert np.abs(np.frombuffer(r.values, "<f4") - np.frombuffer(plain.values, "<f4")).max() > 1e-4


def test_interventions_leave_no_trace_in_the_plain_answers(stub):
    """Intervention calls bypass the engine's batch and its prefix cache: the plain answer after them is the
    plain answer before them, to the bit."""
    before = predict(stub, "rope", attention=pb.ATTENTION_LAST_ROW)
    for shift in (3, 50):
        predict(stub, "rope", pb.Intervention(shift=shift, positional_off=[0]), attention=pb.ATTENTION_LAST_ROW)
    after = predict(stub, "rope", attention=pb.ATTENTION_LAST_ROW)
    assert before.top == after.top
    assert [m.data for m in before.attention] == [m.data for m in after.attention]


BAD = [
    ("rope", pb.Intervention(positions=[1, 2]), "intervention.positions"),
    ("rope", pb.Intervention(positions=[0, 1, -2, 3, 4, 5]), "intervention.positions"),
    ("rope", pb.Intervention(shift=-1), "intervention.shift"),
    ("learned", pb.Intervention(shift=40), "intervention.positions"),
    ("rope", pb.Intervention(positional_off=[2]), "intervention.positional_off"),
    ("rope", pb.Intervention(ablate_heads=[pb.HeadRef(layer=0, head=4)]), "intervention.ablate_heads"),
    ("rope", pb.Intervention(ablate_heads=[pb.HeadRef(layer=5, head=0)]), "intervention.ablate_heads"),
    ("alibi", pb.Intervention(rope_scaling='{"rope_type": "linear", "factor": 2}'), "intervention.rope_scaling"),
    ("rope", pb.Intervention(rope_scaling='{"rope_type": "warp"}'), "rope_scaling.rope_type"),
    ("rope", pb.Intervention(rope_scaling='{"rope_type": "linear"}'), "rope_scaling.factor"),
    ("cpe", pb.Intervention(shift=3), "cpe"),
    ("learned", pb.Intervention(positional_off=[0]), "learned"),
    ("rope", pb.Intervention(positions=[0, 1, 2, 3, 4, 5], shift=2), "intervention.positions"),
]


@pytest.mark.parametrize(("model", "iv", "named"), BAD, ids=[f"{m}-{n}" for m, _, n in BAD])
def test_bad_interventions_are_refused_naming_the_field(stub, model, iv, named):
    with pytest.raises(grpc.RpcError) as err:
        predict(stub, model, iv)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in err.value.details() and "\n" not in err.value.details()


def test_mixer_maps_of_a_model_without_mixers_are_refused_naming_the_field(stub):
    with pytest.raises(grpc.RpcError) as err:
        predict(stub, "rope", attention=pb.ATTENTION_FULL, mixer_maps=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mixer_maps" in err.value.details() and "\n" not in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Profile(pb.ProfileRequest(model="rope", prompt=pb.Prompt(tokens=pb.TokenIds(ids=PROMPT)),
                                       mixer_maps=True))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "mixer_maps" in err.value.details()


def test_generate_refuses_a_baseline(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(model="rope", prompt=pb.Prompt(text="ab"), max_new_tokens=2,
                                              intervention=pb.Intervention(baseline=True))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "intervention.baseline" in err.value.details()


def test_a_model_exported_without_interventions_says_so(tmp_path):
    from export.build import build_artifact
    from service.artifacts import load_artifact
    from service.errors import FailedPrecondition
    from service.intervened import predict as intervened_predict
    from service.intervention import Intervention
    from service.operations import Operations
    from service.registry import Registry
    from service.settings import Batching, Limits

    build_artifact(tiny_model("rope"), tmp_path / "rope", name="rope", opset=23, source={"kind": "random"},
                   training={}, force=False, interventions=False)
    model = load_artifact(tmp_path / "rope", threads=1)
    assert model.intervene is None and not (tmp_path / "rope" / "intervene.onnx").exists()
    ops = Operations(Registry({"rope": model}, Limits(), Batching(max_wait_ms=0)))
    try:
        with pytest.raises(FailedPrecondition, match="--interventions off"):
            intervened_predict(ops, "rope", None, PROMPT, Intervention(shift=2))
    finally:
        ops.registry.close()


def test_list_models_says_what_each_model_may_change(stub):
    """From the papers' definitions: RoPE rotates in every layer (positions, a layer's switch, another scaling);
    ALiBi biases every layer's scores; a learned table is added to the embeddings (positions only); CPE's
    convolution reads neighbours, not indices (neither)."""
    support = {m.name: m.interventions for m in stub.ListModels(pb.ListModelsRequest()).models}
    want = {"rope": (True, True, True), "alibi": (True, True, False), "learned": (True, False, False),
            "cpe": (False, False, False)}
    for name, flags in want.items():
        s = support[name]
        assert (s.positions, s.positional_off, s.rope_scaling) == flags, name


def test_a_model_without_a_profile_graph_is_failed_precondition_with_an_intervention_or_without(tiny_artifact):
    """The Profile RPC's contract (docs/profiles.md, the error table): an artifact whose model.json has no profile
    entry answers FAILED_PRECONDITION naming the re-export, the same whether the request intervenes or not."""
    import dataclasses

    from service.artifacts import load_artifact
    from service.errors import FailedPrecondition
    from service.intervened import profile as intervened_profile
    from service.intervention import Intervention
    from service.operations import Operations
    from service.profile import profile as plain_profile
    from service.registry import Registry
    from service.settings import Batching, Limits

    folder, _ = tiny_artifact("rope")
    loaded = load_artifact(folder, threads=1)
    assert loaded.meta.profile is not None  # the graph is there: the test takes its entry away
    model = dataclasses.replace(loaded, meta=dataclasses.replace(loaded.meta, profile=None))
    ops = Operations(Registry({"rope": model}, Limits(), Batching(max_wait_ms=0)))
    try:
        with pytest.raises(FailedPrecondition, match="has no profile graph.*re-export"):
            plain_profile(ops, "rope", None, PROMPT)
        with pytest.raises(FailedPrecondition, match="has no profile graph.*re-export"):
            intervened_profile(ops, "rope", None, PROMPT, Intervention(shift=2))
    finally:
        ops.registry.close()
