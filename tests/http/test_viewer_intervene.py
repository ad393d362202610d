"""The viewer's intervention controls in a real Chromium against a real worker: the shift and stretch sliders, a
layer's encoding switched off, a head ablated by a click on its thumbnail, and reset.  With an intervention set, the
page's numbers (KL, total variation, the intervened and the baseline top-k, the positions, the chosen map's row of
both runs, the profile of both) equal posenc.v1 Predict and Profile over gRPC for the same intervention, built here
from what the test did; a shift leaves rope's next-token distribution as it was and changes learned's; an
intervention the model cannot take shows the worker's error line, and the page goes on working."""

from __future__ import annotations

import json
import shutil

import grpc
import numpy as np
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.http.test_viewer import ask, browser, wait_for  # noqa: F401  (browser: the fixture, a real Chromium)
from tests.serving import start

PROMPT = "the cat sat"  # 11 byte tokens: learned's 16 positions leave shifts up to 5
T = len(PROMPT)
MODELS = ("rope", "learned")


@pytest.fixture(scope="module")
def served(artifact_root, tmp_path_factory):
    """A worker (gRPC and HTTP on free loopback ports) serving copies of the tiny rope and learned artifacts."""
    root = tmp_path_factory.mktemp("intervene")
    for name in MODELS:
        shutil.copytree(artifact_root / name, root / name)
    srv = start(root, http_port=0)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        yield srv, posenc_pb2_grpc.PosencStub(channel)
    srv.stop(grace=1)


def settled(driver, panel, want: dict | None) -> None:
    """Wait until the panel shows the answer to the intervention `want` (the JSON its requests carried; None: none)."""
    def shown(_):
        if panel.get_attribute("data-iv") != "done":
            return False
        text = panel.get_attribute("data-intervention")
        return (json.loads(text) if text else None) == want
    WebDriverWait(driver, 60).until(shown, f"the panel never showed {want}: {panel.get_attribute('data-iv')}, "
                                           f"{panel.get_attribute('data-intervention')}")


def candidates(panel, css: str) -> tuple[list[int], list[float], list[str]]:
    items = panel.find_elements(By.CSS_SELECTOR, f"{css} li")
    return ([int(li.get_attribute("data-token-id")) for li in items],
            [float(li.get_attribute("data-probability")) for li in items],
            [li.find_element(By.CSS_SELECTOR, ".p").get_attribute("textContent") for li in items])


def assert_top(panel, css: str, want) -> None:
    ids, probs, texts = candidates(panel, css)
    assert ids == [c.token.id for c in want], css
    np.testing.assert_allclose(probs, [c.probability for c in want], rtol=0, atol=1e-6)
    assert texts == [f"{100 * c.probability:.1f}%" for c in want]  # what is read: the display rounding of the same


def row(amap, query: int) -> np.ndarray:
    return np.frombuffer(amap.data, "<f4").reshape(amap.shape)[query - amap.query_start]


def floats(attr: str) -> list[float]:
    return [float(x) for x in attr.split(",")]


def assert_shows(panel, stub, model: str, iv: pb.Intervention, positions: list[int]) -> pb.PredictResponse:
    """The panel's numbers under `iv` are gRPC Predict's for the same prompt and intervention."""
    out = panel.find_element(By.CSS_SELECTOR, "output.attention-row")
    layer, head, query = (int(out.get_attribute(f"data-{k}")) for k in ("layer", "head", "query"))
    want = stub.Predict(pb.PredictRequest(model=model, prompt=pb.Prompt(text=PROMPT), top_k=10,
                                          attention=pb.ATTENTION_FULL, layers=[layer], heads=[head], intervention=iv),
                        timeout=30)
    effect = want.effect
    assert effect.has_baseline and list(effect.positions) == positions
    line = panel.find_element(By.CSS_SELECTOR, ".effect")
    assert line.is_displayed()
    assert floats(line.get_attribute("data-positions")) == positions
    assert float(line.get_attribute("data-kl")) == pytest.approx(effect.kl_divergence, abs=1e-7)
    assert float(line.get_attribute("data-tv")) == pytest.approx(effect.total_variation, abs=1e-7)
    assert float(line.get_attribute("data-js")) == pytest.approx(effect.js_divergence, abs=1e-7)
    assert line.get_attribute("data-top1-changed") == str(effect.top1_changed).lower()
    assert f"KL {effect.kl_divergence:.4f} nats" in line.text and f"total variation {effect.total_variation:.4f}" \
        in line.text
    assert_top(panel, ".top", want.top)
    assert_top(panel, ".top-base", effect.baseline_top)
    assert panel.find_element(By.CSS_SELECTOR, ".run-base").is_displayed()
    np.testing.assert_allclose(floats(out.get_attribute("data-weights")), row(want.attention[0], query),
                               rtol=0, atol=1e-6)
    np.testing.assert_allclose(floats(out.get_attribute("data-baseline-weights")),
                               row(effect.baseline_attention[0], query), rtol=0, atol=1e-6)
    diff = panel.find_element(By.CSS_SELECTOR, "canvas.map-diff")
    assert (diff.get_attribute("data-layer"), diff.get_attribute("data-head")) == (str(layer), str(head))
    largest = np.abs(np.frombuffer(want.attention[0].data, "<f4").astype(np.float64)
                     - np.frombuffer(effect.baseline_attention[0].data, "<f4")).max()
    assert float(diff.get_attribute("data-scale")) == pytest.approx(largest, abs=1e-7)
    return want


def assert_profiles(panel, stub, model: str, iv: pb.Intervention) -> None:
    """The profile grid (heads averaged) of the intervened run and of the baseline are gRPC Profile's."""
    want = stub.Profile(pb.ProfileRequest(model=model, prompt=pb.Prompt(text=PROMPT), intervention=iv), timeout=30)
    shape = tuple(want.shape)
    served = np.frombuffer(want.values, "<f4").reshape(shape).astype(np.float64).mean(1)
    base = np.frombuffer(want.effect.baseline_profile, "<f4").reshape(shape).astype(np.float64).mean(1)
    section = wait_for(panel, '.profile[data-state="done"]', timeout=10)
    for css, grid in (("canvas.profile-map", served), ("canvas.profile-base", base),
                      ("canvas.profile-diff", served - base)):
        canvas = section.find_element(By.CSS_SELECTOR, css)
        np.testing.assert_allclose(np.reshape(floats(canvas.get_attribute("data-values")), grid.shape), grid,
                                   rtol=0, atol=1e-7, err_msg=css)
    assert np.abs(served - base).max() > 1e-4  # the intervention moved attention between distances


def press(element, key, times: int) -> None:
    for _ in range(times):
        element.send_keys(key)


def test_the_viewers_interventions_are_what_grpc_answers(served, browser):  # noqa: F811
    srv, stub = served
    ask(browser, f"http://127.0.0.1:{srv.http_port}/", MODELS, PROMPT)
    rope, learned = (browser.find_element(By.CSS_SELECTOR, f'.panel[data-model="{m}"]') for m in MODELS)
    for panel in (rope, learned):
        settled(browser, panel, None)
        assert not panel.find_element(By.CSS_SELECTOR, ".effect").is_displayed()

    # rope: a shift of 3 (three steps of the slider from the keyboard) leaves the next-token distribution unchanged
    shift = rope.find_element(By.CSS_SELECTOR, "input.iv-shift")
    assert shift.get_attribute("max") == "512"  # no limit on rope's positions: the slider's own end
    press(shift, Keys.ARROW_RIGHT, 3)
    settled(browser, rope, {"shift": 3, "baseline": True})
    got = assert_shows(rope, stub, "rope", pb.Intervention(shift=3, baseline=True), list(range(3, 3 + T)))
    assert got.effect.kl_divergence < 1e-6 and not got.effect.top1_changed  # RoPE's attention is relative

    # rope: layer 0's positions switched off as well: the distribution and the profile by distance change
    assert len(rope.find_elements(By.CSS_SELECTOR, "input.iv-layer")) == 2
    rope.find_element(By.CSS_SELECTOR, 'input.iv-layer[data-layer="0"]').click()
    settled(browser, rope, {"shift": 3, "positional_off": [0], "baseline": True})
    iv = pb.Intervention(shift=3, positional_off=[0], baseline=True)
    got = assert_shows(rope, stub, "rope", iv, list(range(3, 3 + T)))
    assert got.effect.kl_divergence > 1e-4
    assert_profiles(rope, stub, "rope", iv)

    # rope: in ablation mode a click on a thumbnail ablates its head (marked), a second click gives it back
    rope.find_element(By.CSS_SELECTOR, "input.iv-ablating").click()
    thumb = rope.find_element(By.CSS_SELECTOR, '.thumbs button[data-layer="0"][data-head="2"]')
    thumb.click()
    settled(browser, rope, {"shift": 3, "positional_off": [0], "ablate_heads": [{"layer": 0, "head": 2}],
                            "baseline": True})
    thumb = rope.find_element(By.CSS_SELECTOR, '.thumbs button[data-layer="0"][data-head="2"]')
    assert thumb.get_attribute("data-ablated") == "true" and "ablated" in thumb.get_attribute("class")
    assert [b.get_attribute("data-ablated") for b in rope.find_elements(By.CSS_SELECTOR, ".thumbs button")
            ].count("true") == 1
    iv = pb.Intervention(shift=3, positional_off=[0], ablate_heads=[pb.HeadRef(layer=0, head=2)], baseline=True)
    assert_shows(rope, stub, "rope", iv, list(range(3, 3 + T)))
    thumb.click()
    settled(browser, rope, {"shift": 3, "positional_off": [0], "baseline": True})
    thumb = rope.find_element(By.CSS_SELECTOR, '.thumbs button[data-layer="0"][data-head="2"]')
    assert thumb.get_attribute("data-ablated") == "false"

    # rope: reset: no intervention, no baseline, the plain Predict's numbers
    rope.find_element(By.CSS_SELECTOR, "button.iv-reset").click()
    settled(browser, rope, None)
    assert shift.get_attribute("value") == "0"
    assert not rope.find_element(By.CSS_SELECTOR, ".effect").is_displayed()
    assert not rope.find_element(By.CSS_SELECTOR, ".run-base").is_displayed()
    assert not rope.find_element(By.CSS_SELECTOR, ".iv-maps").is_displayed()
    plain = stub.Predict(pb.PredictRequest(model="rope", prompt=pb.Prompt(text=PROMPT), top_k=10), timeout=30)
    assert_top(rope, ".top", plain.top)

    # learned: its 16 positions end the shift slider at 16 - 11 = 5; a shift of 3 changes the distribution
    shift = learned.find_element(By.CSS_SELECTOR, "input.iv-shift")
    assert shift.get_attribute("max") == str(16 - T)
    press(shift, Keys.ARROW_RIGHT, 3)
    settled(browser, learned, {"shift": 3, "baseline": True})
    got = assert_shows(learned, stub, "learned", pb.Intervention(shift=3, baseline=True), list(range(3, 3 + T)))
    assert got.effect.kl_divergence > 1e-3  # a learned table is absolute
    assert not learned.find_element(By.CSS_SELECTOR, ".iv-layers").is_displayed()  # it adds positions to embeddings
    assert "not computed inside the layers" in learned.find_element(By.CSS_SELECTOR, ".iv-note").text

    # learned: stretched by 4 its last token would sit at 40: the worker's error line, the last answer kept
    stretch = learned.find_element(By.CSS_SELECTOR, "input.iv-stretch")
    browser.execute_script("arguments[0].value = 4; arguments[0].dispatchEvent(new Event('input'));"
                           "arguments[0].dispatchEvent(new Event('change'))", stretch)  # the slider released at 4
    WebDriverWait(browser, 60).until(lambda _: learned.get_attribute("data-iv") == "error")
    assert shift.get_attribute("value") == "0"  # nothing left to shift into
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(pb.PredictRequest(model="learned", prompt=pb.Prompt(text=PROMPT),
                                       intervention=pb.Intervention(stretch=4, baseline=True)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() in learned.find_element(By.CSS_SELECTOR, ".iv-error").text
    assert json.loads(learned.get_attribute("data-intervention")) == {"shift": 3, "baseline": True}
    assert_shows(learned, stub, "learned", pb.Intervention(shift=3, baseline=True), list(range(3, 3 + T)))
    learned.find_element(By.CSS_SELECTOR, "button.iv-reset").click()
    settled(browser, learned, None)
    assert learned.find_element(By.CSS_SELECTOR, ".iv-error").text == ""
    assert rope.get_attribute("data-state") == learned.get_attribute("data-state") == "done"

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and " 400 " not in e["message"]]
    assert not errors, errors  # only the refused intervention's answer
