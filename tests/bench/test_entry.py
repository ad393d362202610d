"""bench/ as one tool: `python -m bench` lists every registered command, each of which imports and has a main, and an
unknown name is one line on stderr and exit status 2; a command's bad option is the project's one-line error."""

import ast
import subprocess
import sys
from pathlib import Path

from bench.__main__ import COMMANDS

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_listing_names_every_command():
    done = bench()
    assert done.returncode == 0
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)
    assert {"run", "trees", "soak", "peers", "compat"} <= set(listed)


def test_every_command_is_a_module_with_main_and_none_is_run_otherwise():
    """Read, not imported: a command loads the engines it measures only when run."""
    for name, (module, _) in COMMANDS.items():
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), name
        assert "__main__" not in ast.unparse(tree), f"{module} is run through python -m bench {name} only"


def test_an_unknown_command_is_one_line_and_exit_2():
    done = bench("no-such-benchmark")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no-such-benchmark" in done.stderr


def test_a_commands_bad_option_is_one_line_and_exit_2_and_help_names_the_command():
    done = bench("trees", "--no-such-flag")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "python -m bench trees" in done.stderr
    done = bench("run", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m bench run")
