"""The lab on the tiny models: Compare, Encoding, extrapolation, pictures and the HTML report (real server)."""

import json
import math
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from lab import cli, pictures, report, studies
from model.tokenizer import decode, encode
from model.variants import REGISTRY
from protos.posenc.v1 import posenc_pb2 as pb
from service.registry import Limits
from tests.model.helpers import tiny_model
from tests.serving import start

ROOT = Path(__file__).resolve().parents[2]
S = grpc.StatusCode
VARIANTS = list(REGISTRY)


def client(server, *args, timeout=120):
    """`posenc ARGS` by its module form, `python -m lab` (the console script's own function, lab.cli.main)."""
    return subprocess.run([sys.executable, "-m", "lab", "--target", f"127.0.0.1:{server.port}", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def is_picture(path: Path, min_side: int = 200) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(path))
    assert min(pixels.shape[:2]) >= min_side
    assert pixels[..., :3].std() > 0.05  # not a blank canvas


# --- Compare -------------------------------------------------------------------------------------------------


def test_compare_defaults_to_reversed_words_and_matches_predict(stub):
    resp = stub.Compare(pb.CompareRequest(prompt=pb.Prompt(text="dog bites man"), top_k=4), timeout=60)
    assert decode([t.id for t in resp.permuted_tokens]) == "man bites dog"
    assert sorted(m.model for m in resp.models) == sorted(VARIANTS)
    for m in resp.models:
        assert not m.error
        for text, top in (("dog bites man", m.top), ("man bites dog", m.permuted_top)):
            want = stub.Predict(pb.PredictRequest(model=m.model, prompt=pb.Prompt(text=text), top_k=4)).top
            assert [c.token.id for c in top] == [c.token.id for c in want]
            np.testing.assert_allclose([c.probability for c in top], [c.probability for c in want], atol=1e-6)
        assert 0 < m.total_variation <= 1 and 0 < m.js_divergence <= math.log(2) + 1e-9 and m.kl_divergence > 0
        assert m.top1_changed == (m.top[0].token.id != m.permuted_top[0].token.id)


def test_compare_of_a_prompt_with_itself_changes_nothing(stub):
    resp = stub.Compare(pb.CompareRequest(prompt=pb.Prompt(text="abc"), permuted=pb.Prompt(text="abc"),
                                          models=["rope", "alibi"]), timeout=60)
    assert [m.model for m in resp.models] == ["rope", "alibi"]
    for m in resp.models:
        assert m.total_variation < 1e-12 and abs(m.kl_divergence) < 1e-12 and not m.top1_changed


def test_compare_reports_a_model_that_cannot_take_the_prompt_and_answers_for_the_rest(stub):
    text = "the cat sat on the mat"  # 22 tokens: beyond tiny learned's 16 positions
    resp = stub.Compare(pb.CompareRequest(prompt=pb.Prompt(text=text), models=["learned", "t5"]), timeout=60)
    learned, t5 = resp.models
    assert "max_positions=16" in learned.error and not learned.top
    assert not t5.error and t5.top


def test_compare_table_with_pipes_in_its_pieces_keeps_its_columns(stub):
    """All 256 candidates per model, so '|' (and '<', '&') are among the pieces: the markdown and the HTML of the
    same Compare keep six columns in every row."""
    from html.parser import HTMLParser

    resp = stub.Compare(pb.CompareRequest(prompt=pb.Prompt(text="a|b <c> & d"), models=["rope", "alibi", "learned"],
                                          top_k=256), timeout=60)
    table = studies.compare_table(resp, k=256)
    assert any("|" in cell for row in table.rows for cell in row)
    lines = [line for line in table.markdown().splitlines() if line.startswith("|")]
    assert len(lines) == 2 + len(resp.models)
    for line in lines:  # split on the pipes that are not escaped
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        assert len(cells) == 6, line[:200]

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self.texts = [], []

        def handle_starttag(self, tag, attrs):
            if tag == "tr":
                self.rows.append(0)
            elif tag in ("td", "th"):
                self.rows[-1] += 1
                self.texts.append("")

        def handle_data(self, data):
            if self.texts:
                self.texts[-1] += data

    parsed = Cells()
    parsed.feed(table.html())
    assert parsed.rows == [6] * (1 + len(resp.models))
    assert any("|" in t for t in parsed.texts) and any("<" in t for t in parsed.texts)


@pytest.mark.parametrize("req, code, words", [
    (pb.CompareRequest(prompt=pb.Prompt(text="dog bites man"), permuted=pb.Prompt(text="cat bites man")),
     S.INVALID_ARGUMENT, "same tokens"),
    (pb.CompareRequest(prompt=pb.Prompt(text="")), S.INVALID_ARGUMENT, "empty prompt"),
    (pb.CompareRequest(prompt=pb.Prompt(text="ab"), models=["nope"]), S.NOT_FOUND, "nope"),
    (pb.CompareRequest(prompt=pb.Prompt(text="ab"), top_k=-1), S.INVALID_ARGUMENT, "top_k"),
    (pb.CompareRequest(prompt=pb.Prompt(tokens=pb.TokenIds(ids=[1, 999]))), S.INVALID_ARGUMENT, "999"),
])
def test_compare_bad_input(stub, req, code, words):
    with pytest.raises(grpc.RpcError) as err:
        stub.Compare(req, timeout=30)
    assert err.value.code() == code and words in err.value.details()
    assert stub.Compare(pb.CompareRequest(prompt=pb.Prompt(text="ok")), timeout=30).models  # still serving


# --- Encoding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoding_equals_the_pytorch_module_beyond_the_trained_context(stub, variant):
    from export.encoding import EncodingGraph

    n = 16 if variant == "learned" else 64  # tiny context is 16: 64 is 4x
    resp = stub.Encoding(pb.EncodingRequest(model=variant, length=n), timeout=30)
    got = pictures.tensors_of(resp)
    graph = EncodingGraph(tiny_model(variant).pos).eval()
    assert list(got) == graph.names
    with torch.no_grad():
        want = graph(torch.arange(n))
    for name, w in zip(graph.names, want, strict=True):
        np.testing.assert_allclose(got[name], w.numpy(), atol=1e-5)
    if variant == "none":
        assert not got and "causal mask" in resp.note


def test_encoding_properties(stub):
    n = 40
    alibi = pictures.tensors_of(stub.Encoding(pb.EncodingRequest(model="alibi", length=n)))["score_bias"]
    assert alibi.shape == (4, n, n)
    i, j = np.tril_indices(n)
    for h, slope in enumerate([0.25, 0.0625, 0.015625, 0.00390625]):  # 2^(-8/H * (h+1)) for 4 heads
        np.testing.assert_allclose(alibi[h][i, j], -slope * (i - j), atol=1e-6)
    rope = pictures.tensors_of(stub.Encoding(pb.EncodingRequest(model="rope", length=n)))
    np.testing.assert_allclose(rope["rotary_cos"] ** 2 + rope["rotary_sin"] ** 2, 1.0, atol=1e-5)
    s = rope["rotary_scores"]
    np.testing.assert_allclose(s[1:, 1:], s[:-1, :-1], atol=1e-5)  # depends only on i - j
    np.testing.assert_allclose(np.diag(s), 1.0, atol=1e-5)
    sin = pictures.tensors_of(stub.Encoding(pb.EncodingRequest(model="sinusoidal", length=n)))["position_embedding"]
    assert sin.shape == (n, 32) and np.abs(sin).max() > 0


@pytest.mark.parametrize("model, length, code, words", [
    ("learned", 17, S.INVALID_ARGUMENT, "[1, 16]"),
    ("rope", 0, S.INVALID_ARGUMENT, "length"),
    ("rope", 10**9, S.INVALID_ARGUMENT, "length"),
    ("nope", 8, S.NOT_FOUND, "nope"),
])
def test_encoding_bad_input(stub, model, length, code, words):
    with pytest.raises(grpc.RpcError) as err:
        stub.Encoding(pb.EncodingRequest(model=model, length=length), timeout=30)
    assert err.value.code() == code and words in err.value.details()


def test_encoding_limits_and_old_artifacts(tiny_artifacts, tmp_path):
    from export import artifact

    root, _ = tiny_artifacts
    for name in ("t5", "rope"):
        shutil.copytree(root / name, tmp_path / name)
    old = tmp_path / "rope"  # as exported before encoding graphs: no encoding.onnx, no "encoding" entry
    meta = json.loads((old / "model.json").read_text())
    del meta["encoding"]
    (old / "model.json").write_text(json.dumps(meta))
    (old / "encoding.onnx").unlink()
    manifest = json.loads((old / "manifest.json").read_text())
    artifact.write_manifest(old, manifest["validation"])
    srv = start(tmp_path, limits=Limits(max_message_bytes=20_000))
    try:
        from protos.posenc.v1 import posenc_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = posenc_pb2_grpc.PosencStub(ch)
            with pytest.raises(grpc.RpcError) as err:  # 4 heads x 100 x 100 floats = 160 kB
                stub.Encoding(pb.EncodingRequest(model="t5", length=100), timeout=30)
            assert err.value.code() == S.RESOURCE_EXHAUSTED and "shorter length" in err.value.details()
            assert pictures.tensors_of(stub.Encoding(pb.EncodingRequest(model="t5", length=30)))["score_bias"].size
            with pytest.raises(grpc.RpcError) as err:
                stub.Encoding(pb.EncodingRequest(model="rope", length=8), timeout=30)
            assert err.value.code() == S.FAILED_PRECONDITION and "re-export" in err.value.details()
            assert stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text="ab"))).top  # still served
    finally:
        srv.stop(grace=1)


def test_artifact_naming_an_unlisted_encoding_file_is_refused(tiny_artifacts, tmp_path):
    from export import artifact

    root, _ = tiny_artifacts
    shutil.copytree(root / "alibi", tmp_path / "alibi")
    meta = json.loads((tmp_path / "alibi" / "model.json").read_text())
    meta["encoding"]["file"] = "../t5/encoding.onnx"  # tries to leave its folder
    (tmp_path / "alibi" / "model.json").write_text(json.dumps(meta))
    artifact.write_manifest(tmp_path / "alibi", None)
    srv = start(tmp_path)
    try:
        assert not srv.registry.models and "does not list" in srv.rejected["alibi"]
    finally:
        srv.stop(grace=1)


# --- the CLI: compare, encoding, extrapolate, report ---------------------------------------------------------


def test_compare_cli(server):
    res = client(server, "compare", "dog bites man", "--model", "rope", "--model", "none")
    assert res.returncode == 0, res.stderr
    assert "'man bites dog'" in res.stdout and "| rope |" in res.stdout and "| none |" in res.stdout
    res = client(server, "compare", "dog bites man", "--permuted", "dog bites cat")
    assert res.returncode == 2 and "INVALID_ARGUMENT" in res.stderr


def test_posenc_console_script_runs_a_lab_command(server, stub, capsys):
    """The installed `posenc` entry point (what .venv/bin/posenc calls) runs compare in-process and prints the table
    of the Compare RPC; it offers the client's commands and the lab's (those `python -m client` names as the lab's)."""
    from client import cli as client_cli
    from lab import cli as lab_cli

    (entry,) = metadata.entry_points(group="console_scripts", name="posenc")
    assert entry.value == "lab.cli:main" and entry.load() is lab_cli.main
    code = entry.load()(["--target", f"127.0.0.1:{server.port}", "compare", "dog bites man", "--model", "rope",
                         "--model", "alibi", "--top-k", "3"])
    out = capsys.readouterr().out
    want = stub.Compare(pb.CompareRequest(prompt=pb.Prompt(text="dog bites man"), models=["rope", "alibi"], top_k=3))
    assert code == 0 and out == studies.compare_table(want).markdown() + "\n"
    assert lab_cli.COMMANDS == client_cli.LAB_COMMANDS
    parser = client_cli.parser(extend=lab_cli.add_commands)
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert tuple(sub.choices) == client_cli.COMMANDS + lab_cli.COMMANDS


def test_posenc_without_matplotlib_runs_the_studies_and_says_what_a_picture_needs(server, tmp_path):
    """The base install (no lab extra): compare prints its table; a picture is one line and exit status 2."""
    run = [sys.executable, "-c", "import sys, runpy; sys.modules['matplotlib'] = None; "
           "runpy.run_module('lab', run_name='__main__')", "--target", f"127.0.0.1:{server.port}"]
    res = subprocess.run([*run, "compare", "ab", "--model", "rope"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "| rope |" in res.stdout, res.stderr
    res = subprocess.run([*run, "encoding", "--model", "rope", "--png", str(tmp_path / "r.png")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.splitlines()[-1] == "error: pictures need matplotlib: pip install " \
        "'posenc[lab]'" and "Traceback" not in res.stderr and not (tmp_path / "r.png").exists()


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoding_cli_draws_every_variant(server, variant, tmp_path):
    """`posenc encoding` by the console script's own function in this process (the other tests here start it as a
    process): one interpreter and one matplotlib for every variant's picture."""
    out = tmp_path / f"{variant}.png"
    assert cli.main(["--target", f"127.0.0.1:{server.port}", "encoding", "--model", variant, "--length", "16",
                     "--png", str(out)]) == 0
    is_picture(out)


def test_extrapolate_cli_equals_scoring_the_windows_by_hand(server, stub, tmp_path):
    out, png = tmp_path / "x.json", tmp_path / "x.png"
    res = client(server, "extrapolate", "--text-bytes", "512", "--model", "rope", "--model", "learned",
                 "--model", "alibi", "--out", str(out), "--png", str(png))
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert "| rope |" in res.stdout and "n/a" in res.stdout
    assert result["factors"] == [1, 2, 4, 8] and result["text"]["text_bytes"] == 512
    assert {"date", "machine", "load"} <= set(result)  # where and when it was measured, as every results file
    learned = result["rows"]["learned"]["cells"]
    assert "perplexity" in learned["1"] and "16-position table" in learned["2"]["unavailable"]
    data, _ = studies.eval_text(512, 0)
    windows = [data[i:i + 32] for i in range(0, 512, 32)]  # rope at 2x: 16 windows of 32 bytes
    total = sum(stub.Score(pb.ScoreRequest(model="rope", prompt=pb.Prompt(tokens=pb.TokenIds(ids=w)))).total_logprob
                for w in windows)
    cell = result["rows"]["rope"]["cells"]["2"]
    assert cell["windows"] == 16 and cell["tokens"] == 16 * 31
    assert cell["perplexity"] == pytest.approx(math.exp(-total / (16 * 31)), rel=1e-4)
    is_picture(png)
    res = client(server, "extrapolate", "--text-bytes", str(10**9))
    assert res.returncode == 2 and "held-out bytes" in res.stderr


def test_eval_text_is_held_out_and_seeded():
    from model.corpus import builtin_text, heldout_cut

    full = encode(builtin_text())
    data, info = studies.eval_text(256, 0)
    assert data == full[heldout_cut(len(full)):][:256] and info["offset"] == 0
    a, info_a = studies.eval_text(256, 7)
    b, _ = studies.eval_text(256, 7)
    assert a == b and info_a["offset"] > 0 and info_a["seed"] == 7


# the report's models: a bias, an embedding with a decoding state, none at all and a rotation (each picture kind)
REPORTED = ["alibi", "cpe", "none", "rope"]


def test_report_is_one_self_contained_page_and_every_image_loads_in_chromium(server, tmp_path):
    result = tmp_path / "x.json"
    chosen = [a for m in REPORTED for a in ("--model", m)]
    assert client(server, "extrapolate", "--text-bytes", "256", "--out", str(result), *chosen).returncode == 0
    page = tmp_path / "report.html"
    hybrid = tmp_path / "hybrid.json"  # the hybrid study's results convention: its tables as data rows
    hybrid.write_text(json.dumps({"meta": {"date": "2026-11-27T00:00:00+00:00"}, "tables": {
        "perplexity_per_byte": {"columns": ["design", "1x (128)", "16x (2048)"],
                                "rows": [["all_rope", 2.5312, 7.25], ["all_nope", 2.75, None]]},
        "mass_past_context": {"columns": ["design", "layer 0"], "rows": [["all_nope", "nope: 0.125"]],
                              "note": "attention mass at distances >= 128 <the trained context>"}}}))
    res = client(server, "report", "--out", str(page), "--extrapolation", str(result), "--length", "16",
                 "--hybrid", str(hybrid), *chosen, timeout=300)
    assert res.returncode == 0, res.stderr
    body = page.read_text()
    # the plot, then an encoding and attention per model, then each model's profile heatmap
    assert body.count("<img") == 1 + 3 * len(REPORTED)
    assert [f"{m} profile" for m in sorted(REPORTED)] == re.findall(r'alt="([^"]+ profile)"', body)
    assert body.index('id="profiles"') < body.index('id="hybrid"')
    assert ("<tr><th>design</th><th>1x (128)</th><th>16x (2048)</th></tr>\n<tr><td>all_rope</td><td>2.531</td>"
            "<td>7.25</td></tr>\n<tr><td>all_nope</td><td>2.75</td><td>-</td></tr>") in body
    assert "<td>nope: 0.125</td>" in body and "&lt;the trained context&gt;" in body
    absent = report.hybrid_tables(tmp_path / "none.json")  # no results yet: one line says how to make them
    assert len(absent) == 2 and "make hybrid-study" in absent[1]
    # every study's section follows, from its results file in the checkout or with the command that makes it
    assert body.index('id="hybrid"') < body.index('id="lengthgen"') < body.index('id="passkey"')
    assert "src=\"http" not in body and "<script" not in body  # nothing fetched
    # random weights have no held-out figure: ListModels' 0 is shown as such, never as a loss of 0.000
    assert "0.000 nats/byte" not in body and body.count("held-out loss not measured") == len(REPORTED)
    # Load it in headless Chromium with a probe appended, and read back what every <img> decoded to.
    probe = tmp_path / "probe.html"
    probe.write_text(body.replace("</body>", "<script>window.onload=()=>{const r=[...document.images].map("
                                  "i=>[i.alt,i.complete,i.naturalWidth,i.naturalHeight]);"
                                  "document.body.setAttribute('data-probe',JSON.stringify(r));}</script></body>"))
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is needed for this test (make test installs Debian's chromium when run as root)"
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'chrome'}", "--virtual-time-budget=5000", "--dump-dom",
                          probe.as_uri()], capture_output=True, text=True, timeout=120)
    start = dom.stdout.index("data-probe=\"") + len("data-probe=\"")
    images = json.loads(dom.stdout[start:dom.stdout.index("\"", start)].replace("&quot;", "\""))
    assert len(images) == 1 + 3 * len(REPORTED)
    for alt, complete, width, height in images:
        assert complete and width > 100 and height > 100, alt


def test_a_studys_section_shows_each_table_of_its_results_file_under_its_title(tmp_path):
    """The report reads a study's tables as the study wrote them: a table's title (or its key), its columns and rows
    (None as "-", floats to 4 significant digits) and its note; a missing file is one line naming `make NAME`."""
    study = next(s for s in report.STUDIES if s.name == "lengthgen")
    path = tmp_path / "lengthgen.json"
    path.write_text(json.dumps({"meta": {"date": "2026-12-04T00:00:00+00:00"}, "tables": {
        "copy": {"title": "copy: accuracy by length", "columns": ["variant", "1x", "8x"],
                 "rows": [["rope", 0.98765, None]], "note": "mean of 3 seeds"},
        "reverse_accuracy": {"columns": ["variant", "1x"], "rows": [["nope", 1.0]]}}}))
    html_ = "\n".join(report.study_tables(study, path))
    assert '<h2 id="lengthgen">' in html_ and "lab/experiments/lengthgen.py" in html_ and "2026-12-04" in html_
    assert "<h3>copy: accuracy by length</h3>" in html_ and "<h3>reverse accuracy</h3>" in html_
    assert "<td>rope</td><td>0.9877</td><td>-</td>" in html_ and "mean of 3 seeds" in html_
    missing = report.study_tables(study, tmp_path / "none.json")
    assert len(missing) == 2 and "make lengthgen" in missing[1]

