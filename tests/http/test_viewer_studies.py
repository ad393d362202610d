"""The Studies section: a real worker given a results folder (`--studies-dir`) with copies of the committed results of
`make lengthgen`, `make passkey` and the hybrid study, and files that are not results. GET /v1/posenc/studies lists
the results files and says why each other file is left out; each file's tables come back as the file holds them
(read here with json, not through the worker's reader); a name that is no results file there is 404 naming why (a
symbolic link out of the folder among them); a worker started without a folder says so; a file written while the
worker runs is listed at the next request; with API keys the routes need one. In real Chromium the section shows the
lengthgen tables cell by cell, then the hybrid study's when it is picked, and a file written while the page is open
once the section is opened again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.http.conftest import Http
from tests.http.test_viewer import browser, wait_for  # noqa: F401  (browser: the fixture, a real Chromium)
from tests.serving import start

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
STUDIES = ("hybrid", "lengthgen", "passkey")
NOT_RESULTS = {"broken": "{\"tables\": ", "constant": '{"tables": {"t": {"columns": ["a"], "rows": [[NaN]]}}}',
               "plain": '{"meta": {"date": "2026-12-06"}, "figures": [1, 2]}',
               "nested": '{"tables": {"t": {"columns": ["a"], "rows": [[{"x": 1}]]}}}',
               "huge": '{"meta": {"seconds": 1e400}, "tables": {"t": {"columns": ["a"], "rows": [[1]]}}}'}
SKIPPED = {*NOT_RESULTS, "link"}  # link.json: a symbolic link to a results file outside the folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("studies")
    for name in STUDIES:
        shutil.copy(RESULTS / f"{name}.json", root / f"{name}.json")
    for name, text in NOT_RESULTS.items():
        (root / f"{name}.json").write_text(text)
    (root / "notes.md").write_text("not JSON: never listed")
    shutil.copy(RESULTS / "hybrid.json", root / ".hidden.json")  # a dot file: never listed
    outside = tmp_path_factory.mktemp("elsewhere") / "secret.json"
    shutil.copy(RESULTS / "scaling.json", outside)
    (root / "link.json").symlink_to(outside)
    return root


@pytest.fixture(scope="module")
def worker(folder, tmp_path_factory):
    srv = start(tmp_path_factory.mktemp("no-models"), http_port=0, studies_dir=folder)
    yield srv
    srv.stop(grace=1)


def shown(value) -> str:
    """How the results convention writes a cell (bench/lib/results.py's markdown, without its escaping)."""
    return "–" if value is None else ("yes" if value else "no") if isinstance(value, bool) else str(value)


def same_cell(text: str, value) -> bool:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(text) == value  # the number, however JavaScript prints it (the shortest text that reads back)
    return text == shown(value)


def test_the_listing_is_the_results_files_and_says_why_others_are_left_out(worker, folder):
    status, doc = Http(worker.http_port).json("GET", "/v1/posenc/studies")
    assert status == 200, doc
    assert doc["folder"] == str(folder)
    assert [s["name"] for s in doc["studies"]] == sorted(STUDIES)
    for entry in doc["studies"]:
        on_disk = json.loads((folder / f"{entry['name']}.json").read_text())
        assert entry["tables"] == list(on_disk["tables"]) and entry["meta"] == on_disk["meta"]
    reasons = {s["name"]: s["reason"] for s in doc["skipped"]}
    assert set(reasons) == SKIPPED  # notes.md is not a .json file, .hidden.json a dot file: not even skipped
    assert "not readable JSON" in reasons["broken"] and "NaN" in reasons["constant"]
    assert "past a float's range" in reasons["huge"] and "symbolic link" in reasons["link"]
    assert "holds no tables" in reasons["plain"] and "not a string, number, boolean or null" in reasons["nested"]


@pytest.mark.parametrize("name", STUDIES)
def test_a_study_is_its_files_tables(worker, folder, name):
    status, doc = Http(worker.http_port).json("GET", f"/v1/posenc/studies/{name}")
    assert status == 200, doc
    on_disk = json.loads((folder / f"{name}.json").read_text())
    assert doc["meta"] == on_disk["meta"]
    assert [t["id"] for t in doc["tables"]] == list(on_disk["tables"])
    for t in doc["tables"]:
        want = on_disk["tables"][t["id"]]
        assert (t["columns"], t["rows"]) == (want["columns"], want["rows"])
        assert (t["note"], t["title"]) == (want.get("note", ""), want.get("title", ""))


@pytest.mark.parametrize("name,why", [("nosuch", "no study"), (".hidden", "no study"), ("notes", "no study"),
                                      ("broken", "not a results file"), ("link", "not a results file")])
def test_a_name_that_is_no_results_file_there_is_404_naming_why(worker, name, why):
    status, doc = Http(worker.http_port).json("GET", f"/v1/posenc/studies/{name}")
    assert status == 404 and why in doc["error"], doc


def test_a_path_out_of_the_folder_matches_no_route(worker):
    status, doc = Http(worker.http_port).json("GET", "/v1/posenc/studies/..%2Fstudies%2Flengthgen")
    assert status == 404 and "no such route" in doc["error"], doc


def test_a_file_written_while_the_worker_runs_is_listed_at_the_next_request(worker, folder):
    web = Http(worker.http_port)
    late = {"meta": {"command": "late"}, "tables": {"t": {"columns": ["x", "y"], "rows": [[1, None], ["a", True]]}}}
    (folder / "late.tmp").write_text(json.dumps(late))
    (folder / "late.tmp").rename(folder / "late.json")  # as the results writer does: whole or not at all
    try:
        status, doc = web.json("GET", "/v1/posenc/studies")
        assert "late" in [s["name"] for s in doc["studies"]]
        status, doc = web.json("GET", "/v1/posenc/studies/late")
        assert status == 200 and doc["tables"][0]["rows"] == [[1, None], ["a", True]]
    finally:
        (folder / "late.json").unlink()


def test_a_worker_without_a_folder_says_so(tmp_path):
    srv = start(tmp_path, http_port=0)
    try:
        web = Http(srv.http_port)
        assert web.json("GET", "/v1/posenc/studies") == (200, {"folder": "", "studies": [], "skipped": []})
        status, doc = web.json("GET", "/v1/posenc/studies/lengthgen")
        assert status == 404 and "--studies-dir" in doc["error"]
    finally:
        srv.stop(grace=1)


def test_with_api_keys_the_studies_need_one(folder, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("studies-key\n")
    models = tmp_path / "models"
    models.mkdir()
    srv = start(models, http_port=0, studies_dir=folder, api_keys_file=keys)
    try:
        web = Http(srv.http_port)
        assert web.call("GET", "/v1/posenc/studies")[0] == 401
        assert web.call("GET", "/v1/posenc/studies/lengthgen")[0] == 401
        status, doc = web.json("GET", "/v1/posenc/studies/lengthgen", headers={"authorization": "Bearer studies-key"})
        assert status == 200 and doc["name"] == "lengthgen"
    finally:
        srv.stop(grace=1)


def page_tables(driver) -> dict[str, tuple[list[str], list[list[str]], str]]:
    out = {}
    for box in driver.find_elements(By.CSS_SELECTOR, "#study-tables section.study-table"):
        heads = [th.get_attribute("textContent") for th in box.find_elements(By.CSS_SELECTOR, "thead th")]
        rows = [[td.get_attribute("textContent") for td in tr.find_elements(By.TAG_NAME, "td")]
                for tr in box.find_elements(By.CSS_SELECTOR, "tbody tr")]
        notes = box.find_elements(By.CSS_SELECTOR, "p.note")
        out[box.get_attribute("data-table")] = (heads, rows, notes[0].get_attribute("textContent") if notes else "")
    return out


def assert_shows(driver, folder: Path, name: str) -> None:
    on_disk = json.loads((folder / f"{name}.json").read_text())
    tables = page_tables(driver)
    assert list(tables) == list(on_disk["tables"])
    for tid, (heads, rows, note) in tables.items():
        want = on_disk["tables"][tid]
        assert heads == [shown(c) for c in want["columns"]]
        assert len(rows) == len(want["rows"]) > 0
        for got, row in zip(rows, want["rows"], strict=True):
            assert len(got) == len(row) and all(same_cell(g, v) for g, v in zip(got, row, strict=True)), (tid, got)
        assert note == want.get("note", "")
    source = driver.find_element(By.ID, "study-source").text
    assert on_disk["meta"]["command"] in source and f"{folder}/{name}.json" in source


def options(driver) -> list[str]:
    """The picker's values, read in one script call (the page replaces the options when it lists again)."""
    return driver.execute_script("return Array.from(document.querySelectorAll('#study option'), (o) => o.value)")


def test_the_viewer_shows_each_studys_tables(worker, folder, browser):  # noqa: F811
    browser.get(f"http://127.0.0.1:{worker.http_port}/")
    wait_for(browser, 'body[data-state="ready"]')
    browser.find_element(By.CSS_SELECTOR, "#studies summary").click()
    wait_for(browser, '#studies[data-state="shown"][data-study="lengthgen"]')  # lengthgen first where there is one
    assert_shows(browser, folder, "lengthgen")
    note = browser.find_element(By.ID, "studies-note").text
    assert f"3 results files in {folder}" in note and all(f"{n}.json (" in note for n in SKIPPED)
    assert options(browser) == sorted(STUDIES)
    Select(browser.find_element(By.ID, "study")).select_by_value("hybrid")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "studies").get_attribute("data-study")
                                     == "hybrid" and d.find_element(By.ID, "studies").get_attribute("data-state")
                                     == "shown")
    assert_shows(browser, folder, "hybrid")
    # a results file written while the page is open is listed when the section is opened again; the pick stays
    late = {"meta": {"command": "late"}, "tables": {"t": {"columns": ["x"], "rows": [[1.5]]}}}
    (folder / "late.json").write_text(json.dumps(late))
    try:
        summary = browser.find_element(By.CSS_SELECTOR, "#studies summary")
        summary.click()
        assert browser.find_element(By.ID, "studies").get_attribute("open") is None
        summary.click()
        WebDriverWait(browser, 30).until(lambda d: "late" in options(d))
        wait_for(browser, '#studies[data-state="shown"][data-study="hybrid"]')
        assert "4 results files" in browser.find_element(By.ID, "studies-note").text
        assert_shows(browser, folder, "hybrid")
    finally:
        (folder / "late.json").unlink()
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
