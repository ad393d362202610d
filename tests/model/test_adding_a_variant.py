"""ARCHITECTURE.md section 7 is true: the KERPLE example there, as written, is one module and one registry line, and
with nothing else changed it validates as a config, trains, decodes through its cache like its full forward, and
exports with parity."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig, preset
from model.transformer import Transformer
from model.variants import REGISTRY, check_name

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kerple(tmp_path, monkeypatch):
    doc = (ROOT / "ARCHITECTURE.md").read_text()
    code = re.search(r"```python\n(# model/variants/kerple\.py\n.*?)```", doc, re.S).group(1)
    line = re.search(r"```python\n(from model\.variants\.kerple import KerpleLog.*?)\n```", doc, re.S).group(1)
    assert "KerpleLog" in line  # the one registry line the document shows
    path = tmp_path / "kerple_example.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("kerple_example", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kerple_example", module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(REGISTRY, module.KerpleLog.name, module.KerpleLog)  # the registry line
    return module.KerpleLog.name


def test_the_example_builds_only_once_registered(kerple):
    assert preset("tiny", kerple).variant == kerple and check_name(kerple) == kerple
    REGISTRY.pop(kerple)
    with pytest.raises(Exception, match="unknown variant 'kerple'"):
        Transformer(ModelConfig(variant="kerple"))


def test_the_example_trains_and_decodes_like_its_full_forward(kerple):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", kerple))
    ids = torch.randint(0, 256, (2, 12))
    out = model(ids, output_attentions=False)
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss) and model.pos.r1.grad.abs().sum() > 0 and model.pos.r2.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        full = model(ids).logits
        step = model(ids[:, :7])
        past, logits = step.presents, [step.logits]
        for t in range(7, 12):
            mask = torch.ones(2, t + 1, dtype=torch.int64)
            o = model(ids[:, t:t + 1], mask, past)
            past = o.presents
            logits.append(o.logits)
    assert torch.allclose(torch.cat(logits, 1), full, atol=1e-5)


def test_the_example_exports_with_parity(kerple, tmp_path):
    from export.build import build_artifact

    torch.manual_seed(0)
    model = Transformer(preset("tiny", kerple)).eval()
    with torch.no_grad():
        for p in model.pos.parameters():
            p.add_(torch.randn_like(p))  # heads with different slopes and curvature
    report = build_artifact(model, tmp_path / kerple, name=kerple, opset=23, source={"kind": "random"},
                            training={}, force=False)
    assert report.passed
