"""docs/notebooks/positional-encodings.ipynb, run top to bottom in a real ipykernel against a real worker on a loopback
port serving the session's random tiny models (one per variant) and the LLaMA imported from a transformers folder:
every cell runs (each section asserts its property on the served numbers), and the tables and figures are there.
It sits in tests/hf to share the imported families (xdist group "hf") instead of importing one more."""

from __future__ import annotations

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

from docs.tools.notebook import NOTEBOOK, execute
from service.registry import Limits
from tests.serving import start


def served_folder(root, tiny_artifacts, hf_families):
    """One folder of links: every tiny artifact and the imported LLaMA."""
    tiny, _ = tiny_artifacts
    for folder in sorted(p for p in tiny.iterdir() if p.is_dir() and (p / "manifest.json").is_file()):
        (root / folder.name).symlink_to(folder, target_is_directory=True)
    (root / "llama").symlink_to(hf_families["llama"]["artifact"], target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def notebook_worker(tmp_path_factory, tiny_artifacts, hf_families):
    root = served_folder(tmp_path_factory.mktemp("notebook-models"), tiny_artifacts, hf_families)
    # --long-context 1, as make notebook serves: section 7 shifts the imported model past its 256 positions and
    # scores it on three times them
    srv = start(root, limits=Limits(max_prompt_tokens=1024, long_context=True))
    yield srv
    srv.stop(grace=1)


def outputs(nb, kind):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if kind(o)]


def texts(cell) -> str:
    parts = []
    for o in cell.get("outputs", []):
        parts.append(o.get("text", "") + o.get("data", {}).get("text/markdown", ""))
    return "\n".join(parts)


def test_every_cell_runs_against_a_real_worker_and_shows_its_tables_and_figures(notebook_worker):
    nb = execute(NOTEBOOK, f"127.0.0.1:{notebook_worker.port}", timeout=120)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), "a cell did not run"
    assert not outputs(nb, lambda o: o.output_type == "error")
    assert len(outputs(nb, lambda o: "image/png" in o.get("data", {}))) >= 11, "a figure is missing"
    text = "\n".join(texts(c) for c in code)
    for variant in ("none", "rope", "alibi", "learned", "sinusoidal", "t5", "fire", "cpe", "xl", "deberta", "shaw"):
        assert f"| {variant} | {variant} |" in text, f"{variant} is missing from a table"
    # section 1: NoPE's first layer is order-blind, the model is not; section 2: the served table is the paper's
    assert "none: layer 0 cannot tell the orders apart, the whole model can" in text
    assert "sinusoidal: served table = " in text
    # section 4: the slopes of the tiny model's four heads, read three ways
    assert "| 0 | 0.250000 | 0.250000 | 0.250000 |" in text and "| 3 | 0.003906 | 0.003906 | 0.003906 |" in text
    # section 5: the extrapolation table; section 6: the imported model's maps and its shift check
    assert "| model | 1x (16) | 2x (32) | 3x (48) | 4x (64) | 4x / 1x |" in text
    assert "llama: rope positions, 2 layers x 4 heads" in text and "(theory: same)" in text
    # section 7: the shift sweep (the learned table stops at 16), a layer without RoPE, a head, three scalings
    assert "| model | variant | theory | shift 0 | shift 10 | shift 100 | shift 1000 |" in text
    assert "| llama | rope | same | 0.0e+00 |" in text and "past its 16 positions" in text
    assert "llama, layer " in text and " of its attention with its RoPE and " in text
    assert "| layer | head 0 | head 1 | head 2 | head 3 |" in text and "llama: ablating layer " in text
    assert "llama (trained at 256 tokens) on 768 tokens of held-out text" in text
    assert "| linear x4 |" in text and "| yarn x4 |" in text and "from the plain prompt" in text


def test_a_broken_property_stops_the_notebook(notebook_worker, tmp_path):
    """The checks can fail: claiming that the layer-0 gap of NoPE must be large (the opposite of what the worker
    shows) makes the run stop at that cell with the assertion's message."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cut = next(i for i, c in enumerate(nb.cells) if "first_layer_gap" in c.source)
    nb.cells = nb.cells[:cut + 1]
    cell = nb.cells[cut]
    assert "assert gap < ROUNDING" in cell.source
    cell.source = cell.source.replace("assert gap < ROUNDING", "assert gap > ROUNDING")
    broken = tmp_path / "broken.ipynb"
    nbformat.write(nb, broken)
    with pytest.raises(CellExecutionError, match="with no order in its positions, layer 0"):
        execute(broken, f"127.0.0.1:{notebook_worker.port}", timeout=120)


def test_a_broken_claim_of_the_interventions_section_stops_it(notebook_worker, tmp_path):
    """Section 7's checks can fail too: claiming that a shift moves a RoPE model's answer (the opposite of what the
    worker shows) stops the shift sweep's cell, run after only the cells it builds on."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    needs = ("def show(", "def expected(", "IMPORTED = ", "sweep_kl = {}")
    nb.cells = [c for c in nb.cells if c.cell_type == "code" and any(n in c.source for n in needs)]
    assert len(nb.cells) == len(needs)
    cell = nb.cells[-1]
    claim = "assert max(kls.values()) < RELATIVE_KL"
    assert claim in cell.source
    cell.source = cell.source.replace(claim, claim.replace("<", ">"))
    broken = tmp_path / "broken.ipynb"
    nbformat.write(nb, broken)
    with pytest.raises(CellExecutionError, match="a relative encoding's answer moved under a shift"):
        execute(broken, f"127.0.0.1:{notebook_worker.port}", timeout=120)
