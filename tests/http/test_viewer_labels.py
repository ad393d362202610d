"""The viewer's encoding pictures, in a real Chromium, keep every title readable: each output drawn (its name and
shape, as posenc.v1 Encoding answers them) has a title of its own over its own picture, and no two labels of the
encoding column (heading, titles, value ranges, note) overlap, at a wide, a middle and a narrow window, for models
with several encoding outputs (rope: four; a rope whose first layer rotates nothing: five, of which the per-layer
picture stands for rotary_frequencies) and one with a single output (alibi)."""

from __future__ import annotations

import shutil

import grpc
import numpy as np
import pytest
from selenium.webdriver.common.by import By

from export.build import build_artifact
from model.config import LayerSpec
from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.http.test_viewer import ask, browser, wait_for  # noqa: F401  (browser: the fixture, a real Chromium)
from tests.model.helpers import tiny_model
from tests.serving import start

PROMPT = "the cat sat on"
NOPE = "rope-nope0"  # layer 0 without RoPE: its encoding graph adds layer_frequencies
MODELS = ("rope", NOPE, "alibi")
WIDTHS = (1440, 1000, 600)  # two panels a row (encoding column ~330 px), two narrower (~220 px), one a row


@pytest.fixture(scope="module")
def served(artifact_root, tmp_path_factory):
    """A worker serving copies of the tiny rope and alibi artifacts and a tiny rope exported with a NoPE layer."""
    root = tmp_path_factory.mktemp("labels")
    for name in ("rope", "alibi"):
        shutil.copytree(artifact_root / name, root / name)
    build_artifact(tiny_model("rope", layers=[LayerSpec(encoding="none"), LayerSpec()]), root / NOPE, name=NOPE,
                   opset=23, source={"kind": "random", "preset": "tiny"}, training={}, force=False, interventions=False)
    srv = start(root, http_port=0)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        yield srv, posenc_pb2_grpc.PosencStub(channel)
    srv.stop(grace=1)


def title(t: pb.Tensor) -> str:
    """What the viewer titles a picture: its name and shape (a 3-D output shows its first slice)."""
    return f"{t.name}{'[0]' if len(t.shape) > 2 else ''} [{'×'.join(map(str, t.shape))}]"


def log_range(values: np.ndarray) -> str:
    """The range the viewer's frequency pictures are coloured over: 10^lo..10^hi radians per position, hi at least
    0 and lo at least a decade under it, over the nonzero frequencies."""
    logs = np.log10(values[values > 0].astype(np.float64))
    hi = max(0.0, logs.max())
    lo = min(hi - 1, logs.min())
    return f"10^{lo:.1f}..10^{hi:.1f} rad/pos"


# Every element of the encoding column that holds text of its own, with its box and what is drawn of it.
LABELS = """
const col = arguments[0].querySelector("canvas.encoding").parentElement, out = [];
for (const el of col.querySelectorAll("*")) {
  const own = Array.from(el.childNodes).filter((n) => n.nodeType === Node.TEXT_NODE).map((n) => n.textContent)
    .join("").trim();
  if (!own) continue;
  const r = el.getBoundingClientRect(), s = getComputedStyle(el);
  out.push({text: el.textContent, cls: el.className, tag: el.tagName, tip: el.title, left: r.left, right: r.right,
            top: r.top, bottom: r.bottom, clipped: el.scrollWidth > el.clientWidth + 1,
            seen: s.visibility === "visible" && Number(s.opacity) > 0 && s.display !== "none"});
}
const c = col.querySelector("canvas.encoding"), b = c.getBoundingClientRect(), p = arguments[0].getBoundingClientRect();
return {labels: out, canvas: {left: b.left + c.clientLeft, top: b.top, bottom: b.bottom, width: c.clientWidth},
        panel: {left: p.left, right: p.right, top: p.top, bottom: p.bottom}};
"""


def overlap(a: dict, b: dict) -> bool:
    return a["left"] < b["right"] and b["left"] < a["right"] and a["top"] < b["bottom"] and b["top"] < a["bottom"]


def test_no_two_encoding_labels_overlap(served, browser):  # noqa: F811
    srv, stub = served
    ask(browser, f"http://127.0.0.1:{srv.http_port}/", MODELS, PROMPT)

    for model in MODELS:
        panel = browser.find_element(By.CSS_SELECTOR, f'.panel[data-model="{model}"]')
        shown = wait_for(panel, "canvas.encoding[data-tensors]").get_attribute("data-tensors").split(",")
        length = len(panel.find_elements(By.CSS_SELECTOR, ".tok"))
        answer = stub.Encoding(pb.EncodingRequest(model=model, length=length), timeout=30)
        tensors = {t.name: t for t in answer.tensors}
        outputs = {"rope": ["rotary_cos", "rotary_sin", "rotary_scores", "rotary_frequencies"],
                   NOPE: ["rotary_cos", "rotary_sin", "rotary_scores", "rotary_frequencies", "layer_frequencies"],
                   "alibi": ["score_bias"]}[model]
        assert sorted(tensors) == sorted(outputs), (model, list(tensors))
        drawn = [n for n in outputs if n != "rotary_frequencies"] if model == NOPE else outputs  # the per-layer
        assert sorted(shown) == sorted(drawn), (model, shown)  # picture holds rotary_frequencies' row
        want_titles = [title(tensors[n]) for n in shown]
        want_ranges = [log_range(np.frombuffer(tensors[n].data, "<f4")) for n in shown
                       if n in ("rotary_frequencies", "layer_frequencies")]

        for width in WIDTHS:
            browser.set_window_size(width, 1100)
            browser.execute_script("arguments[0].scrollIntoView()", panel)
            got = browser.execute_script(LABELS, panel)
            labels, canvas, box = got["labels"], got["canvas"], got["panel"]
            where = f"{model} at {width} px"
            texts = [x["text"] for x in labels]
            assert len(labels) >= len(shown) + 1, (where, texts)  # the heading and a title per picture at least
            for want in want_titles + want_ranges:
                assert texts.count(want) == 1, (where, want, texts)
            for x in labels:
                assert x["right"] - x["left"] > 0 and x["bottom"] - x["top"] > 0 and x["seen"], (where, x)
                assert not x["clipped"] or x["tip"] == x["text"], (where, x)  # cut short only with the full text
                # inside its panel, so clear of the panels beside it
                assert box["left"] <= x["left"] and x["right"] <= box["right"], (where, x, box)
            for i, a in enumerate(labels):
                for b in labels[i + 1:]:
                    assert not overlap(a, b), (where, a, b)
            # each title over its own picture (the canvas is 300 units wide, the pictures 6 apart) and clear of it
            n, scale = len(shown), canvas["width"] / 300
            w = (300 - 6 * (n - 1)) / n
            for k, want in enumerate(want_titles):
                (x,) = [x for x in labels if x["text"] == want]
                left = canvas["left"] + k * (w + 6) * scale
                assert left - 1 <= x["left"] and x["right"] <= left + w * scale + 1, (where, want, x, left)
                assert x["bottom"] <= canvas["top"] + 0.5, (where, want, x, canvas)
