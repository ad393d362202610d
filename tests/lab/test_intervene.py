"""`posenc intervene` against a real worker over the tiny artifacts: what it prints is the gRPC answer (KL, both
runs' attention mass by distance and their change), --out draws a PNG, and --sweep-shift tells a relative encoding
(RoPE: about 0 at every shift) from an absolute one (learned: not)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from client.api import intervention
from lab import cli
from protos.posenc.v1 import posenc_pb2 as pb
from tests.lab.test_lab import client, is_picture

TEXT = "dog bites man"


def posenc(server, capsys, *argv: str) -> tuple[int, str, str]:
    """`posenc ARGV` in this process (lab.cli.main, the console script): (exit status, stdout, stderr)."""
    code = cli.main(["--target", f"127.0.0.1:{server.port}", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_intervene_prints_the_grpc_answer_and_draws_it(server, stub, capsys, tmp_path):
    out_png = tmp_path / "iv.png"
    code, out, err = posenc(server, capsys, "intervene", "--model", "rope", "--text", TEXT, "--positional-off", "0",
                            "--ablate", "1.2", "--top-k", "4", "--out", str(out_png))
    assert code == 0, err
    edit = intervention(positional_off=[0], ablate_heads=[(1, 2)], baseline=True)
    want = stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text=TEXT), top_k=4, intervention=edit))
    kl = float(re.search(r"KL (\S+) nats", out).group(1))
    assert kl == pytest.approx(want.effect.kl_divergence, rel=1e-5) and kl > 1e-4
    assert f"top-1 changed: {'yes' if want.effect.top1_changed else 'no'}" in out
    prof = stub.Profile(pb.ProfileRequest(model="rope", prompt=pb.Prompt(text=TEXT), intervention=edit))
    values = np.frombuffer(prof.values, "<f4").reshape(prof.shape).mean(axis=1)[:, :prof.buckets]
    base = np.frombuffer(prof.effect.baseline_profile, "<f4").reshape(prof.shape).mean(axis=1)[:, :prof.buckets]
    header = next(line for line in out.splitlines() if line.split()[:2] == ["layer", "run"])
    assert header.split()[2:] == list(prof.columns[:prof.buckets])
    for run, expect in (("intervened", values), ("baseline", base), ("change", values - base)):
        shown = np.array([[float(v) for v in line.split()[2:]] for line in out.splitlines()
                          if re.match(rf"\s+\d+ {run} ", line)])
        np.testing.assert_allclose(shown, expect, atol=6e-5)  # printed to 4 decimals
    assert np.abs(values[0] - base[0]).max() > 1e-3  # layer 0 without its RoPE looks elsewhere
    assert out_png.stat().st_size > 0 and "written to" in err
    is_picture(out_png)


def test_a_shift_sweep_tells_relative_from_absolute(server, stub, capsys, tmp_path):
    shifts = [0, 2, 5, 12]  # the tiny learned table has 16 positions; "dog" is 3 tokens
    for model in ("rope", "learned"):
        code, out, err = posenc(server, capsys, "intervene", "--model", model, "--text", "dog", "--sweep-shift",
                                ",".join(map(str, shifts)), "--out", str(tmp_path / f"{model}.png"))
        assert code == 0, err
        rows = [line.strip("|").split("|") for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
        assert [int(r[0]) for r in rows] == shifts
        kl = [float(r[1]) for r in rows]
        for k, shown in zip(shifts, kl, strict=True):
            want = stub.Predict(pb.PredictRequest(model=model, prompt=pb.Prompt(text="dog"), top_k=5,
                                                  intervention=intervention(shift=k, baseline=True)))
            assert shown == pytest.approx(want.effect.kl_divergence, rel=1e-5, abs=1e-300)
        assert kl[0] == 0
        if model == "rope":
            assert max(kl) < 1e-6
        else:
            assert min(kl[1:]) > 1e-4
        is_picture(tmp_path / f"{model}.png")


def test_intervene_bad_input_is_one_line_and_status_2(server):
    res = client(server, "intervene", "--model", "rope", "--text", "dog", "--sweep-shift", "0,10", "--shift", "3")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--sweep-shift" in res.stderr
    res = client(server, "intervene", "--model", "rope", "--text", "dog", "--sweep-shift", "0,-1")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "argument --sweep-shift" in res.stderr
    res = client(server, "intervene", "--model", "learned", "--text", "dog", "--positional-off", "0")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "intervention.positional_off" in res.stderr
