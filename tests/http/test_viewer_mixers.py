"""The viewer on hybrid models, in a real Chromium: a tiny LFM2 (short-convolution layers around an attention layer)
and a tiny Granite 4.0-H (Mamba-2 layers around a NoPE attention layer), saved and imported as tests/hf builds them
and served by a real worker on loopback.  Each layer is labelled with its
kind in the layer picker and the grid; a conv layer's map is painted on a diverging ramp scaled by the map's largest
|m|, which its caption names, every cell's colour on the side of white its served value's sign is; the attention
layer's map is painted on the heat ramp of its weights, as every attention map is.  A layer's mixer's own
matrices (Predict's mixer_maps), a Mamba-2 layer's beside Falcon-H1's attention included, are drawn on request and
one of them large, signed, cell by cell as served.  The served values are the worker's JSON API's (POST
/v1/posenc/predict) for the same prompt."""

from __future__ import annotations

import base64
import json
import math
import shutil

import numpy as np
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.hf.conftest import hf_zoo  # noqa: F401  (the fixture: tests/hf's families, exported once per run)
from tests.http.conftest import Http
from tests.http.test_viewer import ask, browser, wait_for  # noqa: F401  (browser: the fixture, a real Chromium)
from tests.serving import start

NAME, PROMPT = "lfm2", "the cat sat on the mat"
LEVELS = 1024  # maps.js paints from a table of this many colours per ramp


GRANITE = "granitemoehybrid"  # Granite 4.0-H's shape: Mamba-2 layers around a NoPE attention layer
FALCON = "falcon_h1"  # every layer a Mamba-2 layer beside its attention


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, hf_zoo):  # noqa: F811
    """(worker, each layer's mixer as model.json records it, per model): tests/hf's tiny LFM2, Granite 4.0-H and
    Falcon-H1, the zoo's imports (shared with tests/hf/test_mixers.py), served."""
    root = tmp_path_factory.mktemp("hybrid")
    mixers = {}
    for name in (NAME, GRANITE, FALCON):
        shutil.copytree(hf_zoo[name]["artifact"], root / "models" / name)
        mixers[name] = [layer["mixer"] for layer in
                        json.loads((root / "models" / name / "model.json").read_text())["layers"]]
    srv = start(root / "models", http_port=0)
    yield srv, mixers
    srv.stop(grace=1)


def served_maps(port: int, name: str = NAME) -> dict[tuple[int, int], np.ndarray]:
    status, p = Http(port).json("POST", "/v1/posenc/predict", {"model": name, "prompt": {"text": PROMPT},
                                                                "attention": "ATTENTION_FULL"})
    assert status == 200, p
    return {(a["layer"], a["head"]): np.frombuffer(base64.b64decode(a["data"]), "<f4").reshape(a["shape"])
            for a in p["attention"]}


def mix(stops, t: float) -> np.ndarray:
    """maps.js's mix: the colour at t in [0, 1] along the stops, each channel rounded half up."""
    t = max(0.0, min(1.0, t)) * (len(stops) - 1)
    i = min(math.floor(t), len(stops) - 2)
    f = t - i
    return np.array([math.floor(a + f * (b - a) + 0.5) for a, b in zip(stops[i], stops[i + 1], strict=True)])


def painted(stops, t: float, curve=lambda x: x) -> np.ndarray:
    """The colour a map's cell gets: t in [0, 1] taken to the nearest of LEVELS steps, then along the stops."""
    j = math.floor(max(0.0, min(1.0, t)) * (LEVELS - 1) + 0.5)
    return mix(stops, curve(j / (LEVELS - 1)))


PIXELS = """
const [canvas] = arguments, [margin, cw, ch] = canvas.dataset.geometry.split(",").map(Number);
const r = canvas.width / parseFloat(canvas.style.width), rows = Number(canvas.dataset.rows);
const keys = Number(canvas.dataset.keys), img = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
const out = [];
for (let q = 0; q < rows; q++) {
  for (let k = 0; k < keys; k++) {
    const x = Math.floor((margin + (k + 0.5) * cw) * r), y = Math.floor((margin + (q + 0.5) * ch) * r);
    out.push(Array.from(img.data.slice(4 * (y * canvas.width + x), 4 * (y * canvas.width + x) + 3)));
  }
}
return out;"""


def cell_colours(canvas, rows: int, keys: int) -> np.ndarray:
    """[rows, keys, 3]: the colour at the centre of each cell of the large map, as the page drew it."""
    return np.array(canvas.parent.execute_script(PIXELS, canvas), dtype=int).reshape(rows, keys, 3)


def test_a_hybrid_models_conv_layers_are_painted_signed_beside_its_attention_layer(hybrid, browser):  # noqa: F811
    srv, mixers = hybrid
    mixers = mixers[NAME]
    assert "short_conv" in mixers and "attention" in mixers  # the model is a hybrid
    maps = served_maps(srv.http_port)
    ask(browser, f"http://127.0.0.1:{srv.http_port}/", (NAME,), PROMPT)
    panel = browser.find_element(By.CSS_SELECTOR, f'.panel[data-model="{NAME}"]')
    assert panel.get_attribute("data-state") == "done"
    stops = browser.execute_async_script(  # the page's own ramps (maps.js): heat's stops, the diverging one's
        "const done = arguments[0]; import('/viewer/maps.js').then((m) => done({seq: m.SEQ, div: m.DIV}));")

    # each layer named by its kind in the picker and as the grid's row header, with where its order comes from
    want = [f"{layer} · {mixer}" for layer, mixer in enumerate(mixers)]
    picker = Select(panel.find_element(By.CSS_SELECTOR, "select.layer"))
    assert [o.text for o in picker.options] == want
    headers = panel.find_elements(By.CSS_SELECTOR, ".thumbs .layer-kind")
    assert [h.text for h in headers] == want
    assert [h.get_attribute("data-mixer") for h in headers] == mixers
    for h, mixer in zip(headers, mixers, strict=True):
        assert (mixer + " mixer" if mixer != "attention" else "attention") in h.get_attribute("title")
        assert "order from its kernel" in h.get_attribute("title") or mixer == "attention"

    def show(layer: int):
        picker.select_by_value(str(layer))
        canvas = panel.find_element(By.CSS_SELECTOR, "canvas.heatmap")
        WebDriverWait(browser, 10).until(lambda _: canvas.get_attribute("data-layer") == str(layer))
        return canvas, panel.find_element(By.CSS_SELECTOR, ".map-scale")

    conv = mixers.index("short_conv")
    m = maps[(conv, 0)].astype(np.float64)
    scale = float(np.abs(m).max())
    assert (m < 0).any() and (m > 0).any()  # signed rows: both sides of white are to be seen
    canvas, caption = show(conv)
    assert canvas.get_attribute("data-paint") == "signed"
    assert float(canvas.get_attribute("data-scale")) == pytest.approx(scale, rel=1e-6)
    assert caption.is_displayed()
    assert caption.text.startswith(f"short_conv: signed matrix rows, scaled by max |m| = {scale:.4f}")
    colours = cell_colours(canvas, *m.shape)
    want_colours = np.array([[painted(stops["div"], 0.5 + 0.5 * v / scale) for v in row] for row in m])
    np.testing.assert_allclose(colours, want_colours, rtol=0, atol=1)
    red, blue = colours[..., 0], colours[..., 2]
    strong = np.abs(m) > 0.05 * scale
    assert (red[strong & (m > 0)] > blue[strong & (m > 0)]).all()  # red where the served value is positive
    assert (blue[strong & (m < 0)] > red[strong & (m < 0)]).all()  # blue where it is negative
    row = panel.find_element(By.CSS_SELECTOR, "output.attention-row")
    assert f"layer {conv} (short_conv), head 0" in row.text and "m = " in row.text and "%" not in row.text
    shown = np.array([float(x) for x in row.get_attribute("data-weights").split(",")])
    np.testing.assert_allclose(shown, maps[(conv, 0)][int(row.get_attribute("data-query"))], rtol=0, atol=1e-7)

    attention = mixers.index("attention")
    a = maps[(attention, 0)].astype(np.float64)
    canvas, caption = show(attention)
    assert canvas.get_attribute("data-paint") == "attention" and canvas.get_attribute("data-scale") is None
    assert not caption.is_displayed()
    want_colours = np.array([[painted(stops["seq"], v, math.sqrt) for v in r] for r in a])
    np.testing.assert_allclose(cell_colours(canvas, *a.shape), want_colours, rtol=0, atol=1)
    assert "attends most to" in row.text

    # the note's words for a layer with no attention make it a mixer even where the page has no name for it
    kinds = browser.execute_async_script(
        "const [note, done] = arguments; import('/viewer/layers.js').then((m) => done(m.layerKinds(note, 3)));",
        "layer 0: a state-space layer, no attention (order from its recurrence); layers 1, 2: RoPE base 10000")
    assert [k["mixer"] for k in kinds] == ["mixer", "attention", "attention"]
    # export/encoding.py's own words: a Gated DeltaNet layer is named so; a layer with a Mamba-2 layer beside its
    # attention (Falcon-H1) stays an attention layer
    kinds = browser.execute_async_script(
        "const [note, done] = arguments; import('/viewer/layers.js').then((m) => done(m.layerKinds(note, 3)));",
        "layers 0, 2: a Gated DeltaNet layer, no attention (order from its decaying delta-rule state and a convolution "
        "over 4 tokens); layer 1: RoPE base 1000 beside a Mamba-2 state-space layer (order also from its recurrence "
        "and a convolution over 4 tokens)")
    assert [k["mixer"] for k in kinds] == ["gated_deltanet", "attention", "gated_deltanet"]

    # a conv layer's encoding cannot be switched off (its order is its kernel's): its box is disabled, named
    for layer, mixer in enumerate(mixers):
        tick = panel.find_element(By.CSS_SELECTOR, f'.iv-layer[data-layer="{layer}"]')
        assert tick.is_enabled() == (mixer == "attention")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_a_granite_shaped_models_mamba2_and_nope_attention_layers_side_by_side(hybrid, browser):  # noqa: F811
    """Granite 4.0-H's shape: the grid names layers 0 and 2 mamba2 and layer 1 attention, and each Mamba-2 map is
    painted signed, cell by cell as the worker serves it, beside the NoPE attention layer's weights."""
    srv, mixers = hybrid
    assert mixers[GRANITE] == ["mamba2", "attention", "mamba2"]
    maps = served_maps(srv.http_port, GRANITE)
    ask(browser, f"http://127.0.0.1:{srv.http_port}/", (GRANITE,), PROMPT)
    panel = browser.find_element(By.CSS_SELECTOR, f'.panel[data-model="{GRANITE}"]')
    assert panel.get_attribute("data-state") == "done"
    headers = panel.find_elements(By.CSS_SELECTOR, ".thumbs .layer-kind")
    assert [h.text for h in headers] == ["0 · mamba2", "1 · attention", "2 · mamba2"]
    assert "Mamba-2 state-space layer" in headers[0].get_attribute("title")
    stops = browser.execute_async_script(
        "const done = arguments[0]; import('/viewer/maps.js').then((m) => done({seq: m.SEQ, div: m.DIV}));")
    picker = Select(panel.find_element(By.CSS_SELECTOR, "select.layer"))
    for layer in (0, 1):
        picker.select_by_value(str(layer))
        canvas = panel.find_element(By.CSS_SELECTOR, "canvas.heatmap")
        WebDriverWait(browser, 10).until(lambda _, c=canvas, n=layer: c.get_attribute("data-layer") == str(n))
        m = maps[(layer, 0)].astype(np.float64)
        if layer == 0:
            scale = float(np.abs(m).max())
            assert canvas.get_attribute("data-paint") == "signed"
            want = np.array([[painted(stops["div"], 0.5 + 0.5 * v / scale) for v in row] for row in m])
        else:
            assert canvas.get_attribute("data-paint") == "attention"
            want = np.array([[painted(stops["seq"], v, math.sqrt) for v in row] for row in m])
        np.testing.assert_allclose(cell_colours(canvas, *m.shape), want, rtol=0, atol=1)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def served_mixer_maps(port: int, name: str, layer: int) -> dict[int, np.ndarray]:
    status, p = Http(port).json("POST", "/v1/posenc/predict", {"model": name, "prompt": {"text": PROMPT},
                                                                "attention": "ATTENTION_FULL", "layers": [layer],
                                                                "mixer_maps": True})
    assert status == 200, p
    return {a["head"]: np.frombuffer(base64.b64decode(a["data"]), "<f4").reshape(a["shape"])
            for a in p["mixer_maps"] if a["layer"] == layer}


@pytest.mark.parametrize(("name", "layer", "matrix"), [(FALCON, 1, 5), (GRANITE, 0, 6)])
def test_a_layers_mixer_matrices_are_drawn_on_request_and_one_large_signed_as_served(  # noqa: F811
        hybrid, browser, name, layer, matrix):  # noqa: F811
    """Falcon-H1's Mamba-2 layer beside its attention (whose maps stay the attention's) and a Granite Mamba-2 layer
    (8 heads under its 4 map heads): the button asks for the layer's matrices, one thumbnail per head with its own
    max |m|, and the one clicked is painted large on the diverging ramp, every cell as the worker serves it."""
    srv, _ = hybrid
    exact = served_mixer_maps(srv.http_port, name, layer)
    assert sorted(exact) == list(range(8))  # transformers' mamba_n_heads in tests/hf/helpers.py
    ask(browser, f"http://127.0.0.1:{srv.http_port}/", (name,), PROMPT)
    panel = browser.find_element(By.CSS_SELECTOR, f'.panel[data-model="{name}"]')
    Select(panel.find_element(By.CSS_SELECTOR, "select.layer")).select_by_value(str(layer))
    box = panel.find_element(By.CSS_SELECTOR, ".mixer-maps")
    WebDriverWait(browser, 10).until(lambda _: box.get_attribute("data-layer") == str(layer) and box.is_displayed())
    canvas = panel.find_element(By.CSS_SELECTOR, "canvas.heatmap")
    WebDriverWait(browser, 10).until(lambda _: canvas.get_attribute("data-layer") == str(layer))
    assert canvas.get_attribute("data-paint") == ("attention" if name == FALCON else "signed")
    button = box.find_element(By.CSS_SELECTOR, ".mixer-load")
    assert "8" in button.text
    button.click()
    WebDriverWait(browser, 20).until(lambda _: box.get_attribute("data-state") == "done")
    thumbs = box.find_elements(By.CSS_SELECTOR, ".mixer-thumbs button")
    assert [int(t.get_attribute("data-head")) for t in thumbs] == list(range(8))
    for t in thumbs:
        want = float(np.abs(exact[int(t.get_attribute("data-head"))]).max())
        assert float(t.get_attribute("data-scale")) == pytest.approx(want, rel=1e-6)
    thumbs[matrix].click()
    WebDriverWait(browser, 10).until(lambda _: canvas.get_attribute("data-source") == "mixer")
    assert canvas.get_attribute("data-paint") == "signed" and canvas.get_attribute("data-head") == str(matrix)
    m = exact[matrix].astype(np.float64)
    scale = float(np.abs(m).max())
    assert float(canvas.get_attribute("data-scale")) == pytest.approx(scale, rel=1e-6)
    stops = browser.execute_async_script(
        "const done = arguments[0]; import('/viewer/maps.js').then((m) => done({div: m.DIV}));")
    want = np.array([[painted(stops["div"], 0.5 + 0.5 * v / scale) for v in row] for row in m])
    np.testing.assert_allclose(cell_colours(canvas, *m.shape), want, rtol=0, atol=1)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
