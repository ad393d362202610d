"""Imported families through the worker: text Predict with the model's own tokenizer.json, KServe ModelInfer with
attentions, Generate's text and Score's nats per byte, each against transformers (the independent reference) and
the tokenizers library."""

import shutil

import grpc
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from protos.inference import grpc_service_pb2 as kv
from protos.inference import grpc_service_pb2_grpc
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.hf.conftest import FAMILIES
from tests.hf.helpers import TOKENIZER_VOCAB, VOCAB
from tests.serving import start

TEXT = "The quick brown fox jumps over the lazy dog. 中文 🙂"


@pytest.fixture(scope="module")
def served(hf_families, tmp_path_factory):
    models = tmp_path_factory.mktemp("served")
    for family, f in hf_families.items():
        shutil.copytree(f["artifact"], models / family)
    srv = start(models)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield srv, posenc_pb2_grpc.PosencStub(ch), grpc_service_pb2_grpc.GRPCInferenceServiceStub(ch)
    ch.close()
    srv.stop(grace=1)


def hf_logits_attn(family, hf, ids):
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), output_attentions=True)
    return out.logits[0].numpy(), np.stack([a[0].numpy() for a in out.attentions])


def test_list_models_reports_the_tokenizer(served, hf_families):
    _, stub, _ = served
    info = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
    for family in FAMILIES:
        m = info[family]
        assert m.tokenizer == "huggingface-tokenizers" and m.vocab_size == VOCAB
        assert m.tokenizer_vocab_size == TOKENIZER_VOCAB


@pytest.mark.parametrize("family", FAMILIES)
def test_text_predict_uses_the_models_tokenizer_and_equals_transformers(served, hf_families, family):
    _, stub, _ = served
    f = hf_families[family]
    tok = Tokenizer.from_file(str(f["folder"] / "tokenizer.json"))
    ids = tok.encode(TEXT).ids
    resp = stub.Predict(pb.PredictRequest(model=family, prompt=pb.Prompt(text=TEXT), top_k=5,
                                          attention=pb.ATTENTION_LAST_ROW), timeout=30)
    assert [t.id for t in resp.tokens] == ids
    logits, attn = hf_logits_attn(family, f["hf"], ids)
    last = logits[-1].astype(np.float64)
    logp = last - last.max() - np.log(np.exp(last - last.max()).sum())
    want = np.argsort(-logp, kind="stable")[:5]
    assert [c.token.id for c in resp.top] == list(want)
    assert np.allclose([c.logprob for c in resp.top], logp[want], atol=1e-4)
    for m in resp.attention:
        row = np.frombuffer(m.data, "<f4").reshape(m.shape)[-1]
        assert np.allclose(row, attn[m.layer, m.head, -1], atol=3e-5)
    # pieces are the tokens' own text, a leading space shown as ␠ (as the byte models show it)
    for t in resp.tokens:
        text = tok.decode([t.id]) if t.id < TOKENIZER_VOCAB else ""
        if text.isprintable() and "\ufffd" not in text and text.strip() == text.lstrip(" ") and text.strip():
            assert t.piece == "␠" * (len(text) - len(text.lstrip(" "))) + text.lstrip(" ")


@pytest.mark.parametrize("family", FAMILIES)
def test_model_infer_with_attentions_equals_transformers(served, hf_families, family):
    _, _, kstub = served
    f = hf_families[family]
    ids = np.array([[5, 17, 42, 99, 123, 250, 7]], np.int64)
    t = kv.ModelInferRequest.InferInputTensor(name="input_ids", datatype="INT64", shape=list(ids.shape))
    req = kv.ModelInferRequest(model_name=family, inputs=[t])
    req.raw_input_contents.append(ids.tobytes())
    resp = kstub.ModelInfer(req, timeout=30)
    out = {o.name: np.frombuffer(r, "<f4").reshape(o.shape) for o, r in zip(resp.outputs, resp.raw_output_contents,
                                                                          strict=True)}
    logits, attn = hf_logits_attn(family, f["hf"], ids[0].tolist())
    assert np.allclose(out["logits"][0], logits, atol=1e-4)
    assert np.allclose(out["attentions"][0], attn, atol=3e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_and_score_equal_transformers(served, hf_families, family):
    """Generate's tokens are generate()'s (its end of sequence included: no min_new_tokens), its text the
    tokenizer's decode of prompt + completion less the prompt's; Score's log-probabilities are the model's."""
    _, stub, _ = served
    f = hf_families[family]
    tok = Tokenizer.from_file(str(f["folder"] / "tokenizer.json"))
    msgs = list(stub.Generate(pb.GenerateRequest(model=family, prompt=pb.Prompt(text=TEXT), max_new_tokens=24),
                              timeout=60))
    ids = tok.encode(TEXT).ids
    with torch.no_grad():
        want = f["hf"].generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                                max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    got = [m.token.id for m in msgs]
    assert got == want
    eos = set(np.atleast_1d(f["hf"].generation_config.eos_token_id).tolist())
    text_ids = [i for i in got if i not in eos]
    whole = tok.decode(ids + text_ids, skip_special_tokens=True)
    assert msgs[-1].text == whole[len(tok.decode(ids, skip_special_tokens=True)):]
    assert msgs[-1].finish_reason == ("stop" if got[-1] in eos else "length")
    score = stub.Score(pb.ScoreRequest(model=family, prompt=pb.Prompt(text=TEXT)), timeout=30)
    logits, _ = hf_logits_attn(family, f["hf"], ids)
    logp = torch.log_softmax(torch.from_numpy(logits).double(), -1).numpy()
    np.testing.assert_allclose(score.logprobs, [logp[t, ids[t + 1]] for t in range(len(ids) - 1)], atol=2e-4)


def test_triton_repository_carries_external_data(hf_families, tmp_path):
    import onnxruntime as ort

    from export.triton import write_repository

    bloom = hf_families["bloom"]["artifact"]
    assert (bloom / "model.onnx.data").exists()  # the fixture writes BLOOM with external data
    write_repository(bloom.parent, tmp_path / "repo")
    version = tmp_path / "repo" / "bloom" / "1"
    assert (version / "model.onnx.data").read_bytes() == (bloom / "model.onnx.data").read_bytes()
    sess = ort.InferenceSession(str(version / "model.onnx"), providers=["CPUExecutionProvider"])
    assert {i.name for i in sess.get_inputs()} >= {"input_ids", "attention_mask"}
