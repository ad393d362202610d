"""Attention sinks in the served maps: a gpt-oss model's maps are the probabilities over the prompt's keys, and the
mass each head's sink took is reported beside them (AttentionMap.sink_mass, per query row), over gRPC and the JSON
API.  The reference is the sink column transformers' eager attention computes and then drops (recorded from its
softmax), and the maps are transformers' attention weights; a model without sinks reports none."""

from __future__ import annotations

import base64
import shutil

import grpc
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.http.conftest import Http
from tests.http.test_viewer import browser, wait_for  # noqa: F401  (browser: the fixture, a real Chromium)
from tests.serving import start

TEXT = "def window(x): return x[-7:]  # sinks take what the keys leave"


@pytest.fixture(scope="module")
def served(hf_zoo, tmp_path_factory):
    models = tmp_path_factory.mktemp("served-sinks")
    for family in ("gpt_oss", "ministral"):
        shutil.copytree(hf_zoo[family]["artifact"], models / family)
    srv = start(models, http_port=0)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield srv, posenc_pb2_grpc.PosencStub(ch)
    ch.close()
    srv.stop(grace=1)


class SinkColumns:
    """Stands in for torch.nn.functional inside transformers' gpt_oss module: every call passes through, and each
    softmax's last column (the sink's, which eager_attention_forward drops after the softmax) is kept."""

    def __init__(self):
        self.columns = []

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    def softmax(self, x, *args, **kwargs):
        probs = torch.nn.functional.softmax(x, *args, **kwargs)
        self.columns.append(probs[..., -1])
        return probs


def transformers_sinks(hf, ids, monkeypatch):
    """(attention weights per layer, sink column per layer), each (heads, queries, ...) for one prompt."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    record = SinkColumns()
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(modeling_gpt_oss, "F", record)
        out = hf(input_ids=torch.tensor([ids]), output_attentions=True)
    assert len(record.columns) == hf.config.num_hidden_layers
    return [a[0].numpy() for a in out.attentions], [c[0].numpy() for c in record.columns]


def test_served_sink_mass_is_what_the_sink_took_in_transformers(served, hf_zoo, monkeypatch):
    _, stub = served
    entry = hf_zoo["gpt_oss"]
    ids = Tokenizer.from_file(str(entry["folder"] / "tokenizer.json")).encode(TEXT).ids
    maps, sinks = transformers_sinks(entry["hf"], ids, monkeypatch)
    resp = stub.Predict(pb.PredictRequest(model="gpt_oss", prompt=pb.Prompt(text=TEXT), attention=pb.ATTENTION_FULL),
                        timeout=60)
    cfg = entry["hf"].config
    assert len(resp.attention) == cfg.num_hidden_layers * cfg.num_attention_heads
    for m in resp.attention:
        rows = np.frombuffer(m.data, "<f4").reshape(m.shape)
        mass = np.array(m.sink_mass)
        assert mass.shape == (len(ids),)
        assert np.allclose(rows, maps[m.layer][m.head], atol=3e-5)
        assert np.allclose(mass, sinks[m.layer][m.head], atol=3e-5)
        assert np.allclose(mass, 1 - rows.astype(np.float64).sum(-1), atol=1e-6)
    masses = np.array([m.sink_mass for m in resp.attention])
    assert masses.max() > 0.5 and masses.min() < 0.05  # the tiny model's sinks take much and little


def test_sink_mass_of_a_window_and_the_last_row(served, hf_zoo, monkeypatch):
    _, stub = served
    entry = hf_zoo["gpt_oss"]
    ids = Tokenizer.from_file(str(entry["folder"] / "tokenizer.json")).encode(TEXT).ids
    _, sinks = transformers_sinks(entry["hf"], ids, monkeypatch)
    window = stub.Predict(pb.PredictRequest(model="gpt_oss", prompt=pb.Prompt(text=TEXT), attention=pb.ATTENTION_FULL,
                                            layers=[1], heads=[2], query_start=3, query_count=4), timeout=60)
    (m,) = window.attention
    assert np.allclose(m.sink_mass, sinks[1][2][3:7], atol=3e-5)
    last = stub.Predict(pb.PredictRequest(model="gpt_oss", prompt=pb.Prompt(text=TEXT),
                                          attention=pb.ATTENTION_LAST_ROW), timeout=60)
    for m in last.attention:
        assert np.allclose(m.sink_mass, sinks[m.layer][m.head][-1:], atol=3e-5)


def test_json_api_reports_the_same_sink_mass(served):
    srv, stub = served
    want = stub.Predict(pb.PredictRequest(model="gpt_oss", prompt=pb.Prompt(text=TEXT), attention=pb.ATTENTION_FULL,
                                          layers=[0]), timeout=60)
    status, doc = Http(srv.http_port).json("POST", "/v1/posenc/predict", {
        "model": "gpt_oss", "prompt": {"text": TEXT}, "attention": "ATTENTION_FULL", "layers": [0]})
    assert status == 200, doc
    assert len(doc["attention"]) == len(want.attention)
    for got, m in zip(doc["attention"], want.attention, strict=True):
        assert (got["layer"], got["head"]) == (m.layer, m.head)
        assert np.allclose(got["sink_mass"], m.sink_mass, atol=1e-7)
        rows = np.frombuffer(base64.b64decode(got["data"]), "<f4").reshape(got["shape"])
        assert np.allclose(got["sink_mass"], 1 - rows.astype(np.float64).sum(-1), atol=1e-6)


def test_a_model_without_sinks_reports_none(served):
    _, stub = served
    resp = stub.Predict(pb.PredictRequest(model="ministral", prompt=pb.Prompt(text=TEXT),
                                          attention=pb.ATTENTION_FULL), timeout=60)
    assert resp.attention and all(len(m.sink_mass) == 0 for m in resp.attention)


def test_the_viewer_shows_the_sink_mass_and_the_note(served, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    srv, stub = served
    browser.get(f"http://127.0.0.1:{srv.http_port}/")
    wait_for(browser, 'body[data-state="ready"]', timeout=10)
    field = browser.find_element(By.ID, "prompt")
    field.clear()
    field.send_keys(TEXT)
    browser.find_element(By.ID, "run").click()
    wait_for(browser, 'body[data-state="done"]', timeout=15)
    panels = {p.get_attribute("data-model"): p for p in browser.find_elements(By.CSS_SELECTOR, ".panel")}
    out = panels["gpt_oss"].find_element(By.CSS_SELECTOR, "output.attention-row")
    layer, head, query = (int(out.get_attribute(f"data-{k}")) for k in ("layer", "head", "query"))
    want = stub.Predict(pb.PredictRequest(model="gpt_oss", prompt=pb.Prompt(text=TEXT), attention=pb.ATTENTION_FULL,
                                          layers=[layer], heads=[head]), timeout=60).attention[0]
    assert float(out.get_attribute("data-sink")) == pytest.approx(want.sink_mass[query], abs=1e-7)
    assert f"sink took {100 * want.sink_mass[query]:.1f}%" in out.text
    from selenium.webdriver.support.ui import WebDriverWait

    note = panels["gpt_oss"].find_element(By.CSS_SELECTOR, ".note")
    WebDriverWait(browser, 10).until(lambda _: note.text)  # the Encoding RPC's answer
    assert "attention sinks in every layer" in note.text
    assert panels["ministral"].find_element(By.CSS_SELECTOR, "output.attention-row").get_attribute("data-sink") is None
