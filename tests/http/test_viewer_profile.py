"""The viewer's profile panel in a real Chromium against a real worker: the layer x distance grid it draws for the
prompt typed holds the served posenc.v1 Profile's values (heads averaged, and one head chosen in the page), and
the value under the cursor is the served one of that layer and column."""

import numpy as np
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from protos.posenc.v1 import posenc_pb2 as pb
from tests.http.test_viewer import browser, wait_for  # noqa: F401  (browser: the fixture, a real Chromium)

MODEL = "rope"
PROMPT = "the cat sat on the mat and looked at the dog, which sat on the rug"


def served(stub) -> tuple[np.ndarray, list[str]]:
    resp = stub.Profile(pb.ProfileRequest(model=MODEL, prompt=pb.Prompt(text=PROMPT)), timeout=60)
    return np.frombuffer(resp.values, "<f4").reshape(resp.shape).astype(np.float64), list(resp.columns)


def shown(canvas) -> tuple[np.ndarray, list[str]]:
    columns = canvas.get_attribute("data-columns").split(",")
    values = np.array([float(x) for x in canvas.get_attribute("data-values").split(",")])
    return values.reshape(int(canvas.get_attribute("data-layers")), -1), columns


def test_the_profile_panel_shows_the_served_profile(rope_alone, browser):  # noqa: F811
    srv, stub, _ = rope_alone
    browser.get(f"http://127.0.0.1:{srv.http_port}/")
    wait_for(browser, 'body[data-state="ready"]', timeout=10)
    for box in browser.find_elements(By.CSS_SELECTOR, "#models input[type=checkbox]"):
        if box.is_selected() != (box.get_attribute("value") == MODEL):
            box.click()
    field = browser.find_element(By.ID, "prompt")
    field.clear()
    field.send_keys(PROMPT)
    browser.find_element(By.ID, "run").click()
    wait_for(browser, 'body[data-state="done"]', timeout=30)
    panel = browser.find_element(By.CSS_SELECTOR, f'.panel[data-model="{MODEL}"]')
    section = wait_for(panel, '.profile[data-state="done"]', timeout=10)
    want, columns = served(stub)
    assert columns == ["0", "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "first", "entropy"]
    drawn = [c for c in columns if c != "entropy"]  # masses; the entropy (nats) is read out, not coloured

    canvas = section.find_element(By.CSS_SELECTOR, "canvas.profile-map")
    grid, names = shown(canvas)
    assert names == drawn and grid.shape == (2, len(columns))
    np.testing.assert_allclose(grid, want.mean(1), rtol=0, atol=1e-7)  # heads averaged: the served values' mean
    assert np.allclose(grid[:, :8].sum(1), 1, atol=1e-5)  # a distribution over distances per layer

    Select(section.find_element(By.CSS_SELECTOR, "select.profile-head")).select_by_visible_text("head 2")
    wait_for(section, 'canvas.profile-map[data-head="2"]', timeout=5)
    grid, _ = shown(canvas)
    np.testing.assert_allclose(grid, want[:, 2], rtol=0, atol=1e-7)

    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    left, top, cw, ch, width = (float(x) for x in canvas.get_attribute("data-grid").split(","))
    for layer, column in ((0, "first"), (1, "2-3"), (1, "0")):  # the centre of each cell, in CSS pixels
        scale, rect = canvas.rect["width"] / width, canvas.rect
        x, y = (left + (drawn.index(column) + 0.5) * cw) * scale, (top + (layer + 0.5) * ch) * scale
        ActionChains(browser).move_to_element_with_offset(canvas, int(x - rect["width"] / 2),
                                                          int(y - rect["height"] / 2)).perform()
        out = wait_for(section, f'.profile-readout[data-layer="{layer}"][data-column="{column}"]', timeout=5)
        value = want[layer, 2, columns.index(column)]
        assert float(out.get_attribute("data-value")) == pytest.approx(value, abs=1e-7)
        assert f"layer {layer}" in out.text and f"{value:.4f}" in out.text
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
