"""The validation report: one row per check, read as a checklist (Optimum's style).

Its own module so that every producer of rows (export.validate for the model graph, export.encoding for the
encoding graph) imports it without importing each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Tolerances (max abs diff).  Measured on the default models (2026-11-26): logits 7e-6 to 3e-5,
# probabilities 1e-6 to 1.5e-5.
# Attention probabilities: 3e-5 (Optimum validates at 1e-5 to 3e-4 by architecture).  Most models sit near 1e-6;
# Transformer-XL's trained scores reach ~100, where float32 summation order alone moves a probability by ~2e-5.
TOLERANCE = {"logits": 1e-4, "attentions": 3e-5, "present": 1e-4}


@dataclass
class Check:
    case: str
    output: str
    shape: str
    max_abs_diff: float | None
    tolerance: float | None
    passed: bool
    detail: str = ""


@dataclass
class Report:
    name: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def worst(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.checks:
            if c.max_abs_diff is not None:
                key = "present" if c.output.startswith("present") else c.output
                out[key] = max(out.get(key, 0.0), c.max_abs_diff)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "max_abs_diff": self.worst(),
                "tolerance": TOLERANCE, "checks": [asdict(c) for c in self.checks]}

    def format_table(self) -> str:
        rows = [f"validation of {self.name}",
                f"{'case':<34} {'output':<30} {'shape':<22} {'max abs diff':>12} {'tol':>8}  result"]
        for c in self.checks:
            diff = "" if c.max_abs_diff is None else f"{c.max_abs_diff:.2e}"
            tol = "" if c.tolerance is None else f"{c.tolerance:.0e}"
            rows.append(f"{c.case:<34} {c.output:<30} {c.shape:<22} {diff:>12} {tol:>8}  "
                        f"{'PASS' if c.passed else 'FAIL'}{'  ' + c.detail if c.detail else ''}")
        rows.append(f"{'PASSED' if self.passed else 'FAILED'}: {sum(c.passed for c in self.checks)}/"
                    f"{len(self.checks)} checks; worst: " +
                    ", ".join(f"{k} {v:.2e}" for k, v in self.worst().items()))
        return "\n".join(rows)
