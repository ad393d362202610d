"""The further families through the worker, one worker for all of them: text Predict with each model's own
tokenizer.json (top candidates and the last attention row) and Generate's tokens, each against transformers."""

import shutil

import grpc
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.hf.conftest import MORE
from tests.hf.helpers import REFERENCE_ATTENTION, per_layer_maps
from tests.serving import start

TEXT = "def window(x): return x[-7:]  # 中文 🙂"


@pytest.fixture(scope="module")
def served(hf_zoo, tmp_path_factory):
    models = tmp_path_factory.mktemp("served-zoo")
    for family in MORE:
        shutil.copytree(hf_zoo[family]["artifact"], models / family)
    srv = start(models)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield posenc_pb2_grpc.PosencStub(ch)
    ch.close()
    srv.stop(grace=1)


@pytest.mark.parametrize("family", MORE)
def test_predict_and_generate_equal_transformers(served, hf_zoo, family):
    entry = hf_zoo[family]
    hf, tok = entry["hf"], Tokenizer.from_file(str(entry["folder"] / "tokenizer.json"))
    ids = tok.encode(TEXT).ids
    maps = family not in REFERENCE_ATTENTION
    resp = served.Predict(pb.PredictRequest(model=family, prompt=pb.Prompt(text=TEXT), top_k=5,
                                            attention=pb.ATTENTION_LAST_ROW if maps else pb.ATTENTION_NONE),
                          timeout=60)
    assert [t.id for t in resp.tokens] == ids
    with torch.no_grad():
        out = per_layer_maps(hf.config, hf(input_ids=torch.tensor([ids]), output_attentions=maps))
    last = out.logits[0, -1].double().numpy()
    logp = last - last.max() - np.log(np.exp(last - last.max()).sum())
    want = np.argsort(-logp, kind="stable")[:5]
    assert [c.token.id for c in resp.top] == list(want)
    assert np.allclose([c.logprob for c in resp.top], logp[want], atol=1e-4)
    if maps:
        assert len(resp.attention) == hf.config.num_hidden_layers * hf.config.num_attention_heads
        for m in resp.attention:  # a mixer layer's (None here) are proven in test_mixers.py
            row = np.frombuffer(m.data, "<f4").reshape(m.shape)[-1]
            assert out.attentions[m.layer] is None or np.allclose(row, out.attentions[m.layer][0, m.head, -1].numpy(),
                                                                  atol=3e-5)
    msgs = list(served.Generate(pb.GenerateRequest(model=family, prompt=pb.Prompt(text=TEXT), max_new_tokens=16),
                                timeout=120))
    with torch.no_grad():  # both end at the end-of-sequence id, which is sent (tiny OLMo 2 reaches it)
        want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                           max_new_tokens=16, do_sample=False,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert [m.token.id for m in msgs] == want


@pytest.mark.parametrize("family", ["smollm3", "gemma3", "cohere2", "gemma4_text"])
def test_encoding_names_each_layers_positions_as_transformers_builds_them(served, hf_zoo, family):
    """The Encoding RPC's note names, per layer, the RoPE base it rotates by or that it has none, as transformers'
    config gives each layer (the pictures are the model's own RoPE)."""
    import re

    from tests.hf.test_families_perlayer import transformers_plan

    note = served.Encoding(pb.EncodingRequest(model=family, length=8), timeout=30).note
    said = {}
    for part in note.split("; "):
        if m := re.fullmatch(r"layers? ([\d, ]+): (.*)", part):
            said.update({int(i): m.group(2) for i in m.group(1).split(", ")})
    plan = transformers_plan(hf_zoo[family]["hf"].config)
    assert sorted(said) == list(range(len(plan))), note
    for i, layer in enumerate(plan):
        if layer["encoding"] == "none":
            assert said[i] == "no positional encoding (NoPE)", note
        else:
            assert said[i].startswith(f"RoPE base {layer['base']:g}"), note
            assert ("linear x4" in said[i]) == (layer["scaling"] == "linear"), note
