"""The Live server page in a browser: against a stand-in server serving a real vLLM's captured
/metrics (every run), and against a real vLLM serving SmolLM2 under load (marked ``vllm``: `make
test-vllm`). Screenshots at 1366x768 and 1920x1080 go to test-results/screenshots/live-*.png."""
from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
from pathlib import Path

import pytest

from conftest import SCREENSHOTS, _shrink_png, _wait_idle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "watch"))
from fake_server import serve  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"
SIZES = [(1366, 768), (1920, 1080)]


def _open(browser, app_url: str, size: tuple[int, int]):  # type: ignore[no-untyped-def]
    ctx = browser.new_context(viewport={"width": size[0], "height": size[1]}, device_scale_factor=1)
    pg = ctx.new_page()
    pg.set_default_timeout(120_000)
    pg.goto(app_url + "/live")
    pg.wait_for_selector(".st-key-live_url input")
    _wait_idle(pg)
    return ctx, pg


def _point_at(pg, url: str) -> None:  # type: ignore[no-untyped-def]
    box = pg.locator(".st-key-live_url input")
    box.fill(url)
    box.press("Enter")
    _wait_idle(pg)


def _shot(pg, name: str) -> None:  # type: ignore[no-untyped-def]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    pg.screenshot(path=str(path), full_page=True)
    _shrink_png(path)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_live_page_reads_a_server_and_keeps_its_data_when_it_goes(browser, app_url: str, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    routes = {"/metrics": (200, (DATA / "vllm_metrics_smollm2.txt").read_bytes()),
              "/v1/models": (200, (DATA / "vllm_models_smollm2.json").read_bytes())}
    ctx, pg = _open(browser, app_url, size)
    try:
        with serve(routes) as url:
            _point_at(pg, url)
            pg.wait_for_selector("text=the pool holds")
            body = pg.locator("[data-testid='stMain']").inner_text()
            assert "46,592 tokens" in body and "22.75" in body, body[:2000]
            assert "vLLM serving HuggingFaceTB/SmolLM2-135M-Instruct" in body
            pg.wait_for_selector(".js-plotly-plot .main-svg")
            _shot(pg, f"live-{size[0]}x{size[1]}.png")
        # The server is gone: one warning line, the readings stay on screen.
        pg.locator(".st-key-live_read button").click()
        _wait_idle(pg)
        pg.wait_for_selector("[data-testid='stAlert']:has-text('connection refused')")
        body = pg.locator("[data-testid='stMain']").inner_text()
        assert "the charts keep the last good readings" in body and "46,592 tokens" in body
        assert not pg.locator("[data-testid='stException']").count()
    finally:
        ctx.close()


def test_a_bad_url_is_one_line_and_nothing_breaks(browser, app_url: str) -> None:  # type: ignore[no-untyped-def]
    ctx, pg = _open(browser, app_url, (1366, 768))
    try:
        _point_at(pg, "ftp://example")
        pg.wait_for_selector("[data-testid='stAlert']:has-text('only http')")
        assert pg.locator(".st-key-live_url input").input_value() == "ftp://example"  # kept as typed
        assert not pg.locator("[data-testid='stException']").count()
    finally:
        ctx.close()


@pytest.mark.vllm
def test_live_page_against_a_real_vllm_under_load(browser, app_url: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from kvviz.watch.vllm_harness import missing_reason, vllm_server

    if missing_reason():
        pytest.skip(missing_reason())
    from kvviz.engine.loaded import load_model
    from kvviz.engine.loading.save import export_hf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "watch"))
    from test_vllm_engine import complete  # noqa: E402

    export_hf(load_model("smollm2", device="cpu"), tmp_path / "hf")
    with vllm_server(tmp_path / "hf", tmp_path / "vllm.log", served_model_name="HuggingFaceTB/SmolLM2-135M-Instruct") as s:
        stop = threading.Event()

        def load(i: int) -> None:  # bounded: at most 40 requests per worker, until the test is done
            for _ in range(40):
                if stop.is_set():
                    return
                complete(s.url, f"Request {i}: tell me about the sea.", 48)

        with cf.ThreadPoolExecutor(6) as ex:
            futures = [ex.submit(load, i) for i in range(6)]
            try:
                for size in SIZES:
                    ctx, pg = _open(browser, app_url, size)
                    try:
                        _point_at(pg, s.url)
                        pg.locator(".st-key-live_watch label").click()
                        pg.wait_for_function("() => document.body.innerText.match(/(\\d+) reading\\(s\\)/) && "
                                             "+document.body.innerText.match(/(\\d+) reading\\(s\\)/)[1] >= 4",
                                             timeout=180_000)
                        body = pg.locator("[data-testid='stMain']").inner_text()
                        assert "46,592 tokens" in body and "22.75" in body
                        _shot(pg, f"live-vllm-{size[0]}x{size[1]}.png")
                    finally:
                        ctx.close()
            finally:
                stop.set()
                for f in futures:
                    f.result()
