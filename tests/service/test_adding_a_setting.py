"""ARCHITECTURE.md section 12 is true: the field written there, added to Batching and nothing else, is a flag and a
POSENC_* variable of `python -m service` (checked, one line and exit 2 when bad), a row of the generated settings
table, and reaches what a Registry gives its models, whole."""

import dataclasses
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from model import cli
from service import settings
from service.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## 12. Adding a setting"


def block() -> str:
    doc = (ROOT / "ARCHITECTURE.md").read_text()
    section = doc[doc.index(SECTION):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


@pytest.fixture(scope="module")
def worker():
    """Batching with the section's field, and Settings holding that Batching (as service/settings.py would)."""
    namespace = {"option": cli.option, "dataclass": dataclass, "Base": settings.Batching}
    exec(compile("@dataclass(frozen=True)\nclass Batching(Base):\n" + block(), "ARCHITECTURE.md section 12", "exec"),
         namespace)
    batching = namespace["Batching"]
    hints = typing.get_type_hints(settings.Settings)
    fields = [(f.name, hints[f.name], f) for f in dataclasses.fields(settings.Settings)]
    field = next(f for f in dataclasses.fields(settings.Settings) if f.name == "batching")
    nested = cli.option(default_factory=batching, nested=True, help=field.metadata["posenc"]["help"])
    fields = [(n, batching if n == "batching" else t, nested if n == "batching" else f) for n, t, f in fields]
    return batching, dataclasses.make_dataclass("Settings", fields, frozen=True)


def parse(cls, argv, environ):
    return cli.parse(settings.parser(), cls, settings.PREFIX, argv, environ)


def test_the_field_is_a_flag_and_a_variable_and_the_flag_wins(worker, tmp_path):
    _, cls = worker
    base = ["--model-dir", str(tmp_path)]
    assert parse(cls, base, {}).batching.batch_tokens == 256  # its one default
    assert parse(cls, base, {"POSENC_BATCH_TOKENS": "48"}).batching.batch_tokens == 48
    assert parse(cls, [*base, "--batch-tokens", "64"], {"POSENC_BATCH_TOKENS": "48"}).batching.batch_tokens == 64
    assert parse(cls, [*base, "--max-batch", "4"], {}).batching.max_batch == 4  # the other batching flags stay


def test_a_bad_value_is_one_line_and_exit_2(worker, tmp_path, capsys):
    batching, cls = worker
    with pytest.raises(SystemExit) as ended:
        parse(cls, ["--model-dir", str(tmp_path), "--batch-tokens", "0"], {})
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch-tokens must be >= 1, got 0" in err
    with pytest.raises(cli.SettingError, match="--batch-tokens must be >= 1"):
        batching(batch_tokens=0)


def test_the_generated_table_has_its_row(worker):
    _, cls = worker
    rows = [r for r in cli.markdown(cls, settings.PREFIX).splitlines() if r.startswith("| `--batch-tokens`")]
    assert len(rows) == 1 and "`POSENC_BATCH_TOKENS`" in rows[0] and "| 256 |" in rows[0]


def test_the_registry_passes_the_object_whole(worker, tmp_path):
    _, cls = worker
    s = parse(cls, ["--model-dir", str(tmp_path), "--batch-tokens", "96"], {})
    registry = Registry({}, s.limits, s.batching, s.tuning)
    assert registry.batching is s.batching and registry.batching.batch_tokens == 96
