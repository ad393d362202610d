"""docs/scaling.png is drawn from bench/results/scaling.json alone: drawing it again from the committed JSON gives
the committed picture's pixels, so the two cannot drift apart unnoticed."""

import copy
import json

import numpy as np
from matplotlib import image

from lab.experiments.scaling import PLOT, RESULTS, main


def draw(doc: dict, folder) -> np.ndarray:
    src, out = folder / "scaling.json", folder / "scaling.png"
    src.write_text(json.dumps(doc))
    assert main(["--plot-only", "--out", str(src), "--plot", str(out)]) == 0
    return image.imread(out)


def test_the_committed_picture_is_drawn_from_the_committed_results(tmp_path):
    committed = image.imread(PLOT)
    drawn = draw(json.loads(RESULTS.read_text()), tmp_path)
    assert drawn.shape == committed.shape
    assert np.array_equal(drawn, committed), f"{int((drawn != committed).any(-1).sum())} pixels differ"


def test_a_changed_result_changes_the_picture(tmp_path):
    doc = json.loads(RESULTS.read_text())
    changed = copy.deepcopy(doc)
    changed["study"]["rows"]["llama-dynamic"]["cells"]["8"]["perplexity_per_byte"] *= 1.5
    assert not np.array_equal(draw(changed, tmp_path), image.imread(PLOT))
    doc["meta"]["date"] = "2000-01-01T00:00:00+00:00"  # what the picture does not show leaves it as it is
    assert np.array_equal(draw(doc, tmp_path), image.imread(PLOT))
