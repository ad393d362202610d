"""DESIGN.md section 1: who may import whom.  Scans every module's imports with ast."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)
ALLOWED = {
    "model": {"model", "torch", "numpy", "safetensors"},
    "export": {"export", "model", "torch", "onnx", "onnxruntime", "onnxscript", "numpy"},
    "protos": {"protos", "google", "grpc", "grpc_tools"},  # grpc_tools: only the build-time generator script
    "service": {"service", "protos", "onnxruntime", "numpy", "grpc", "grpc_health", "grpc_reflection",
                "google", "prometheus_client", "model.tokenizer", "model.config", "model.errors", "model.corpus",
                "matplotlib"},  # matplotlib: only service/heatmap.py, for the client's PNGs; the worker never loads it
}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {f"{node.module}.{a.name}" for a in node.names}  # from model import tokenizer
    return names


def allowed(package: str, name: str) -> bool:
    top = name.split(".")[0]
    if top in STDLIB:
        return True
    rules = ALLOWED[package]
    if package == "service" and top == "model":
        return any(name == r or name.startswith(r + ".") for r in rules)
    return top in rules


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_arrows(package):
    folder = ROOT / package
    bad = [f"{p.relative_to(ROOT)}: {n}" for p in sorted(folder.rglob("*.py"))
           if "_pb2" not in p.name for n in sorted(imports(p)) if not allowed(package, n)]
    assert not bad, "imports that break DESIGN.md's arrows:\n" + "\n".join(bad)


def test_the_scan_sees_a_violation(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import torch\nfrom export import thing\n")
    assert not allowed("service", "torch") and "torch" in imports(bad)
