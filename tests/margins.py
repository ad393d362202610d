"""How much of its tolerance each float comparison of the suite uses: a pytest plugin and its report.

    make margins                     # the whole suite with the plugin on, then the report
    python -m tests.margins FILE     # the report of a recorded run: comparisons using >= 90% of their tolerance

A comparison whose measured figure sits within 10% of its tolerance on the machine the tests are written on has no
room for another CPU's kernels (AVX2 against AVX-512, another summation order): its verdict is decided by rounding,
not by the code.  With POSENC_MARGINS=FILE (and pytest's `enable_assertion_pass_hook`, which `make margins` sets) the
plugin appends one JSON line per passing comparison to FILE:

- a bare `assert` that compares numbers (`d <= tol`, `err < 1e-5`, `agree >= 0.97`), as pytest's assertion
  rewriting explains it;
- numpy's `assert_allclose` and `allclose`, torch's `testing.assert_close` and `allclose`: the largest
  |actual - desired| / (atol + rtol |desired|) over the elements.

`used` is the share of the tolerance the figure took: measured / bound for an upper bound; for a lower bound on a
share (`agree >= 0.97`, figures in [0, 1]) the room it leaves, (1 - measured) / (1 - bound), since that is what a
handful of flipped positions moves.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

NUMBER = r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"
COMPARISON = re.compile(rf"(?<![\w.])({NUMBER}) (<=|<|>=|>) ({NUMBER})(?![\w.])")
FLAG = 0.9  # the report lists comparisons that use at least this share of their tolerance


def _used(measured: float, op: str, bound: float) -> float | None:
    """The share of the tolerance used, None where the comparison is no tolerance (a count, a non-positive bound)."""
    if op in ("<", "<=") and bound > 0 and measured >= 0:
        return measured / bound
    if op in (">", ">=") and 0 < bound < 1 and 0 <= measured <= 1:
        return (1 - measured) / (1 - bound)
    return None


def _is_float(text: str) -> bool:
    return any(c in text for c in ".eE")


def comparisons(expl: str) -> list[tuple[float, str, float, float]]:
    """(measured, operator, bound, used) for each numeric comparison pytest's explanation shows, where the bound is
    written as a float (an integer bound is a count, not a tolerance)."""
    found = []
    for a, op, b in COMPARISON.findall(expl):
        if not _is_float(b):
            continue
        used = _used(float(a), op, float(b))
        if used is not None:
            found.append((float(a), op, float(b), used))
    return found


class Recorder:
    def __init__(self, path: str, root: Path):
        self.path, self.root, self.nodeid = path, root, ""

    def relative(self, filename: str, lineno: int) -> str:
        path = Path(filename).resolve()
        return f"{path.relative_to(self.root) if self.root in path.parents else path}:{lineno}"

    def write(self, **row: Any) -> None:
        row["test"] = self.nodeid
        with open(self.path, "a", encoding="utf-8") as f:  # one line per write: O_APPEND keeps workers' lines whole
            f.write(json.dumps(row) + "\n")

    def caller(self) -> str:
        """file:line of the check's call site: the nearest frame outside this file and the installed packages."""
        for frame in inspect.stack()[2:]:
            if frame.filename != __file__ and "site-packages" not in frame.filename:
                return self.relative(frame.filename, frame.lineno)
        return "?"

    def closeness(self, kind: str, actual: Any, desired: Any, rtol: float, atol: float) -> None:
        import numpy as np

        try:
            a = np.asarray(actual.detach() if hasattr(actual, "detach") else actual, np.float64)
            d = np.asarray(desired.detach() if hasattr(desired, "detach") else desired, np.float64)
            diff, room = np.atleast_1d(np.abs(a - d)), np.atleast_1d(atol + rtol * np.abs(d))
            diff, room = np.broadcast_arrays(diff, room)
        except (TypeError, ValueError, RuntimeError):  # not numbers: nothing to record, the check itself passed
            return
        finite = np.isfinite(diff)
        if not finite.any():
            return
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(diff[finite] == 0, 0.0, diff[finite] / room[finite])
        self.write(where=self.caller(), kind=kind, used=float(share.max()), rtol=rtol, atol=atol,
                   measured=float(diff[finite].max()))


def _wrap(recorder: Recorder) -> None:
    """numpy's and torch's closeness checks record what share of their tolerance the passing ones used."""
    import numpy as np

    def np_assert_allclose(actual, desired, rtol=1e-7, atol=0, *args, _f=np.testing.assert_allclose, **kw):
        _f(actual, desired, rtol, atol, *args, **kw)
        recorder.closeness("numpy.testing.assert_allclose", actual, desired, rtol, atol)

    def np_allclose(a, b, rtol=1e-05, atol=1e-08, *args, _f=np.allclose, **kw):
        ok = _f(a, b, rtol, atol, *args, **kw)
        if ok:
            recorder.closeness("numpy.allclose", a, b, rtol, atol)
        return ok

    np.testing.assert_allclose, np.allclose = np_assert_allclose, np_allclose
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return
    _wrap_torch(recorder, torch)


def _wrap_torch(recorder: Recorder, torch: Any) -> None:
    defaults = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
                torch.float64: (1e-7, 1e-7)}

    def assert_close(actual, expected, *args, rtol=None, atol=None, _f=torch.testing.assert_close, **kw):
        _f(actual, expected, *args, rtol=rtol, atol=atol, **kw)
        if isinstance(actual, torch.Tensor) and actual.is_floating_point():
            r, a = defaults.get(actual.dtype, (1.3e-6, 1e-5))
            recorder.closeness("torch.testing.assert_close", actual, expected, r if rtol is None else rtol,
                               a if atol is None else atol)

    def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False, _f=torch.allclose):
        ok = _f(a, b, rtol, atol, equal_nan)
        if ok:
            recorder.closeness("torch.allclose", a, b, rtol, atol)
        return ok

    torch.testing.assert_close, torch.allclose = assert_close, allclose


RECORDER: Recorder | None = None


def _rewrite_helpers() -> None:
    """The asserts of the tests' helper modules (tests/hf/float64.py's compare, ...) rewritten as the test files'
    are, so their passing comparisons reach the hook too: every subpackage of tests/, registered before it is
    imported (this plugin loads first, with -p)."""
    import pytest

    here = Path(__file__).resolve().parent
    pytest.register_assert_rewrite(*(f"tests.{p.stem}" for p in here.iterdir()
                                     if p.suffix == ".py" and p.stem not in ("__init__", "margins")
                                     or (p / "__init__.py").is_file()))


if os.environ.get("POSENC_MARGINS"):
    _rewrite_helpers()


def pytest_configure(config):
    global RECORDER
    path = os.environ.get("POSENC_MARGINS")
    if path and RECORDER is None:
        RECORDER = Recorder(str(Path(path).resolve()), config.rootpath.resolve())
        _wrap(RECORDER)


def pytest_runtest_setup(item):
    if RECORDER is not None:
        RECORDER.nodeid = item.nodeid


def _assert_site() -> tuple[str, int] | None:
    """The file and line of the assert pytest reports as passed: the nearest frame outside pytest, pluggy and this
    file; None when that is an installed package's own assert (hypothesis rewrites its internals too)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if frame.f_code.co_filename != __file__ and not any(p in name for p in ("/_pytest/", "/pluggy/")):
            return None if "site-packages" in name else (name, frame.f_lineno)
        frame = frame.f_back
    return None


def pytest_assertion_pass(item, lineno, orig, expl):
    if RECORDER is None:
        return
    site = _assert_site()
    if site is None:
        return
    for measured, op, bound, used in comparisons(expl):
        RECORDER.write(where=RECORDER.relative(*site), kind=f"assert {op}", used=used, measured=measured,
                       bound=bound, source=orig[:160])


def report(path: str, flag: float = FLAG) -> list[dict[str, Any]]:
    """The worst use of each comparison site (file:line and kind) over the run, those at or above `flag`."""
    worst: dict[tuple[str, str], dict[str, Any]] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        key = (row["where"], row["kind"])
        if key not in worst or row["used"] > worst[key]["used"]:
            worst[key] = row
    return sorted((r for r in worst.values() if r["used"] >= flag), key=lambda r: -r["used"])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_file():
        print("usage: python -m tests.margins FILE (a JSON-lines file a POSENC_MARGINS run wrote)", file=sys.stderr)
        return 2
    rows = report(args[0])
    for r in rows:
        print(f"{r['used']:6.3f}  {r['where']}  {r['kind']}  {r['test']}")
    print(f"{len(rows)} comparison sites use >= {FLAG:.0%} of their tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
