"""The live KV-cache page in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``make test`` installs where missing) through selenium loads
``/dashboard`` from a live ``pagedkv serve`` while a bounded workload runs; the page renders
without console errors, its block map is drawn and changes between refreshes. The screenshot
goes to the test's temporary folder, or with ``PAGEDKV_SAVE_SCREENSHOT=1`` to
benches/results/dashboard.png (the one the README shows)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
webdriver = pytest.importorskip("selenium.webdriver")
import httpx  # noqa: E402

from pagedkv.server.launch import ServerProcess  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None, reason="chromium and chromium-driver are not installed"
)
TIMEOUT = 60.0
SCREENSHOT = Path(__file__).resolve().parents[2] / "benches" / "results" / "dashboard.png"
FLAGS = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "96", "--block-size", "16"]
FLAGS += ["--max-model-len", "512", "--max-num-seqs", "6", "--num-host-blocks", "32"]
PREAMBLE = "You are a careful assistant. Answer briefly and cite the block table. " * 3

# Non-white pixels of the block-map canvas, and its pixels as one string (to compare frames).
_CANVAS_JS = """
const c = document.getElementById('blocks');
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let drawn = 0;
for (let i = 0; i < d.length; i += 4) if (d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250) drawn++;
return [drawn, c.toDataURL()];
"""


def _workload(url: str, stop: threading.Event) -> None:
    """Waves of requests sharing a preamble (shared blocks), some with n = 2, until ``stop``."""
    with httpx.Client(timeout=TIMEOUT) as http:
        wave = 0
        while not stop.is_set() and wave < 20:
            threads = [
                threading.Thread(
                    target=http.post,
                    args=(url + "/v1/completions",),
                    kwargs={
                        "json": {
                            "prompt": PREAMBLE + f"Question {wave}.{i}",
                            "max_tokens": 24 + 8 * i,
                            "ignore_eos": True,
                            "n": 1 + i % 2,
                        }
                    },
                )
                for i in range(4)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT)
            wave += 1


def test_dashboard_renders_and_updates_in_chromium(tmp_path: Path) -> None:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    with ServerProcess(FLAGS, env={"OMP_NUM_THREADS": "1"}, start_timeout=120) as server:
        stop = threading.Event()
        load = threading.Thread(target=_workload, args=(server.url, stop), daemon=True)
        load.start()
        options = Options()
        options.binary_location = str(CHROMIUM)
        for arg in (
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--window-size=1200,900",
        ):
            options.add_argument(arg)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        try:
            driver.set_page_load_timeout(TIMEOUT)
            driver.get(server.url + "/dashboard")
            deadline = time.monotonic() + TIMEOUT
            frames: list[tuple[int, str]] = []
            while time.monotonic() < deadline:
                used = driver.execute_script("return document.getElementById('pool').textContent")
                if used and not used.startswith("0 of"):  # the workload holds blocks
                    drawn, pixels = driver.execute_script(_CANVAS_JS)
                    if not frames or pixels != frames[-1][1]:
                        frames.append((drawn, pixels))
                    if len(frames) >= 2:
                        break
                time.sleep(0.5)
            assert len(frames) >= 2, "the block map did not change between refreshes while requests ran"
            assert all(drawn > 0 for drawn, _ in frames), "the block map canvas is blank"
            rows = driver.execute_script("return document.querySelectorAll('#requests tr').length")
            assert rows >= 1
            shot = SCREENSHOT if os.environ.get("PAGEDKV_SAVE_SCREENSHOT") else tmp_path / "dashboard.png"
            assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
            errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
            assert not errors, errors
        finally:
            driver.quit()
            stop.set()
            load.join(TIMEOUT)
