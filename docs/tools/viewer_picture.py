"""The viewer's picture in the docs (docs/viewer.png): a real worker serving trained artifacts, the viewer driven in
headless Chromium exactly as tests/http/test_viewer.py drives it, one prompt through the chosen models.

  python -m docs.tools.viewer_picture --artifacts artifacts --models rope,alibi,gpt2 [--prompt TEXT]
      [--out docs/viewer.png]

The artifacts should be trained models (`make models`, and an imported folder: `posenc-export --from-hf`), so the
predictions on the picture mean something.  Needs Debian's chromium and chromium-driver (`make browser`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from bench.lib.worker import Worker

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def shoot(url: str, models: list[str], prompt: str, query: int, out: Path, size: str) -> None:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", f"--window-size={size}",
                "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        wait = WebDriverWait(driver, 120)
        driver.get(url)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, 'body[data-state="ready"]'))
        for box in driver.find_elements(By.CSS_SELECTOR, "#models input[type=checkbox]"):
            if box.is_selected() != (box.get_attribute("value") in models):
                box.click()
        field = driver.find_element(By.ID, "prompt")
        field.clear()
        field.send_keys(prompt, Keys.ENTER)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, 'body[data-state="done"]'))
        for model in models:  # the same query token in every panel, so the attention rows line up
            tokens = driver.find_elements(By.CSS_SELECTOR, f'.panel[data-model="{model}"] .tok')
            if tokens:
                tokens[max(-len(tokens), min(query, len(tokens) - 1))].click()
        time.sleep(1.0)  # the encoding pictures draw after the answers
        tmp = out.with_name(f".{out.name}.tmp.png")
        driver.save_screenshot(str(tmp))
        os.replace(tmp, out)
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m docs.tools.viewer_picture", description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", type=Path, default=ROOT / "artifacts")
    p.add_argument("--models", default="rope,alibi", help="comma-separated, in the order they are ticked")
    p.add_argument("--prompt", default="The built-in function len() returns the number of ")
    p.add_argument("--query", type=int, default=-1, help="the token whose attention row is shown (-1: the last)")
    p.add_argument("--size", default="1500,1150", help="the browser window, WIDTH,HEIGHT")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "viewer.png")
    args = p.parse_args(argv)
    missing = [m for m in args.models.split(",") if not (args.artifacts / m / "manifest.json").is_file()]
    if missing or not CHROMEDRIVER.exists():
        why = f"no artifact {missing[0]}" if missing else "no chromedriver (make browser)"
        print(f"docs.tools.viewer_picture: {why}", file=sys.stderr)
        return 2
    with Worker(args.artifacts, http=True, timeout=120) as worker:
        shoot(f"http://127.0.0.1:{worker.http_port}/", args.models.split(","), args.prompt, args.query, args.out,
              args.size)
    print(f"docs.tools.viewer_picture: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
