"""The Decoding strategies page in a real browser: the beam tree, the reorder, the speculative notebook."""
from __future__ import annotations


def _wait_titles(page, *titles: str) -> None:  # type: ignore[no-untyped-def]
    cond = " && ".join(f"t.some(x => x.startsWith({t!r}))" for t in titles)
    page.wait_for_function("() => { const t = [...document.querySelectorAll('.js-plotly-plot .gtitle')]"
                           f".map(e => e.textContent); return {cond}; }}", timeout=180_000)


def test_beam_search_tab(page, app_url, wait_idle, screenshot) -> None:  # type: ignore[no-untyped-def]
    page.goto(app_url + "/decoding")
    wait_idle(page)
    page.get_by_role("heading", name="Decoding strategies").wait_for()
    box = page.locator(".st-key-prompt textarea")
    box.fill("The cat sat on the mat. The cat")
    box.press("Control+Enter")
    wait_idle(page)
    page.locator(".st-key-beam_new input").fill("8")
    page.locator(".st-key-beam_new input").press("Enter")
    wait_idle(page)
    page.locator(".st-key-beam_run button").click()
    _wait_titles(page, "The beam tree", "Cache rows at step 0", "Bytes each reorder copied")
    wait_idle(page, 180_000)
    assert page.locator("[data-testid='stAlertContentError']").count() == 0
    screenshot(page, "decoding_beams.png")
    assert page.locator("[data-testid='stDataFrame']").count() == 1


def test_speculative_tab(page, app_url, wait_idle, screenshot) -> None:  # type: ignore[no-untyped-def]
    page.goto(app_url + "/decoding")
    wait_idle(page)
    page.get_by_role("heading", name="Decoding strategies").wait_for()
    page.get_by_role("tab", name="Speculative decoding: the cache rolled back").click()
    page.locator(".st-key-spec_run button").wait_for(state="visible")
    page.locator(".st-key-spec_prompt input").click()  # a combobox: its options open under the input
    page.get_by_role("option", name="count from 1 to 40 (drafts the next numbers)").click()
    wait_idle(page)
    page.locator(".st-key-spec_run button").click()
    page.get_by_text("Identical output").wait_for(timeout=180_000)
    _wait_titles(page, "What each verify forward wrote", "Drafted vs accepted")
    wait_idle(page, 180_000)
    assert page.locator("[data-testid='stAlertContentError']").count() == 0
    screenshot(page, "decoding_speculative.png")
