"""KServe v2 under a position intervention, driven by tritonclient over gRPC and HTTP (its own process:
tests/service/tritonclient_intervene.py) against a real worker on loopback ports: position_ids per token and the
intervention parameters.  A left-padded batch whose rows carry different positions equals each row sent alone;
position_ids 0 .. T-1 equal the plain request (the exact graph, no intervention); a shift leaves a RoPE model's
logits as they were (its attention is relative) and changes a learned table's; bad input is refused, naming it."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service.registry import Limits
from tests.serving import start

ROOT = Path(__file__).resolve().parents[2]
TRANSPORTS = ("grpc", "http")
IDS = [[0, 0, 0, 72, 101, 108], [100, 111, 103, 32, 98, 105]]
MASK = [[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
POSITIONS = [[999, 999, 999, 3, 4, 9], [0, 2, 4, 6, 8, 10]]  # the pad slots' 999 is ignored, past a table too
PLAIN = [[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]]  # what each row counts itself
COUNTED = ("rope", "learned", "alibi", "t5", "sinusoidal", "fire")
BATCHED = ("rope", "learned", "alibi", "t5")
EDITS = {"switch": {"positional_off": "1", "ablate_heads": "0.1,1.3"}, "shift": {"shift": 7},
         "stretch": {"stretch": 2.0}}


def request(model, ids, mask=None, positions=None, outputs=(), parameters=None, dtype="INT64"):
    inputs = {"input_ids": [ids, "INT64"]}
    if mask is not None:
        inputs["attention_mask"] = [mask, "INT64"]
    if positions is not None:
        inputs["position_ids"] = [positions, dtype]
    return {"model": model, "inputs": inputs, "outputs": list(outputs), "parameters": parameters or {}}


def requests():
    out = {}
    for m in BATCHED:  # a batch of two rows at their own positions, and each row alone
        out[f"batch/{m}"] = request(m, IDS, MASK, POSITIONS)
        for b in range(2):
            real = [i for i, k in enumerate(MASK[b]) if k]
            out[f"alone{b}/{m}"] = request(m, [[IDS[b][i] for i in real]], positions=[[POSITIONS[b][i] for i in real]])
    for m in COUNTED:  # the positions each row counts itself, given explicitly, against the plain request
        out[f"counted/{m}"] = request(m, IDS, MASK, PLAIN)
        out[f"plain/{m}"] = request(m, IDS, MASK)
    for m in ("rope", "learned"):  # a uniform shift: by parameter, and by position_ids
        out[f"shift/{m}"] = request(m, IDS, MASK, parameters={"shift": 7}, outputs=["logits"])
        out[f"shifted_ids/{m}"] = request(m, IDS, MASK, [[p + 5 for p in row] for row in PLAIN], outputs=["logits"])
    for name, params in EDITS.items():  # parameters on a batch, and on each row alone
        out[f"edit_{name}/batch"] = request("alibi", IDS, MASK, parameters=params,
                                            outputs=["logits", "attentions", "profile"])
        for b in range(2):
            real = [i for i, k in enumerate(MASK[b]) if k]
            out[f"edit_{name}/alone{b}"] = request("alibi", [[IDS[b][i] for i in real]], parameters=params,
                                                   outputs=["logits", "attentions", "profile"])
    out["profile_last/batch"] = request("rope", IDS, MASK, POSITIONS, ["profile"], {"profile_last": 2})
    out["profile_last/alone0"] = request("rope", [IDS[0][3:]], positions=[POSITIONS[0][3:]], outputs=["profile"],
                                         parameters={"profile_last": 2})
    out["plain_profile/rope"] = request("rope", IDS, MASK, outputs=["profile"], parameters={"profile_last": 2})
    out["counted_profile/rope"] = request("rope", IDS, MASK, PLAIN, ["profile"], {"profile_last": 2})
    out.update({f"bad/{k}": v for k, v in BAD.items()})
    return out


BAD = {  # each refused with INVALID_ARGUMENT / 400 and a message naming the field
    "shape": request("rope", [[1, 2, 3]], positions=[[0, 1]]),
    "dtype": request("rope", [[1, 2, 3]], positions=[[0, 1, 2]], dtype="FP32"),
    "rank": request("rope", [[1, 2, 3]], positions=[[[0, 1, 2]]]),
    "negative": request("rope", [[1, 2, 3]], positions=[[0, -1, 2]]),
    "past": request("learned", [[1, 2, 3]], positions=[[0, 1, 16]]),
    "past_shift": request("learned", [[1, 2, 3]], parameters={"shift": 14}),
    "layer": request("rope", [[1, 2, 3]], parameters={"positional_off": "0,2"}),
    "head": request("rope", [[1, 2, 3]], parameters={"ablate_heads": "0.4"}),
    "head_text": request("rope", [[1, 2, 3]], parameters={"ablate_heads": "0,1"}),
    "no_positions": request("cpe", [[1, 2, 3]], positions=[[0, 1, 2]]),
    "embeddings": request("learned", [[1, 2, 3]], parameters={"positional_off": 0}),
    "scaling": request("learned", [[1, 2, 3]], parameters={"rope_scaling": '{"rope_type": "linear", "factor": 2}'}),
    "scaling_json": request("rope", [[1, 2, 3]], parameters={"rope_scaling": "{linear"}),
    "both": request("rope", [[1, 2, 3]], positions=[[0, 1, 2]], parameters={"shift": 1}),
    "stretch": request("rope", [[1, 2, 3]], parameters={"stretch": "wide"}),
}
WORDS = {"shape": ("position_ids", "shape"), "dtype": ("position_ids", "INT64"),
         "rank": ("position_ids", "[batch, seq]"), "negative": ("position_ids", "negative"),
         "past": ("position_ids", "16 positions"),
         "past_shift": ("shift", "16 positions"), "layer": ("positional_off", "layer 2"),
         "head": ("ablate_heads", "head 4"), "head_text": ("ablate_heads", "pair"),
         "no_positions": ("position_ids", "cpe"), "embeddings": ("positional_off", "learned"),
         "scaling": ("rope_scaling", "learned"), "scaling_json": ("rope_scaling", "JSON"),
         "both": ("position_ids", "shift"), "stretch": ("stretch", "number")}


@pytest.fixture(scope="module")
def answers(tiny_artifacts, tmp_path_factory):
    """(the summary, {transport/key/output: array}) of every request over both transports."""
    root, _ = tiny_artifacts
    srv = start(root, http_port=0, max_batch=8, max_wait_ms=5.0, limits=Limits(max_prompt_tokens=200))
    folder = tmp_path_factory.mktemp("kserve-intervene")
    (folder / "requests.json").write_text(json.dumps(requests()))
    try:
        res = subprocess.run([sys.executable, str(ROOT / "tests" / "service" / "tritonclient_intervene.py"),
                              f"127.0.0.1:{srv.port}", f"127.0.0.1:{srv.http_port}", str(folder / "requests.json"),
                              str(folder / "out.npz")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    finally:
        srv.stop(grace=1)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), dict(np.load(folder / "out.npz"))


def real_rows(b):
    return np.flatnonzero(np.asarray(MASK[b]))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("model", BATCHED)
def test_rows_at_their_own_positions_equal_each_row_alone(answers, transport, model):
    summary, got = answers
    logits, att = got[f"{transport}/batch/{model}/logits"], got[f"{transport}/batch/{model}/attentions"]
    assert logits.shape == (2, 6, 256) and att.shape == (2, 2, 4, 6, 6)
    for b in range(2):
        r = real_rows(b)
        alone = f"{transport}/alone{b}/{model}"
        np.testing.assert_allclose(logits[b, r], got[f"{alone}/logits"][0], atol=1e-5)
        np.testing.assert_allclose(att[b][:, :, r][..., r], got[f"{alone}/attentions"][0], atol=3e-6)
    assert not logits[0, :3].any() and not att[0][:, :, :3].any() and not att[0][..., :3].any()  # padding: zero
    plain = got[f"{transport}/plain/{model}/logits"]
    assert np.abs(logits[1] - plain[1]).max() > 1e-3  # the positions made a difference


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("model", COUNTED)
def test_position_ids_counted_from_zero_equal_the_plain_request(answers, transport, model):
    _, got = answers
    for output, atol in (("logits", 1e-5), ("attentions", 3e-6)):
        np.testing.assert_allclose(got[f"{transport}/counted/{model}/{output}"],
                                   got[f"{transport}/plain/{model}/{output}"], atol=atol)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_shift_leaves_rope_as_it_was_and_moves_a_learned_table(answers, transport):
    _, got = answers
    for key in ("shift", "shifted_ids"):
        rope = got[f"{transport}/{key}/rope/logits"]
        np.testing.assert_allclose(rope, got[f"{transport}/plain/rope/logits"], atol=1e-4)
        learned = got[f"{transport}/{key}/learned/logits"]
        real = np.asarray(MASK, bool)
        assert np.abs(learned[real] - got[f"{transport}/plain/learned/logits"][real]).max() > 1e-2


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("edit", EDITS)
def test_parameters_apply_to_every_row_alike(answers, transport, edit):
    """A batch under the parameters equals each row alone under them (logits, maps, profile), and they change the
    answer: a switch and an ablation change ALiBi's maps, a shift does not (its bias is relative), a stretch does."""
    _, got = answers
    batch = {o: got[f"{transport}/edit_{edit}/batch/{o}"] for o in ("logits", "attentions", "profile")}
    for b in range(2):
        r = real_rows(b)
        alone = {o: got[f"{transport}/edit_{edit}/alone{b}/{o}"][0] for o in batch}
        np.testing.assert_allclose(batch["logits"][b, r], alone["logits"], atol=1e-5)
        np.testing.assert_allclose(batch["attentions"][b][:, :, r][..., r], alone["attentions"], atol=3e-6)
        np.testing.assert_allclose(batch["profile"][b], alone["profile"], atol=3e-6)
    change = np.abs(batch["attentions"] - got[f"{transport}/plain/alibi/attentions"]).max()
    assert (change < 1e-5) if edit == "shift" else (change > 1e-3)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_profile_under_positions(answers, transport):
    _, got = answers
    batch = got[f"{transport}/profile_last/batch/profile"]
    assert batch.shape == (2, 2, 4, got[f"{transport}/plain_profile/rope/profile"].shape[-1])
    np.testing.assert_allclose(batch[0], got[f"{transport}/profile_last/alone0/profile"][0], atol=3e-6)
    np.testing.assert_allclose(got[f"{transport}/counted_profile/rope/profile"],
                               got[f"{transport}/plain_profile/rope/profile"], atol=3e-6)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("key", BAD)
def test_bad_input_is_refused_naming_the_field(answers, transport, key):
    summary, _ = answers
    status, message = summary[f"{transport}/bad/{key}"]["error"]
    assert status == ("StatusCode.INVALID_ARGUMENT" if transport == "grpc" else "400"), message
    for word in WORDS[key]:
        assert word in message, message


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_metadata_lists_position_ids_where_the_graph_takes_positions(answers, transport):
    meta = answers[0][f"{transport}/metadata"]
    assert meta["rope"] == meta["learned"] == ["input_ids", "attention_mask", "position_ids"]
    assert meta["cpe"] == ["input_ids", "attention_mask"]
