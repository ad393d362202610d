"""The encoding graph pictures each layer's RoPE where the layers differ: `layer_frequencies` [layers, d_rot/2]
holds every layer's pair frequencies, zeros where a layer rotates nothing.  Proven against transformers' own
rotary embeddings (Gemma 3's per-layer-type tables, SmolLM3's and Cohere2's which-layers-rotate rules), run from
the artifact's encoding.onnx in onnxruntime, the graph the worker serves."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from tests.http.test_viewer import browser, wait_for  # noqa: F401  (browser: the fixture, a real Chromium)

FAMILIES = ["gemma3", "smollm3", "cohere2"]


def layer_frequencies(artifact, length=16):
    meta = json.loads((artifact / "model.json").read_text())
    names = [o["name"] for o in meta["encoding"]["outputs"]]
    assert "layer_frequencies" in names
    session = ort.InferenceSession(str(artifact / meta["encoding"]["file"]), providers=["CPUExecutionProvider"])
    out = dict(zip(names, session.run(names, {"positions": np.arange(length, dtype=np.int64)}), strict=True))
    return out["layer_frequencies"], out["rotary_frequencies"]


def reference(hf):
    """Each layer's inverse frequencies as transformers rotates it (None: no RoPE in that layer), read from the
    model's own rotary module and its config's layer rules."""
    cfg, rotary = hf.config, hf.model.rotary_emb
    rows = []
    for i, kind in enumerate(cfg.layer_types if getattr(cfg, "layer_types", None) else ["full_attention"] * 2):
        if hasattr(rotary, f"{kind}_inv_freq"):  # Gemma 3: a table per layer type
            rows.append(getattr(rotary, f"{kind}_inv_freq"))  # its linear scaling already divides the table
        elif getattr(cfg, "no_rope_layers", None) is not None:  # SmolLM3: 1 = the layer uses RoPE
            rows.append(rotary.inv_freq if cfg.no_rope_layers[i] else None)
        elif cfg.model_type == "cohere2":  # Cohere2 rotates its sliding layers only
            rows.append(rotary.inv_freq if kind == "sliding_attention" else None)
        else:
            raise AssertionError(f"no reference rule for {cfg.model_type}")
    return rows


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layers_frequencies_are_transformers(hf_zoo, family):
    got, model_wide = layer_frequencies(hf_zoo[family]["artifact"])
    want = reference(hf_zoo[family]["hf"])
    assert got.shape[0] == len(want)
    for i, row in enumerate(want):
        if row is None:
            assert not got[i].any(), f"layer {i} rotates nothing in transformers"
        else:
            np.testing.assert_allclose(got[i], row.to(torch.float32).numpy(), rtol=1e-6, err_msg=f"layer {i}")
    assert any(np.array_equal(row, model_wide) for row in got), "the model-wide picture is one of its layers"


def test_a_model_whose_layers_agree_has_no_per_layer_output(hf_zoo):
    meta = json.loads((hf_zoo["qwen2"]["artifact"] / "model.json").read_text())
    assert "layer_frequencies" not in [o["name"] for o in meta["encoding"]["outputs"]]


def test_the_lab_picture_groups_the_layers_by_their_rope(hf_zoo, tmp_path):
    from lab.pictures import encoding_plot, layer_groups
    from protos.posenc.v1 import posenc_pb2 as pb

    got, _ = layer_frequencies(hf_zoo["smollm3"]["artifact"])
    labels = [label for label, _ in layer_groups(got)]
    nope = [i for i, uses in enumerate(hf_zoo["smollm3"]["hf"].config.no_rope_layers) if not uses]
    assert f"layer {nope[0]}: no RoPE" in labels and len(labels) == 2
    artifact = hf_zoo["gemma3"]["artifact"]
    meta = json.loads((artifact / "model.json").read_text())
    names = [o["name"] for o in meta["encoding"]["outputs"]]
    session = ort.InferenceSession(str(artifact / meta["encoding"]["file"]), providers=["CPUExecutionProvider"])
    arrays = session.run(names, {"positions": np.arange(16, dtype=np.int64)})
    resp = pb.EncodingResponse(model="gemma3", variant="rope", tensors=[
        pb.Tensor(name=n, shape=list(a.shape), data=a.astype("<f4").tobytes()) for n, a in zip(names, arrays,
                                                                                                strict=True)])
    assert len(layer_groups(arrays[names.index("layer_frequencies")])) == 2  # local base 100, global 1e6 x 4
    png = encoding_plot(resp, tmp_path / "e.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "e.png").read_bytes() == png


@pytest.fixture(scope="module")
def served(hf_zoo, tmp_path_factory):
    import shutil

    from tests.serving import start

    models = tmp_path_factory.mktemp("served-layers")
    for family in ("smollm3", "gemma3"):
        shutil.copytree(hf_zoo[family]["artifact"], models / family)
    srv = start(models, http_port=0)
    yield srv
    srv.stop(grace=1)


def test_the_viewer_draws_each_layers_rope_and_greys_a_nope_layer(served, hf_zoo, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    browser.get(f"http://127.0.0.1:{served.http_port}/")
    wait_for(browser, 'body[data-state="ready"]', timeout=10)
    field = browser.find_element(By.ID, "prompt")
    field.clear()
    field.send_keys("positions differ by layer")
    browser.find_element(By.ID, "run").click()
    wait_for(browser, 'body[data-state="done"]', timeout=15)
    uses_rope = hf_zoo["smollm3"]["hf"].config.no_rope_layers
    for family, rope_rows in (("smollm3", uses_rope), ("gemma3", [1, 1])):
        panel = browser.find_element(By.CSS_SELECTOR, f'.panel[data-model="{family}"]')
        canvas = wait_for(panel, "canvas.encoding[data-tensors]")
        assert canvas.get_attribute("data-tensors").split(",")[0] == "layer_frequencies"
        for layer, rotates in enumerate(rope_rows):  # the middle of layer `layer`'s strip, near its left end
            rgb = browser.execute_script(
                "const c = arguments[0], r = c.width / 300, rows = arguments[1], rh = (160 - 16 - 12) / rows;"
                "const y = Math.round((16 + (arguments[2] + 0.5) * rh) * r);"
                "return Array.from(c.getContext('2d').getImageData(Math.round(3 * r), y, 1, 1).data.slice(0, 3));",
                canvas, len(rope_rows), layer)
            assert (rgb == [232, 234, 237]) == (not rotates), (family, layer, rgb)
