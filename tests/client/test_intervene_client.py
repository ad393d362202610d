"""Interventions through the Python client and the client CLI, against a real worker over the tiny artifacts:
client.api.intervention() builds the message; a uniform shift leaves RoPE's answer unchanged and changes a learned
or sinusoidal model's; the effect's arrays are the unchanged run's; the CLI's flags reach the worker and its printed
effect is the gRPC answer's; a bad flag is one line and exit status 2."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from client import cli
from client.api import Client, attention_maps, effect_maps, effect_profile, intervention, profile_values
from protos.posenc.v1 import posenc_pb2 as pb

SHORT = "dog"  # 3 byte tokens: the tiny learned table has 16 positions, so a shift up to 13 fits


@pytest.fixture(scope="module")
def client(server):
    with Client(f"127.0.0.1:{server.port}") as c:
        yield c


def run(server, capsys, *argv: str) -> tuple[int, str, str]:
    """The client CLI's main() in this process: (exit status, stdout, stderr)."""
    code = cli.main(["--target", f"127.0.0.1:{server.port}", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_helper_builds_the_message():
    assert intervention() == pb.Intervention()  # the defaults change nothing, stretch 1 left unset
    msg = intervention(positions=[5, 6, 9], positional_off=(0, 3), ablate_heads=[(1, 2), (3, 0)],
                       rope_scaling={"rope_type": "yarn", "factor": 4}, baseline=True)
    assert list(msg.positions) == [5, 6, 9] and list(msg.positional_off) == [0, 3] and msg.baseline
    assert [(h.layer, h.head) for h in msg.ablate_heads] == [(1, 2), (3, 0)]
    assert json.loads(msg.rope_scaling) == {"rope_type": "yarn", "factor": 4}
    msg = intervention(shift=-2, stretch=2.5, next_position=40, rope_scaling='{"rope_theta": 50000}')
    assert (msg.shift, msg.stretch, msg.next_position, msg.rope_scaling) == (-2, 2.5, 40, '{"rope_theta": 50000}')
    assert msg.HasField("next_position") and not intervention().HasField("next_position")


def test_a_shift_leaves_rope_unchanged_and_moves_absolute_encodings(client):
    """RoPE's scores depend only on q.k of vectors rotated by their positions, R(m)q . R(n)k = q . R(n - m)k, so adding
    K to every position changes nothing; a learned or sinusoidal model adds a different vector per position."""
    for model, shift in (("rope", 1000), ("rope", 7), ("learned", 7), ("sinusoidal", 7)):
        plain = client.predict(model, SHORT, top_k=5)
        moved = client.predict(model, SHORT, top_k=5, intervention=intervention(shift=shift, baseline=True))
        assert list(moved.effect.positions) == [shift, shift + 1, shift + 2]
        # the baseline is the plain answer, whatever the model
        assert [c.token.id for c in moved.effect.baseline_top] == [c.token.id for c in plain.top]
        np.testing.assert_allclose([c.logprob for c in moved.effect.baseline_top], [c.logprob for c in plain.top],
                                   atol=1e-5)
        if model == "rope":
            assert moved.effect.kl_divergence < 1e-6 and not moved.effect.top1_changed
            assert [c.token.id for c in moved.top] == [c.token.id for c in plain.top]
            np.testing.assert_allclose([c.logprob for c in moved.top], [c.logprob for c in plain.top], atol=1e-4)
        else:
            assert moved.effect.kl_divergence > 1e-4, model
            assert np.abs(np.array([c.logprob for c in moved.top]) - [c.logprob for c in plain.top]).max() > 1e-3


def test_the_effect_arrays_are_the_unchanged_runs(client):
    moved = client.predict("rope", "dog bites", attention="full", intervention=intervention(shift=50, baseline=True))
    plain = client.predict("rope", "dog bites", attention="full")
    base, now, want = effect_maps(moved), attention_maps(moved), attention_maps(plain)
    assert [(layer, head) for layer, head, _ in base] == [(layer, head) for layer, head, _ in want] and base
    for (_, _, b), (_, _, n), (_, _, w) in zip(base, now, want, strict=True):
        np.testing.assert_allclose(b, w, atol=1e-5)
        np.testing.assert_allclose(n, w, atol=1e-4)  # relative: the shifted maps too
    off = client.profile("rope", "dog bites", intervention=intervention(positional_off=[0], baseline=True))
    plain_profile = client.profile("rope", "dog bites")
    np.testing.assert_allclose(effect_profile(off), profile_values(plain_profile), atol=1e-5)
    assert np.abs(profile_values(off)[0] - profile_values(plain_profile)[0]).max() > 1e-3  # layer 0 lost its RoPE
    with pytest.raises(ValueError, match="no baseline"):
        effect_profile(plain_profile)


def test_score_reports_the_change_per_token(client):
    text = "dog bites man"
    under = client.score("learned", text, intervention=intervention(positions=[0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                               12, 13], baseline=True))
    plain = client.score("learned", text)
    np.testing.assert_allclose(under.effect.baseline_logprobs, plain.logprobs, atol=1e-5)
    np.testing.assert_allclose(under.effect.logprob_change, np.subtract(under.logprobs, plain.logprobs), atol=1e-5)
    assert abs(under.effect.logprob_change[0]) < 1e-5  # token 1 is scored from token 0 alone, at position 0 both
    assert np.abs(under.effect.logprob_change).max() > 1e-3


def test_cli_flags_reach_the_worker_and_print_its_effect(server, client, capsys):
    code, out, err = run(server, capsys, "predict", "--model", "learned", SHORT, "--shift", "4", "--baseline")
    assert code == 0, err
    want = client.predict("learned", SHORT, intervention=intervention(shift=4, baseline=True))
    assert "intervention: shift 4; positions used: 4, 5, 6" in out
    kl = float(re.search(r"KL (\S+) nats", out).group(1))
    assert kl == pytest.approx(want.effect.kl_divergence, rel=1e-5) and kl > 1e-4
    # each row: rank, then token, prob, logprob of the intervened run and of the baseline (a piece may hold spaces)
    rows = [re.findall(r" (\d\.\d{4}) +(-?\d+\.\d{3})", line) for line in out.splitlines()
            if re.match(r"\s+\d+ ", line)]
    assert [float(r[0][1]) for r in rows] == pytest.approx([c.logprob for c in want.top], abs=6e-4)
    assert [float(r[1][1]) for r in rows] == pytest.approx([c.logprob for c in want.effect.baseline_top], abs=6e-4)

    code, out, err = run(server, capsys, "score", "--model", "rope", "dog bites", "--positional-off", "1",
                         "--ablate", "0.1,1.3", "--baseline")
    assert code == 0, err
    edit = intervention(positional_off=[1], ablate_heads=[(0, 1), (1, 3)], baseline=True)
    want = client.score("rope", "dog bites", intervention=edit)
    assert "encoding off in layers 1" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+ \S+ +-?\d+\.\d{4} ", line)]
    assert len(rows) == len(want.logprobs)
    np.testing.assert_allclose([float(r[-1]) for r in rows], want.effect.logprob_change, rtol=6e-3, atol=1e-4)

    code, out, err = run(server, capsys, "profile", "--model", "rope", "dog bites", "--stretch", "3", "--baseline")
    assert code == 0, err
    want = client.profile("rope", "dog bites", intervention=intervention(stretch=3, baseline=True))
    assert "positions used: 0, 3, 6, 9, 12, 15, 18, 21, 24\n" in out and "KL" not in out
    tables = out.split("difference (intervened - baseline):\n")[1].splitlines()[1:]
    diff = np.array([[float(v) for v in line.split()[1:]] for line in tables])
    np.testing.assert_allclose(diff, (profile_values(want) - effect_profile(want)).mean(axis=1), atol=6e-5)

    code, out, err = run(server, capsys, "generate", "--model", "rope", SHORT, "--max-new-tokens", "4",
                         "--next-position", "40", "--rope-scaling", '{"rope_type": "linear", "factor": 2}')
    assert code == 0, err
    (last,) = list(client.generate("rope", SHORT, 4, intervention=intervention(
        next_position=40, rope_scaling={"rope_type": "linear", "factor": 2})))[-1:]
    assert out.splitlines()[-1] == f"[{last.finish_reason}] {last.text!r}"


@pytest.mark.parametrize("argv, words", [
    (["predict", "--shift", "x"], "argument --shift: invalid int value: 'x'"),
    (["predict", "--positions", "1,-2,3"], "argument --positions: must be integers >= 0"),
    (["score", "--positional-off", "a"], "argument --positional-off: must be integers >= 0"),
    (["predict", "--ablate", "1"], "argument --ablate: must be LAYER.HEAD pairs"),
    (["profile", "--ablate", "1.2.3"], "argument --ablate: must be LAYER.HEAD pairs"),
    (["predict", "--stretch", "0"], "argument --stretch: must be > 0, got 0"),
    (["predict", "--rope-scaling", "[4]"], "argument --rope-scaling: must be a JSON object"),
    (["generate", "--next-position", "-1"], "argument --next-position: must be >= 0"),
    (["generate", "--baseline"], "unrecognized arguments: --baseline"),
    (["predict", "--next-position", "3"], "unrecognized arguments: --next-position 3"),
])
def test_a_bad_flag_is_one_line_and_status_2(server, capsys, argv, words):
    with pytest.raises(SystemExit) as stop:
        run(server, capsys, argv[0], "--model", "rope", SHORT, *argv[1:])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and words in err, err


def test_a_refused_intervention_is_one_line_and_status_2(server, capsys):
    """The worker's INVALID_ARGUMENT names the field: three positions for a prompt of one token, an absolute
    encoding asked to switch a layer's encoding off."""
    code, out, err = run(server, capsys, "predict", "--model", "rope", "d", "--positions", "1,2,3")
    assert code == 2 and err.count("\n") == 1 and "INVALID_ARGUMENT: intervention.positions" in err
    code, out, err = run(server, capsys, "score", "--model", "learned", SHORT, "--positional-off", "0")
    assert code == 2 and err.count("\n") == 1 and "intervention.positional_off" in err
