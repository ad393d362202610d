"""`posenc profile`: the table of each layer's heads averaged (the served Profile's values), the layer x distance
heatmap as a PNG, and a bad row count as one line and exit status 2."""

from __future__ import annotations

import numpy as np

from protos.posenc.v1 import posenc_pb2 as pb
from tests.lab.test_lab import client, is_picture

TEXT = "The built-in function len() returns the number of items of a sequence."


def test_profile_prints_each_layers_heads_averaged_and_draws_the_heatmap(server, stub, tmp_path):
    res = client(server, "profile", "--model", "rope", TEXT, "--last", "8", "--png", str(tmp_path / "p.png"))
    assert res.returncode == 0, res.stderr
    want = stub.Profile(pb.ProfileRequest(model="rope", prompt=pb.Prompt(text=TEXT), last=8))
    lines = res.stdout.splitlines()
    assert lines[1].split() == ["layer", *want.columns]
    shown = np.array([[float(v) for v in line.split()[1:]] for line in lines[2:]])
    means = np.frombuffer(want.values, "<f4").reshape(want.shape).mean(axis=1)
    np.testing.assert_allclose(shown, means, rtol=0, atol=6e-5)  # printed to 4 decimals
    assert len(shown) == want.shape[0] and f"query rows {len(want.tokens) - 8}..{len(want.tokens) - 1}" in lines[0]
    is_picture(tmp_path / "p.png")


def test_a_bad_row_count_is_one_line_and_status_2(server):
    res = client(server, "profile", "--model", "rope", "abc", "--last", "9")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "INVALID_ARGUMENT: last must be in [0, 3] for a 3-token prompt" in res.stderr
