"""Long prompts' maps: posenc.v1 Predict's window of query rows (query_start, query_count) on an imported model that
takes 1,024 positions, against transformers' own attention weights; bad windows refused over gRPC and HTTP; and the
viewer, in a real Chromium, drawing a 1,024-token prompt's map on a canvas, asking only for the layer, head and rows
it shows, with the exact value of the cell under the cursor equal to gRPC Predict's."""

from __future__ import annotations

import shutil

import grpc
import numpy as np
import pytest
import torch
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from protos.posenc.v1 import posenc_pb2 as pb
from protos.posenc.v1 import posenc_pb2_grpc
from service.jobs import MapRequest
from tests.http.conftest import Http
from tests.http.test_viewer import browser, wait_for  # noqa: F401  (browser: the fixture, a real Chromium)
from tests.serving import start

NAME, LENGTH = "llama1k", 1024
pytestmark = pytest.mark.xdist_group("long-llama")  # one worker imports the long model once, for test_profile too


def prompt_of(tokenizer, n: int) -> str:
    """The shortest prefix of CPython's documentation text that the tokenizer makes n tokens of."""
    from pydoc_data.topics import topics

    text = " ".join(" ".join(topics.values()).split())  # one line: the page's prompt is an <input>
    lo, hi = 1, len(text)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if len(tokenizer.encode(text[:mid]).ids) < n else (lo, mid)
    assert len(tokenizer.encode(text[:lo]).ids) == n
    return text[:lo]


@pytest.fixture(scope="module")
def long_model(long_llama, tmp_path_factory):
    """The session's tiny LLaMA that takes 2,048 positions (tests/conftest.py), built with transformers and imported,
    served under NAME by a worker with its HTTP front: (worker, transformers model, prompt, its ids)."""
    folder, hf, tok = long_llama
    root = tmp_path_factory.mktemp("long")
    shutil.copytree(folder, root / "models" / NAME)
    prompt = prompt_of(tok, LENGTH)
    srv = start(root / "models", http_port=0)
    yield srv, hf, prompt, tok.encode(prompt).ids
    srv.stop(grace=1)


@pytest.fixture(scope="module")
def long_stub(long_model):
    with grpc.insecure_channel(f"127.0.0.1:{long_model[0].port}",
                               options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        yield posenc_pb2_grpc.PosencStub(channel)


def predict(stub, prompt, **kw) -> pb.PredictResponse:
    return stub.Predict(pb.PredictRequest(model=NAME, prompt=pb.Prompt(text=prompt), attention=pb.ATTENTION_FULL,
                                          **kw), timeout=60)


def window(amap) -> np.ndarray:
    return np.frombuffer(amap.data, "<f4").reshape(amap.shape)


def test_a_window_of_query_rows_is_transformers_rows(long_model, long_stub):
    """Rows 512..767 of layer 1's heads 0 and 3: shape [256, 1024], query_start 512, equal to the rows of
    transformers' eager attention weights for the same ids; the answer holds those rows only."""
    srv, hf, prompt, ids = long_model
    resp = predict(long_stub, prompt, layers=[1], heads=[0, 3], query_start=512, query_count=256)
    with torch.no_grad():
        want = hf(torch.tensor([ids]), output_attentions=True).attentions[1][0].numpy()
    assert [(m.layer, m.head, list(m.shape), m.query_start) for m in resp.attention] == \
        [(1, 0, [256, LENGTH], 512), (1, 3, [256, LENGTH], 512)]
    for m in resp.attention:
        np.testing.assert_allclose(window(m), want[m.head, 512:768], rtol=0, atol=2e-5)
    assert resp.ByteSize() < 2 * 256 * LENGTH * 4 + 64 * 1024  # two windows' floats, not the square
    to_end = predict(long_stub, prompt, layers=[0], heads=[2], query_start=1000)  # query_count 0: to the end
    (m,) = to_end.attention
    assert (list(m.shape), m.query_start) == ([24, LENGTH], 1000)
    last = long_stub.Predict(pb.PredictRequest(model=NAME, prompt=pb.Prompt(text=prompt), layers=[0], heads=[2],
                                               attention=pb.ATTENTION_LAST_ROW), timeout=60)
    assert last.attention[0].query_start == LENGTH - 1
    np.testing.assert_allclose(window(last.attention[0])[0], window(m)[-1], rtol=0, atol=1e-6)


def test_the_worker_keeps_only_the_window_it_returns(long_model):
    """The window is copied out of the graph's output (L, H, T, T), which is let go before the answer is written:
    the maps returned own their memory and are the window's size."""
    srv, _, prompt, _ = long_model
    p = srv.ops.predict(NAME, prompt, None, 5, MapRequest.FULL, [1], [2], None, 100, 64)
    ((layer, head, amap),) = p.attention
    assert (layer, head, amap.shape, p.query_start) == (1, 2, (64, LENGTH), 100)
    assert amap.base is None and amap.nbytes == 64 * LENGTH * 4
    assert p.result.attentions is None


@pytest.mark.parametrize("kw, says", [
    ({"query_start": -1}, "must be >= 0"),
    ({"query_count": -5}, "must be >= 0"),
    ({"query_start": LENGTH}, "past the prompt's 1024 tokens"),
    ({"query_start": 1000, "query_count": 25}, "query rows 1000..1024 are past the prompt's 1024 tokens"),
    ({"query_count": 4, "attention": pb.ATTENTION_LAST_ROW}, "need attention=ATTENTION_FULL"),
    ({"query_start": 3, "attention": pb.ATTENTION_NONE}, "need attention=ATTENTION_FULL"),
])
def test_a_bad_window_is_refused_over_grpc_and_http(long_model, long_stub, kw, says):
    srv, _, prompt, _ = long_model
    kw = {"attention": pb.ATTENTION_FULL, "layers": [0], "heads": [0]} | kw
    with pytest.raises(grpc.RpcError) as err:
        long_stub.Predict(pb.PredictRequest(model=NAME, prompt=pb.Prompt(text=prompt), **kw), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()
    body = {"model": NAME, "prompt": {"text": prompt}, **kw, "attention": pb.AttentionMode.Name(kw["attention"])}
    status, doc = Http(srv.http_port).json("POST", "/v1/posenc/predict", body)
    assert status == 400 and says in doc["error"], doc


def cell_under_cursor(driver, canvas, fx: float, fy: float) -> dict:
    """Move the mouse to the fraction (fx, fy) of the canvas and read the page's readout (data-* attributes)."""
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    rect = canvas.rect
    ActionChains(driver).move_to_element_with_offset(canvas, int(rect["width"] * (fx - 0.5)),
                                                     int(rect["height"] * (fy - 0.5))).perform()
    readout = wait_for(canvas.find_element(By.XPATH, ".."), ".readout[data-value]", timeout=5)
    return {k: readout.get_attribute(f"data-{k}") for k in ("query", "key", "value")}


def map_pixels(driver, canvas, margin: int = 44) -> dict:
    """The drawn map's device pixels (right of and below the axes' margin) that are coloured, not white: above the
    diagonal (keys after the query: the causal mask's zeros) and below it, 3 pixels clear of it either side."""
    return driver.execute_script("""
        const c = arguments[0], m = Math.round(arguments[1] * c.width / c.clientWidth);
        const w = c.width - m, h = c.height - m, d = c.getContext("2d").getImageData(m, m, w, h).data;
        const out = {above: 0, below: 0, above_all: 0, below_all: 0, width: c.width};
        for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) {
          const i = 4 * (y * w + x), inked = d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250;
          const side = x * h > (y + 3) * w ? "above" : y * w > (x + 3) * h ? "below" : null;
          if (side) { out[side + "_all"]++; if (inked) out[side]++; }
        }
        return out;""", canvas, margin)


def test_the_viewer_draws_a_1024_token_prompt(long_model, long_stub, browser):  # noqa: F811
    srv, _, prompt, _ = long_model
    base = f"http://127.0.0.1:{srv.http_port}"
    browser.get(base + "/")
    wait_for(browser, 'body[data-state="ready"]', timeout=10)
    field = browser.find_element(By.ID, "prompt")
    browser.execute_script("arguments[0].value = arguments[1]", field, prompt)  # typing 4 KB key by key is slow
    browser.find_element(By.ID, "run").click()
    wait_for(browser, 'body[data-state="done"]', timeout=15)
    panel = browser.find_element(By.CSS_SELECTOR, f'.panel[data-model="{NAME}"]')
    assert panel.get_attribute("data-state") == "done", (panel.text[-300:], browser.get_log("browser"))
    assert len(panel.find_elements(By.CSS_SELECTOR, ".tok")) == LENGTH
    canvas = panel.find_element(By.CSS_SELECTOR, "canvas.heatmap")
    shown = {k: int(canvas.get_attribute(f"data-{k}")) for k in ("layer", "head", "start", "rows", "keys")}
    assert shown == {"layer": 1, "head": 0, "start": 0, "rows": LENGTH, "keys": LENGTH}  # the last layer, 4 MiB
    px = map_pixels(browser, canvas)
    assert px["width"] < LENGTH, px  # downsampled to the canvas's pixels
    assert px["above"] == 0 and px["below"] > 0.05 * px["below_all"], px  # drawn, causal side up

    def answer_sizes():
        return browser.execute_script("return performance.getEntriesByType('resource')"
                                      ".filter(e => e.name.endsWith('/v1/posenc/predict')).map(e => e.encodedBodySize)")

    one_map = 4 * LENGTH * LENGTH * 4 / 3  # base64 of one head's float32 map
    (first,) = answer_sizes()
    assert one_map < first < one_map + 64 * 1024  # one layer and head: not the 8 maps of the whole set

    # a window of rows, asked for in the page's own fields
    for css, value, first_row in ((".q-count", 256, 0), (".q-start", 512, 512)):
        box = panel.find_element(By.CSS_SELECTOR, css)
        browser.execute_script("arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('change'))",
                               box, value)
        wait_for(panel, f'canvas.heatmap[data-rows="256"][data-start="{first_row}"]', timeout=10)
    sizes = answer_sizes()
    assert len(sizes) == 3 and sizes[-1] < one_map / 4 + 64 * 1024, sizes  # 256 rows of 1,024 keys

    want = window(predict(long_stub, prompt, layers=[1], heads=[0], query_start=512, query_count=256).attention[0])
    got = cell_under_cursor(browser, canvas, 0.4, 0.8)
    q, k, v = int(got["query"]), int(got["key"]), float(got["value"])
    geo_q, geo_k = 512 + 256 * (0.8 * canvas.rect["height"] - 44) / (canvas.rect["height"] - 44), \
        LENGTH * (0.4 * canvas.rect["width"] - 44) / (canvas.rect["width"] - 44)
    assert abs(q - geo_q) <= 2 and abs(k - geo_k) <= 4, (got, geo_q, geo_k)  # the cell under the cursor
    assert v == pytest.approx(float(want[q - 512, k]), abs=1e-7) and v > 0  # its exact value, not a pooled pixel
    out = panel.find_element(By.CSS_SELECTOR, "output.attention-row")
    row = [float(x) for x in out.get_attribute("data-weights").split(",")]
    query = int(out.get_attribute("data-query"))  # 767, or a token of the window the mouse passed over
    assert 512 <= query < 768
    np.testing.assert_allclose(row, want[query - 512], rtol=0, atol=1e-7)
    width = browser.execute_script("const e = document.documentElement; return [e.clientWidth, e.scrollWidth]")
    assert width[1] <= width[0], width  # 1,024 tokens and their permuted text stay inside the window's width
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
