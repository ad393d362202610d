"""Bad options to `python -m export` (and its subcommands) and `python -m model.train`: one line on stderr, exit
status 2, nothing written.  In process: the CLIs' own main(), argv as a shell would pass it."""

import pytest

from export.__main__ import main as export_main
from model.train import main as train_main


def outcome(main, argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


EXPORT = [
    (["--init", "random", "--variant", "rope", "--opset", "abc", "--out", "OUT"], "invalid int value: 'abc'"),
    (["--init", "random", "--variant", "rope"], "required: --out"),
    (["--bogus", "--out", "OUT"], "one of the arguments"),
    (["--init", "random", "--variant", "rope", "--attention", "magic", "--out", "OUT"], "invalid choice: 'magic'"),
    (["--init", "random", "--variant", "rope", "--preset", "tiny", "--out", "FILE/x"], "File exists"),
    (["--checkpoint", "MISSING", "--out", "OUT"], "does not exist"),
    (["validate"], "required: artifact"),
    (["validate", "FILE"], "does not exist or is not a folder"),
    (["triton", "FILE", "--out", "OUT"], "no artifacts"),
    (["triton", "x"], "required: --out"),
    (["rope-scale", "x", "--method", "nope", "--factor", "2", "--out", "OUT"], "invalid choice: 'nope'"),
    (["rope-scale", "x", "--method", "ntk", "--factor", "lots", "--out", "OUT"], "invalid float value"),
]

TRAIN = [
    (["--variant", "rope", "--steps", "abc"], "invalid int value: 'abc'"),
    (["--steps", "1"], "required: --variant"),
    (["--variant", "bogus", "--steps", "1"], "unknown variant 'bogus'"),
    (["--variant", "rope", "--steps", "0"], "must be positive"),
    (["--variant", "rope", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--variant", "rope", "--steps", "1", "--corpus", "MISSING"], "does not exist"),
    (["--variant", "rope", "--preset", "tiny", "--steps", "1", "--out", "FILE/x"], "is a file, not a folder"),
]


def argv_of(argv, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    subst = {"OUT": str(tmp_path / "out"), "FILE": str(tmp_path / "file"), "MISSING": str(tmp_path / "missing"),
             "FILE/x": str(tmp_path / "file" / "x")}
    return [subst.get(a, a) for a in argv]


@pytest.mark.parametrize("argv, message", EXPORT, ids=[" ".join(a) for a, _ in EXPORT])
def test_export_bad_options(argv, message, tmp_path, capsys):
    code, err = outcome(export_main, argv_of(argv, tmp_path), capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", TRAIN, ids=[" ".join(a) for a, _ in TRAIN])
def test_train_bad_options(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out (checkpoints) would land here, and must not
    code, err = outcome(train_main, argv_of(argv, tmp_path), capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
