"""The viewer in a real browser: Debian's Chromium driven by chromedriver (given by path: Selenium Manager is never
asked to find or download anything).  The page's numbers, kept at full precision in data-* attributes, equal gRPC
Predict and Compare of the same prompt; the page loads nothing from any other host and logs no error."""

import logging
from pathlib import Path

import grpc
import numpy as np
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.common.selenium_manager import SeleniumManager
from selenium.webdriver.support.ui import WebDriverWait

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from tests.serving import start

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
PROMPT = "the cat sat on"
MODELS = ("rope", "alibi")


@pytest.fixture
def browser(tmp_path, monkeypatch):
    assert CHROMIUM.exists() and CHROMEDRIVER.exists(), \
        "Debian's chromium and chromium-driver are needed (make browser installs them as root)"

    def forbidden(*args, **kwargs):
        raise AssertionError("Selenium Manager was asked to find a driver or browser")

    monkeypatch.setattr(SeleniumManager, "binary_paths", forbidden)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1440,1100", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def wait_for(driver, css, timeout=60):
    return WebDriverWait(driver, timeout).until(lambda d: d.find_elements(By.CSS_SELECTOR, css))[0]


def ask(driver, url, models, prompt):
    """Open the viewer at `url`, tick exactly `models`, submit `prompt` with the keyboard and wait for every panel."""
    driver.get(url)
    wait_for(driver, 'body[data-state="ready"]')
    for box in driver.find_elements(By.CSS_SELECTOR, "#models input[type=checkbox]"):
        if box.is_selected() != (box.get_attribute("value") in models):
            box.click()
    field = driver.find_element(By.ID, "prompt")
    field.clear()
    field.send_keys(prompt, Keys.ENTER)  # the keyboard submits
    wait_for(driver, 'body[data-state="done"]')


def attention_row(stub, model, layer, head, query):
    resp = stub.Predict(pb.PredictRequest(model=model, prompt=pb.Prompt(text=PROMPT), attention=pb.ATTENTION_FULL,
                                          layers=[layer], heads=[head]), timeout=30)
    (amap,) = resp.attention
    return np.frombuffer(amap.data, "<f4").reshape(amap.shape)[query]


def shown_row(panel):
    out = panel.find_element(By.CSS_SELECTOR, "output.attention-row")
    weights = [float(x) for x in out.get_attribute("data-weights").split(",")]
    return [int(out.get_attribute(f"data-{k}")) for k in ("layer", "head", "query")], weights


def test_viewer_shows_what_grpc_answers(server, stub, browser, tmp_path):
    base = f"http://127.0.0.1:{server.http_port}"
    ask(browser, base + "/", MODELS, PROMPT)

    for model in MODELS:
        panel = browser.find_element(By.CSS_SELECTOR, f'.panel[data-model="{model}"]')
        assert panel.get_attribute("data-state") == "done"
        want = stub.Predict(pb.PredictRequest(model=model, prompt=pb.Prompt(text=PROMPT), top_k=10), timeout=30)
        items = panel.find_elements(By.CSS_SELECTOR, ".top li")
        assert [int(li.get_attribute("data-token-id")) for li in items] == [c.token.id for c in want.top]
        np.testing.assert_allclose([float(li.get_attribute("data-probability")) for li in items],
                                   [c.probability for c in want.top], rtol=0, atol=1e-6)
        tokens = panel.find_elements(By.CSS_SELECTOR, ".tok")
        assert [t.get_attribute("data-piece") for t in tokens] == [t.piece for t in want.tokens]

        tokens[4].click()  # the query: "s" of "sat"
        (layer, head, query), weights = shown_row(panel)
        assert query == 4 and len(weights) == len(PROMPT)
        np.testing.assert_allclose(weights, attention_row(stub, model, layer, head, query), rtol=0, atol=1e-6)

    rope = browser.find_element(By.CSS_SELECTOR, '.panel[data-model="rope"]')
    rope.find_elements(By.CSS_SELECTOR, ".tok")[4].send_keys(Keys.ARROW_RIGHT)  # arrow keys move the query
    thumb = rope.find_element(By.CSS_SELECTOR, '.thumbs button[data-layer="0"][data-head="2"]')
    thumb.send_keys(Keys.ENTER)  # a thumbnail, from the keyboard, becomes the large map
    (layer, head, query), weights = shown_row(rope)
    assert (layer, head, query) == (0, 2, 5)
    np.testing.assert_allclose(weights, attention_row(stub, "rope", 0, 2, 5), rtol=0, atol=1e-6)

    compare = stub.Compare(pb.CompareRequest(prompt=pb.Prompt(text=PROMPT), models=list(MODELS), top_k=5), timeout=30)
    for row in compare.models:
        cell = browser.find_element(By.CSS_SELECTOR, f'#compare tr[data-model="{row.model}"] td[data-value]')
        assert float(cell.get_attribute("data-value")) == pytest.approx(row.total_variation, abs=1e-9)
    shown = wait_for(rope, "canvas.encoding[data-tensors]").get_attribute("data-tensors").split(",")
    assert shown[0] == "rotary_frequencies"  # the frequencies after any RoPE scaling come first, as bars
    assert rope.find_element(By.CSS_SELECTOR, ".note").text.startswith("rope, base 10000")  # the scaling, named
    alibi = browser.find_element(By.CSS_SELECTOR, '.panel[data-model="alibi"]')
    wait_for(alibi, "canvas.encoding[data-tensors]")
    assert "ALiBi slopes 0.25, 0.0625" in alibi.find_element(By.CSS_SELECTOR, ".note").text  # 2^-2, 2^-4, ...

    resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(url.startswith(base + "/") for url in resources), resources
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    shot = tmp_path / "viewer.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000


VIEWER_KEY, NEW_KEY = "viewer-key.5e1d09", "rotated-key.77c2"


def storage(driver) -> dict:
    return driver.execute_script("return {session: Object.fromEntries(Object.entries(sessionStorage)), "
                                 "local: Object.fromEntries(Object.entries(localStorage)), cookie: document.cookie}")


def key_note(driver) -> str:
    return driver.find_element(By.ID, "key-note").text


def test_the_viewer_asks_for_an_api_key_keeps_it_for_the_tab_and_sends_it(artifact_root, browser, tmp_path, caplog):
    """With --api-keys-file the page loads, meets 401, asks for a key in its own form, says when the key is refused,
    works with the right one (its numbers equal gRPC Predict's with the key), keeps it in sessionStorage only, asks
    again when a SIGHUP-style reload drops the key, and forgets it on request.  No key reaches a URL or the log."""
    caplog.set_level(logging.INFO)
    keys = tmp_path / "keys"
    keys.write_text(f"{VIEWER_KEY}\n")
    srv = start(artifact_root, http_port=0, api_keys_file=keys)
    base = f"http://127.0.0.1:{srv.http_port}"
    try:
        browser.get(base + "/")
        wait_for(browser, 'body[data-key="needed"]')
        assert browser.find_element(By.ID, "key").is_displayed() and "needs an API key" in key_note(browser)
        field = browser.find_element(By.ID, "api-key")
        field.send_keys("not-the-key", Keys.ENTER)
        wait_for(browser, 'body[data-key="refused"]')
        assert "refused" in key_note(browser) and storage(browser)["session"] == {}  # a refused key is not kept

        field.send_keys(VIEWER_KEY, Keys.ENTER)
        wait_for(browser, 'body[data-state="ready"]')
        assert not browser.find_element(By.ID, "key").is_displayed()
        assert browser.find_element(By.ID, "key-held").is_displayed()
        assert storage(browser) == {"session": {"posenc.apiKey": VIEWER_KEY}, "local": {}, "cookie": ""}
        assert browser.get_cookies() == []
        browser.refresh()  # the same tab keeps the key: no form again
        wait_for(browser, 'body[data-state="ready"]')
        assert browser.find_element(By.CSS_SELECTOR, "body").get_attribute("data-key") == "held"

        for box in browser.find_elements(By.CSS_SELECTOR, "#models input[type=checkbox]"):
            if box.is_selected() != (box.get_attribute("value") == "rope"):
                box.click()
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys(PROMPT, Keys.ENTER)
        wait_for(browser, 'body[data-state="done"]')
        panel = browser.find_element(By.CSS_SELECTOR, '.panel[data-model="rope"]')
        assert panel.get_attribute("data-state") == "done"
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            want = posenc_pb2_grpc.PosencStub(channel).Predict(
                pb.PredictRequest(model="rope", prompt=pb.Prompt(text=PROMPT), top_k=10), timeout=30,
                metadata=(("authorization", f"Bearer {VIEWER_KEY}"),))
        shown = [int(li.get_attribute("data-token-id")) for li in panel.find_elements(By.CSS_SELECTOR, ".top li")]
        assert shown == [c.token.id for c in want.top]

        keys.write_text(f"{NEW_KEY}\n")  # the key is rotated: the page's next call is refused and it asks again
        assert srv.reload_keys() is True
        browser.find_element(By.ID, "run").click()
        wait_for(browser, 'body[data-key="refused"]')
        assert storage(browser)["session"] == {}
        browser.find_element(By.ID, "api-key").send_keys(NEW_KEY, Keys.ENTER)
        wait_for(browser, 'body[data-state="ready"]')

        browser.find_element(By.ID, "forget-key").click()
        wait_for(browser, 'body[data-key="needed"]')
        assert storage(browser)["session"] == {} and not browser.find_elements(By.CSS_SELECTOR, "#models input")

        urls = [browser.current_url, *browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)")]
        assert urls and all(url.startswith(base + "/") and "key" not in url.lower() for url in urls), urls
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and " 401 " not in e["message"]]
        assert not errors, errors  # only the 401s the page answers with its form
    finally:
        srv.stop(grace=1)
    assert "API keys reloaded" in caplog.text
    assert VIEWER_KEY not in caplog.text and NEW_KEY not in caplog.text and "not-the-key" not in caplog.text
