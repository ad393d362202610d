"""The client and the lab on imported models beside a byte model: Tokenize with the model's own tokenizer, the
extrapolation study in each model's tokens on one per-byte scale (checked against transformers on the same
windows), and the order-sensitivity table's prompts shown as text whatever the tokenizer."""

import json
import math
import shutil
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from client.api import Client
from lab import studies
from service.settings import Limits
from tests.serving import start

TEXT = "Positions: the quick brown fox — 中文 🙂 jumps."
FACTORS = (1, 2)


@pytest.fixture(scope="module")
def mixed(hf_families, tiny_artifacts, tmp_path_factory):
    """gpt2 and llama imported (Hugging Face tokenizers) beside the tiny byte-level rope model."""
    models = tmp_path_factory.mktemp("mixed")
    hf_families.prefetch(["gpt2", "llama"])
    for family in ("gpt2", "llama"):
        shutil.copytree(hf_families[family]["artifact"], models / family)
    shutil.copytree(tiny_artifacts[0] / "rope", models / "rope")
    # The study runs windows past an imported model's own max_position_embeddings: a choice the worker must be told.
    srv = start(models, http_port=0, limits=Limits(long_context=True))
    client = Client(f"127.0.0.1:{srv.port}", timeout=120)
    yield srv, client
    client.close()
    srv.stop(grace=1)


def test_tokenize_uses_each_models_tokenizer_over_grpc_and_http(mixed, hf_families):
    srv, client = mixed
    want = Tokenizer.from_file(str(hf_families["gpt2"]["folder"] / "tokenizer.json")).encode(TEXT).ids
    resp = client.tokenize("gpt2", TEXT)
    assert [t.id for t in resp.tokens] == want and resp.tokenizer == "huggingface-tokenizers"
    assert resp.text_bytes == len(TEXT.encode())
    byte = client.tokenize("rope", TEXT)
    assert [t.id for t in byte.tokens] == list(TEXT.encode()) and byte.tokenizer == "bytes-utf8"
    # longer than any model's positions: Tokenize runs no model, so no position limit applies
    assert len(client.tokenize("rope", "x" * 5000).tokens) == 5000
    req = urllib.request.Request(f"http://127.0.0.1:{srv.http_port}/v1/posenc/tokenize", method="POST",
                                 data=json.dumps({"model": "gpt2", "text": TEXT}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        doc = json.load(r)
    assert [t["id"] for t in doc["tokens"]] == want
    with pytest.raises(grpc.RpcError) as err:
        client.tokenize("no-such-model", TEXT)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def reference_per_byte(hf, tok: Tokenizer, ids: list[int], length: int) -> float:
    """transformers' loss over non-overlapping windows of `length` tokens, per UTF-8 byte of the scored tokens."""
    total, nbytes = 0.0, 0
    for i in range(0, len(ids) - length + 1, length):
        w = ids[i:i + length]
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([w])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        total += float(logp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum())
        nbytes += len(tok.decode(w[1:], skip_special_tokens=False).encode())
    return -total / nbytes


def test_extrapolation_study_scores_each_model_in_its_own_tokens(mixed, hf_families):
    srv, client = mixed
    result = studies.extrapolate(client.stub, ["gpt2", "llama", "rope"], FACTORS, text_bytes=3000)
    text = studies.eval_text(3000, 0)[0]
    for family in ("gpt2", "llama"):
        f = hf_families[family]
        tok = Tokenizer.from_file(str(f["folder"] / "tokenizer.json"))
        ids = tok.encode(bytes(text).decode("utf-8", errors="ignore")).ids
        row = result["rows"][family]
        cell = row["cells"]["1"]
        assert cell["tokens"] == (len(ids) // row["trained_context"]) * (row["trained_context"] - 1)
        want = reference_per_byte(f["hf"], tok, ids, row["trained_context"])
        assert math.isclose(cell["nats_per_byte"], want, rel_tol=1e-4), (family, cell, want)
        assert math.isclose(cell["perplexity_per_byte"], math.exp(want), rel_tol=1e-3)
        assert cell["nats_per_token"] > cell["nats_per_byte"]  # a BPE token spans more than one byte
    assert "unavailable" in result["rows"]["gpt2"]["cells"]["2"]  # a learned table ends at its context
    byte_cell = result["rows"]["rope"]["cells"]["1"]
    assert math.isclose(byte_cell["nats_per_byte"], byte_cell["nats_per_token"], rel_tol=1e-6)
    table = studies.extrapolation_table(result).markdown()
    assert f"{result['rows']['llama']['cells']['1']['perplexity_per_byte']:.2f}" in table


def test_compare_table_shows_the_prompt_as_text_for_any_tokenizer(mixed):
    _, client = mixed
    for models in (["gpt2", "llama"], ["rope", "gpt2"]):
        resp = client.compare("dog bites man", None, models, 3)
        assert all(not m.error for m in resp.models), resp
        intro = studies.compare_table(resp).intro[0]
        assert "'dog bites man'" in intro and "'man bites dog'" in intro, intro


def test_lab_cli_extrapolate_on_imported_models(mixed, tmp_path):
    srv, _ = mixed
    out = tmp_path / "ext.json"
    run = subprocess.run([sys.executable, "-m", "lab", "--target", f"127.0.0.1:{srv.port}", "extrapolate",
                          "--model", "llama", "--factors", "1", "2", "--text-bytes", "2000", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    cells = doc["rows"]["llama"]["cells"]
    assert cells["1"]["perplexity_per_byte"] > 1 and cells["2"]["perplexity_per_byte"] > 1
    assert np.isfinite([cells[k]["nats_per_byte"] for k in ("1", "2")]).all()


def test_client_cli_tokenize_and_predict_on_an_imported_model(mixed, hf_families):
    srv, _ = mixed
    tok = Tokenizer.from_file(str(hf_families["gpt2"]["folder"] / "tokenizer.json"))
    want = tok.encode(TEXT).ids

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "client", "--target", f"127.0.0.1:{srv.port}", *args],
                              capture_output=True, text=True, timeout=120)

    run = cli("--json", "tokenize", "--model", "gpt2", TEXT)
    assert run.returncode == 0, run.stderr
    assert [t["id"] for t in json.loads(run.stdout)["tokens"]] == want
    run = cli("tokenize", "--model", "gpt2", TEXT)
    assert run.returncode == 0 and f"{len(want)} tokens (huggingface-tokenizers" in run.stdout
    run = cli("--json", "predict", "--model", "gpt2", TEXT, "--top-k", "3")
    assert run.returncode == 0, run.stderr
    assert [t["id"] for t in json.loads(run.stdout)["tokens"]] == want
    run = cli("tokenize", "--model", "nope", TEXT)
    assert run.returncode == 2 and "NOT_FOUND" in run.stderr and len(run.stderr.strip().splitlines()) == 1
