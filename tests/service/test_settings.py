"""The worker's settings, defined once (service/settings.py): flags, POSENC_* variables, checks, --help and the docs
table all agree with the definition and with each other."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from model import cli
from service.__main__ import parse
from service.settings import CLIENT_BEGIN, PREFIX, Batching, Limits, Settings, filled

ROOT = Path(__file__).resolve().parents[2]
SPECS = cli.specs(Settings, PREFIX)


def test_docs_table_is_the_generated_one():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert filled(page) == page, "docs/settings.md is stale: python -m service.settings --update docs/settings.md"
    worker, client = page.split(CLIENT_BEGIN)
    for text, specs in ((worker, SPECS), (client, cli.specs(cli.ClientTLS, PREFIX))):
        rows = [line for line in text.splitlines() if line.startswith("| `--")]
        assert [re.match(r"\| `--([a-z-]+)`", r).group(1) for r in rows] == [s.flag for s in specs]


def test_the_stale_check_sees_a_changed_row():
    page = (ROOT / "docs" / "settings.md").read_text()
    for old, new in (("| 50051 |", "| 50052 |"), ("`POSENC_TLS_CLIENT_KEY`", "`POSENC_TLS_KEY`")):
        assert old in page and filled(page.replace(old, new)) != page.replace(old, new)


def test_help_names_every_flag_and_variable():
    out = subprocess.run([sys.executable, "-m", "service", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for s in SPECS:
        assert f"--{s.flag}" in out.stdout and s.env in out.stdout, s


def test_no_flags_and_no_environment_give_the_dataclass_defaults(tmp_path):
    # one default per setting: the command line adds nothing of its own (http_port was 8000 there, -1 here)
    assert parse(["--model-dir", str(tmp_path)], environ={}) == Settings(model_dir=tmp_path)
    assert Settings(model_dir=tmp_path).http_port == 8000 and Settings(model_dir=tmp_path).limits == Limits()


def samples(spec):
    """(environment value, expected, flag value, expected) inside the setting's range."""
    if spec.meta["choices"]:
        return spec.meta["choices"][-1], spec.meta["choices"][-1], spec.meta["choices"][0], spec.meta["choices"][0]
    if spec.kind is bool:
        return "0", False, "1", True
    if spec.kind is int:
        n = max(3, spec.meta["low"] or 0)
        return str(n), n, str(n + 1), n + 1
    if spec.kind is float:
        return "2.5", 2.5, "4.5", 4.5
    return "alpha", "alpha", "beta", "beta"


@pytest.mark.parametrize("spec", [s for s in SPECS if s.kind is not Path], ids=lambda s: s.flag)
def test_each_variable_sets_its_setting_and_the_flag_wins(spec, tmp_path):
    raw, value, flag_raw, flag_value = samples(spec)
    env = {spec.env: raw, "POSENC_MODEL_DIR": str(tmp_path)}
    assert owner(parse([], environ=env), spec.name) == value
    assert owner(parse([f"--{spec.flag}", flag_raw], environ=env), spec.name) == flag_value


def owner(settings, name):
    """The value of a setting, in the object of Settings that holds it (its limits, its batching, or itself)."""
    for part in (settings.limits, settings.batching):
        if name in {f.name for f in dataclasses.fields(part)}:
            return getattr(part, name)
    return getattr(settings, name)


def test_settings_built_in_python_are_checked_too(tmp_path):
    with pytest.raises(cli.SettingError, match="--max-batch must be >= 1, got 0"):
        Batching(max_batch=0)
    with pytest.raises(cli.SettingError, match="--max-request-seconds must be >= 0"):
        Limits(max_request_s=-1.0)
    with pytest.raises(cli.SettingError, match="--provider 'tpu' is not one of cpu, cuda, auto"):
        Settings(model_dir=tmp_path, provider="tpu")


def test_max_stop_strings_may_be_lowered_to_none(tmp_path):
    """Fewer stop strings than the default, down to 0 (a request that gives one is refused: tests/http/
    test_openai_semantics.py), from the flag, the variable and Python alike; below 0 is refused."""
    env = {"POSENC_MODEL_DIR": str(tmp_path)}
    assert parse(["--max-stop-strings", "0"], environ=env).limits.max_stop_strings == 0
    assert parse([], environ=env | {"POSENC_MAX_STOP_STRINGS": "4"}).limits.max_stop_strings == 4
    assert Limits(max_stop_strings=1).max_stop_strings == 1
    with pytest.raises(cli.SettingError, match="--max-stop-strings must be >= 0, got -1"):
        Limits(max_stop_strings=-1)


def test_an_empty_path_variable_is_unset(tmp_path):
    assert parse([], environ={"POSENC_MODEL_DIR": str(tmp_path), "POSENC_TLS_CERT": "", "POSENC_TLS_KEY": ""}
                 ).tls_cert is None


def test_manifests_and_the_image_set_only_known_variables():
    known = {s.env for s in SPECS}
    files = [ROOT / "deploy" / "k8s" / "base" / "configmap.yaml", ROOT / "docker" / "Dockerfile"]
    used = {n for f in files for n in re.findall(r"\b(POSENC_[A-Z0-9_]+)\b\s*[:=]", f.read_text())}
    assert used and used <= known, used - known


def test_a_new_field_is_a_new_flag_variable_check_and_row():
    """Adding a setting is one field: the flag, the variable, the range check and the docs row follow."""

    @dataclasses.dataclass(frozen=True)
    class Extra:
        max_stop_strings: int = cli.option(4, low=0, help="most stop strings")

        def __post_init__(self):
            cli.check(self)

    p = cli.Parser(prog="x")
    assert cli.parse(p, Extra, "X_", ["--max-stop-strings", "7"], environ={}).max_stop_strings == 7
    assert cli.parse(cli.Parser(prog="x"), Extra, "X_", [], environ={"X_MAX_STOP_STRINGS": "2"}).max_stop_strings == 2
    assert "| `--max-stop-strings` | `X_MAX_STOP_STRINGS` | int | 4 | >= 0 | most stop strings |" in cli.markdown(
        Extra, "X_")
    with pytest.raises(SystemExit) as exit_:
        cli.parse(cli.Parser(prog="x"), Extra, "X_", ["--max-stop-strings", "-1"], environ={})
    assert exit_.value.code == 2


def test_client_and_healthcheck_share_one_tls_definition():
    """posenc and the healthcheck take the same TLS flags and variables, from model.cli.ClientTLS."""
    from client.cli import parser

    shared = cli.specs(cli.ClientTLS, "POSENC_")
    flags = {s for a in parser()._actions for s in a.option_strings}
    health = subprocess.run([sys.executable, "-m", "service.healthcheck", "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert health.returncode == 0, health.stderr
    for s in shared:
        assert f"--{s.flag}" in flags and f"--{s.flag}" in health.stdout and s.env in health.stdout, s
    assert {s.env for s in shared} == {"POSENC_TLS_CA", "POSENC_TLS_CLIENT_CERT", "POSENC_TLS_CLIENT_KEY",
                                       "POSENC_TLS_SERVER_NAME"}
    with pytest.raises(cli.SettingError, match="needs both --tls-cert and --tls-key"):
        cli.ClientTLS(tls_cert=Path("client.pem"))
