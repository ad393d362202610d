"""The passkey study (lab/passkey.py, `posenc passkey`) against a real worker on a loopback port: a tiny byte RoPE
model of the lab's, and a tiny LLaMA built with transformers (random weights, max_position_embeddings 256) imported
twice, plain and with dynamic NTK scaling x4, served with --long-context 1 so the plain one answers past 256.

What is checked: the prompt is lab.tasks' passkey format; the grid has every cell; the needle's token span is the
needle (bytes exactly; BPE around it); the needle mass equals transformers' eager attention weights on the same
tokens; the scaling leaves the attention alone inside the original context and moves it past it; the OpenAI route
answers as Generate does; the CLI's bad input is one line and exit 2."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from client.api import Client
from lab import passkey
from lab.cli import main
from lab.tasks import PASSKEY_QUESTION, examples
from service.registry import Limits
from tests.serving import start

pytestmark = pytest.mark.xdist_group("passkey")  # one worker imports the two models once (make test)

CONTEXT = 256  # the LLaMA's max_position_embeddings
INSIDE, PAST = 240, 480  # prompt lengths (tokens) inside and past it
DEPTHS = (0.0, 0.5, 1.0)
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_artifact):
    """(client, server, the transformers LLaMA, its tokenizers.Tokenizer)."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer

    from export.hf import import_artifact
    from tests.conftest import torch_threads
    from tests.hf.helpers import perturb, tokenizer_json

    root = tmp_path_factory.mktemp("passkey")
    shutil.copytree(tiny_artifact("rope")[0], root / "artifacts" / "rope")  # the run's tiny byte-level model
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=CONTEXT,
                            rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    hf = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()  # it returns weights
    perturb(hf, 0, scale=0.5)  # attention far from uniform
    hf.save_pretrained(root / "hf", safe_serialization=True)
    tok = Tokenizer.from_str(tokenizer_json())
    tf.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(root / "hf")
    import_artifact(root / "hf", root / "artifacts" / "llama", validation_max_length=8, interventions=False)
    import_artifact(root / "hf", root / "artifacts" / "llama-dynamic", validation_max_length=8, rope_scaling=DYNAMIC,
                    interventions=False)
    torch.set_num_threads(torch_threads())
    srv = start(root / "artifacts", http_port=0, limits=Limits(long_context=True))
    with Client(f"127.0.0.1:{srv.port}", timeout=120) as client:
        yield client, srv, hf, tok
    srv.stop(grace=1)


@pytest.fixture(scope="module")
def grid(served):
    """The imported pair over (INSIDE, PAST) x DEPTHS, two examples a cell, through Generate."""
    client = served[0]
    return passkey.study(client, ["llama", "llama-dynamic"], [INSIDE, PAST], DEPTHS, n=2, seed=1)


def cells_of(result: dict, model: str) -> dict[tuple[int, float], dict]:
    return {(c["length"], c["depth"]): c for c in result["models"][model]["cells"]}


def test_prompt_is_the_tasks_format():
    """pieces() joined is lab.tasks.passkey's prompt for the same key, sentences and needle position."""
    for length in (2, 7, 16):
        for e in examples("passkey", length, 6, seed=3):
            at = round(e.depth * length)
            before, needle, after = passkey.pieces(int(e.answer), length, at)
            assert before + needle + after == e.prompt
            assert needle.startswith("The pass key is ") and needle.count(e.answer) == 2
    assert passkey.place(0.0, 10) == 0 and passkey.place(1.0, 10) == 10 and passkey.place(0.25, 10) == 3


def test_control_span():
    span = passkey.control_span((40, 50), (10, 110))
    assert span is not None and span[1] - span[0] == 10 and (span[1] <= 40 or span[0] >= 50)
    assert 10 <= span[0] and span[1] <= 110
    assert passkey.control_span((12, 20), (1, 25)) == (1, 9)  # the room before the needle, farthest back
    assert passkey.control_span((10, 20), (10, 25)) is None  # no room for ten tokens beside the needle


def test_byte_model_grid_end_to_end(served):
    """(a) Every cell of the grid, each example's needle span exactly the needle's bytes, the control span as wide,
    apart from it, after the first token and before the question."""
    client = served[0]
    lengths = [300, 420]
    result = passkey.study(client, ["rope"], lengths, passkey.DEPTHS, n=2, seed=0)
    json.dumps(result)  # JSON as it is
    row = result["models"]["rope"]
    cells = cells_of(result, "rope")
    assert len(row["cells"]) == len(cells) == len(lengths) * len(passkey.DEPTHS)
    assert set(cells) == {(x, d) for x in lengths for d in passkey.DEPTHS}
    assert cells[(300, 0.0)]["sentences"] < cells[(420, 0.0)]["sentences"]
    for (length, depth), cell in cells.items():
        assert "unavailable" not in cell and cell["tokens"] <= length
        assert cell["at"] == passkey.place(depth, cell["sentences"])
        assert cell["accuracy"] in (0.0, 0.5, 1.0) and len(cell["examples"]) == 2
        assert len(cell["needle_mass"]) == row["layers"] == 2
        for e in cell["examples"]:
            before, needle, after = passkey.pieces(e["key"], cell["sentences"], cell["at"])
            text = (before + needle + after).encode()
            s, t = e["needle"]
            assert text[s:t] == needle.encode() and e["tokens"] == len(text)
            c0, c1 = e["control"]
            assert c1 - c0 == t - s and (c1 <= s or c0 >= t)
            assert 1 <= c0 and c1 <= len(text) - len(PASSKEY_QUESTION) - 1
            assert all(0 <= m <= 1 for m in e["needle_mass"] + e["control_mass"])
    # its own context (16 bytes) sets the default lengths, all shorter than the shortest prompt
    short = passkey.study(client, ["rope"], None, [0.5], n=1)["models"]["rope"]
    assert short["lengths"] == [4, 8, 16, 32]
    assert all("shorter than the prompt with one filler sentence" in c["unavailable"] for c in short["cells"])


def test_needle_mass_equals_transformers(served, grid):
    """(b) One cell's needle and control masses, per example and layer, from transformers' eager attention weights
    (output_attentions) on the same tokens."""
    import torch

    client, _, hf, tok = served
    cell = cells_of(grid, "llama")[(PAST, 0.5)]
    for e in cell["examples"]:
        before, needle, after = passkey.pieces(e["key"], cell["sentences"], cell["at"])
        ids = tok.encode(before + needle + after).ids
        assert ids == [t.id for t in client.tokenize("llama", before + needle + after).tokens]
        assert len(ids) == e["tokens"]
        s, t = e["needle"]  # the needle, and at most a token merged across either boundary
        assert needle in tok.decode(ids[s:t]) and t - s <= len(tok.encode(needle).ids) + 2
        with torch.no_grad():
            maps = hf(torch.tensor([ids]), output_attentions=True).attentions
        for key, span in (("needle_mass", e["needle"]), ("control_mass", e["control"])):
            want = [float(a[0, :, -1, span[0]:span[1]].double().sum(-1).mean()) for a in maps]
            np.testing.assert_allclose(e[key], want, rtol=0, atol=3e-5)
    assert cell["needle_mass"] == pytest.approx(np.mean([e["needle_mass"] for e in cell["examples"]], axis=0),
                                                abs=1e-6)


def test_scaling_moves_attention_past_the_context_only(grid):
    """(c) The plain import past its context and the dynamic-NTK one, both measured in every cell: inside the
    original 256 positions dynamic NTK is the plain RoPE, so the needle masses agree; past it they differ."""
    plain, scaled = cells_of(grid, "llama"), cells_of(grid, "llama-dynamic")
    assert set(plain) == set(scaled) == {(x, d) for x in (INSIDE, PAST) for d in DEPTHS}
    for where, a in plain.items():
        b = scaled[where]
        assert "unavailable" not in a and "unavailable" not in b
        assert [e["key"] for e in a["examples"]] == [e["key"] for e in b["examples"]]
        gap = max(abs(x - y) for ea, eb in zip(a["examples"], b["examples"], strict=True)
                  for x, y in zip(ea["needle_mass"] + ea["control_mass"], eb["needle_mass"] + eb["control_mass"],
                                  strict=True))
        if where[0] == INSIDE:
            assert max(e["tokens"] for e in a["examples"]) <= CONTEXT and gap < 1e-5, where
        else:
            assert min(e["tokens"] for e in a["examples"]) > CONTEXT and gap > 1e-3, where


def test_openai_route_answers_as_generate(served, grid):
    """--api openai: the same keys and tokens, the same greedy continuations and masses as through Generate."""
    client, srv = served[:2]
    result = passkey.study(client, ["llama"], [INSIDE], [0.5], n=2, seed=1, api="openai",
                           url=f"http://127.0.0.1:{srv.http_port}")
    got, want = cells_of(result, "llama")[(INSIDE, 0.5)], cells_of(grid, "llama")[(INSIDE, 0.5)]
    assert result["api"] == "openai"
    assert [e["continuation"] for e in got["examples"]] == [e["continuation"] for e in want["examples"]]
    assert all(e["continuation"] for e in got["examples"])
    assert got["needle_mass"] == want["needle_mass"] and got["accuracy"] == want["accuracy"]


def test_cli_writes_json_and_picture(served, tmp_path, capsys):
    srv = served[1]
    code = main(["--target", f"127.0.0.1:{srv.port}", "passkey", "--model", "llama", "--lengths", str(INSIDE),
                 "--depths", "0", "1", "--n", "1", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| depth | 240 |" in out and out.count("\n| ") >= 3
    result = json.loads((tmp_path / "passkey.json").read_text())
    assert len(result["models"]["llama"]["cells"]) == 2
    assert (tmp_path / "passkey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, says", [
    (["--depths", "1.5"], "must be from 0 to 1"),
    (["--lengths", "0"], "must be > 0"),
    (["--n", "0"], "must be > 0"),
    (["--seed", "-1"], "must be >= 0"),
    (["--api", "openai"], "--api openai needs --url"),
    (["--url", "http://127.0.0.1:1"], "--api openai needs --url"),
    (["--depths", "0.5", "0.5"], "depths must be distinct"),
    (["--lengths", "300", "300"], "lengths must be distinct"),
    (["--model", "nosuch"], "unknown model(s) nosuch"),
])
def test_cli_refuses_bad_input(served, capsys, args, says):
    """(d) One line on stderr, exit status 2, nothing run."""
    srv = served[1]
    model = [] if "--model" in args else ["--model", "llama"]
    try:
        code = main(["--target", f"127.0.0.1:{srv.port}", "passkey", *model, *args])
    except SystemExit as exit:  # the parser's own refusals
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_committed_study_backs_its_page(tmp_path):
    """bench/results/passkey.json (make passkey): every cell of the imported models measured, dynamic NTK equal to the
    plain model inside its 256 positions and apart past them (what docs/passkey.md says), and the picture drawn from
    the JSON alone."""
    from lab.experiments.passkey import CONTEXT as STUDY_CONTEXT
    from lab.experiments.passkey import LENGTHS, RESULTS
    from lab.experiments.passkey import main as experiment

    doc = json.loads(RESULTS.read_text())
    study = doc["study"]
    for name in ("llama", "llama-dynamic4", "llama-yarn4"):
        cells = cells_of(study, name)
        assert set(cells) == {(x, d) for x in LENGTHS for d in study["depths"]}
        assert not any("unavailable" in c for c in cells.values())
        assert name in doc["tables"] and len(doc["tables"][name]["rows"]) == len(study["depths"])
    plain, dynamic = cells_of(study, "llama"), cells_of(study, "llama-dynamic4")
    for (length, depth), cell in plain.items():
        gap = np.max(np.abs(np.subtract(cell["needle_mass"], dynamic[(length, depth)]["needle_mass"])))
        assert (gap < 1e-5) if length <= STUDY_CONTEXT else (gap > 1e-3), (length, depth)
    assert experiment(["--out", str(RESULTS), "--plot", str(tmp_path / "p.png"), "--plot-only"]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
