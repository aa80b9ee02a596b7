"""The Serving page in a browser at 1366x768 and 1920x1080, on the browser tests' model (random:tiny
unless KVVIZ_BROWSER_MODEL says otherwise): a small workload runs, the charts are drawn, the numbers
shown equal those computed from the run's own exported records, the replay scrubber moves the pool
back to step 0, and both downloads are there. Screenshots go to test-results/screenshots/serving-*.png:
look at them."""
from __future__ import annotations

import csv
import io
import json

import pytest

from conftest import SCREENSHOTS, _shrink_png
from screen_walks import set_number
from kvviz.charts import serving_data as sd
from kvviz.engine.serving.records import RequestRecord, Scheduled, StepRecord

IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
RUN_MS = 300_000
SIZES = [(1366, 768), (1920, 1080)]
CHART_TITLES = ("Each request's life, step by step", "Block pool after step", "Tokens per step", "Queues",
                "KV usage", "Prefix-cache hit rate", "Latency percentiles")


def _idle(page, timeout: int = RUN_MS) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_selector(IDLE, timeout=timeout)


def _titles(page) -> list[str]:  # type: ignore[no-untyped-def]
    return page.evaluate("[...document.querySelectorAll('.js-plotly-plot .gtitle')].map(e => e.textContent)")


def _records(jsonl: str) -> tuple[list[StepRecord], list[RequestRecord]]:
    """The run's records rebuilt from its JSON Lines export."""
    steps, reqs = [], []
    for line in jsonl.splitlines():
        d = json.loads(line)
        kind = d.pop("event")
        if kind == "step":
            d["scheduled"] = tuple(Scheduled(**s) for s in d["scheduled"])
            for k in ("running", "waiting", "finished", "preempted", "block_state"):
                d[k] = tuple(d[k])
            d["block_owner"] = tuple(tuple(o) for o in d["block_owner"])
            steps.append(StepRecord(**d))
        else:
            for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
                d.pop(k)
            reqs.append(RequestRecord(**d))
    return steps, reqs


def _download(page, key: str) -> str:  # type: ignore[no-untyped-def]
    with page.expect_download() as info:
        page.locator(f".st-key-{key} button").click()
    return open(info.value.path(), encoding="utf-8").read()


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_serving_page_runs_and_shows_its_records(browser, app_url: str, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    w, h = size
    context = browser.new_context(viewport={"width": w, "height": h}, device_scale_factor=1, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(RUN_MS)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"{app_url}/serving")
        page.get_by_role("heading", name="Serving: many requests at once").wait_for()
        _idle(page)
        set_number(page, "serve_requests", 6, RUN_MS)
        set_number(page, "serve_output_max", 10, RUN_MS)
        page.locator(".st-key-serve_run button").click()
        page.wait_for_selector(".st-key-serve_numbers [data-testid=stMetric]", timeout=RUN_MS)
        _idle(page)
        page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot')].length >= 7 && "
                               "[...document.querySelectorAll('.js-plotly-plot')].every(p => p.querySelector('.main-svg'))")
        titles = _titles(page)
        for t in CHART_TITLES:
            assert any(x.startswith(t) for x in titles), (t, titles)
        assert page.locator("[data-testid='stAlertContentError']").count() == 0

        # The numbers shown are the run's: recomputed here from the exported events.
        steps, reqs = _records(_download(page, "serve_dl_events"))
        assert len(reqs) == 6 and all(r.state == "finished" for r in reqs)
        s = sd.summarize(steps, reqs)
        metrics = dict(zip(page.locator(".st-key-serve_numbers [data-testid=stMetricLabel]").all_inner_texts(),
                           page.locator(".st-key-serve_numbers [data-testid=stMetricValue]").all_inner_texts()))
        assert metrics["Peak running"] == str(s.peak_running)
        assert metrics["Preemptions"] == str(s.preemptions)
        assert metrics["Throughput"] == f"{s.throughput_tok_s:,.1f} tok/s"
        assert metrics["TTFT p50"] == f"{s.ttft_ms[0]:,.1f} ms"
        assert metrics["Prefix hits"] == f"{s.prefix_hit_tokens:,} tok"
        rows = list(csv.DictReader(io.StringIO(_download(page, "serve_dl_csv"))))
        assert [r["id"] for r in rows] == [r.request_id for r in reqs]
        assert [int(r["output tokens"]) for r in rows] == [len(r.output_ids) for r in reqs]
        last = len(steps) - 1
        assert any(t.startswith(f"Block pool after step {last}") for t in _titles(page))

        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.evaluate("document.querySelector('[data-testid=stMain]').scrollTo(0, 0)")
        page.mouse.move(w - 5, h - 5)
        page.screenshot(path=str(SCREENSHOTS / f"serving-{w}.png"))
        _shrink_png(SCREENSHOTS / f"serving-{w}.png")

        # The replay scrubber: Home moves it to step 0, and the pool chart follows.
        handle = page.locator(".st-key-serve_replay input[type='range']")
        if not handle.count():
            raise AssertionError("no replay slider; exceptions: "
                                 + repr(page.locator("[data-testid=stException]").all_inner_texts()))
        handle.scroll_into_view_if_needed()
        handle.focus()
        handle.press("Home")
        page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot .gtitle')]"
                               ".some(e => e.textContent.startsWith('Block pool after step 0'))", timeout=RUN_MS)
        _idle(page)
        height = page.evaluate("document.querySelector('[data-testid=stMain]').scrollHeight")
        page.set_viewport_size({"width": w, "height": int(height) + 24})
        page.wait_for_function("[...document.querySelectorAll('.js-plotly-plot')].every(p => p.querySelector('.main-svg'))")
        page.screenshot(path=str(SCREENSHOTS / f"serving-{w}-full.png"))
        _shrink_png(SCREENSHOTS / f"serving-{w}-full.png")
        assert not errors, errors
    finally:
        context.close()
