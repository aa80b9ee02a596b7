"""The Generate page in a real browser (Chromium via Playwright): generate, stop, replay, XSS.

Each test gets a fresh page (a new Streamlit session), so its first run is run #1 and the app's
own done marker is ``.st-key-run_done_1``. Screenshots go to test-results/screenshots/
(`make screenshots` copies them into docs/screenshots/, run on the Shakespeare model).
"""
from __future__ import annotations

import re

from plotly_margins import grown_margins

LIVE_TITLES = ("The KV cache after", "Where the newest token looks", "Layer ", "Time per step")
XSS_PROMPT = "<img src=x onerror=alert(1)> <b>bold?</b> 😀 שלום עולם مرحبا\n"


def open_app(page, app_url: str) -> None:  # type: ignore[no-untyped-def]
    page.goto(app_url)
    page.wait_for_selector(".st-key-generate button")
    page.wait_for_selector(".st-key-prompt textarea")


def set_prompt(page, text: str) -> None:  # type: ignore[no-untyped-def]
    """Type the prompt and commit it (Ctrl+Enter), then wait for the sidebar's token count."""
    box = page.locator(".st-key-prompt textarea")
    box.fill(text)
    box.press("Control+Enter")
    n = len(text.encode("utf-8"))  # the byte tokenizer: one token per byte
    page.get_by_text(re.compile(rf"Prompt {n:,} tokens")).wait_for()


def set_max_new_tokens(page, n: int) -> None:  # type: ignore[no-untyped-def]
    box = page.locator(".st-key-max_new_tokens input")
    box.fill(str(n))
    box.press("Enter")
    page.get_by_text(re.compile(rf"\+ {n:,} new = ")).wait_for()


def click(page, key: str) -> None:  # type: ignore[no-untyped-def]
    """Click the button with this key (a button with help text is in the DOM twice, one hidden)."""
    page.locator(f".st-key-{key} button:visible").click()


def generate_and_wait(page, run_id: int = 1, timeout_ms: int = 120_000) -> None:  # type: ignore[no-untyped-def]
    click(page, "generate")
    page.wait_for_selector(f".st-key-run_done_{run_id}", timeout=timeout_ms)


def chart_titles(page) -> list[str]:  # type: ignore[no-untyped-def]
    return page.locator(".js-plotly-plot .gtitle").all_text_contents()


def wait_for_chart_title(page, text: str) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_function("t => [...document.querySelectorAll('.js-plotly-plot .gtitle')]"
                           ".some(e => e.textContent.includes(t))", arg=text)


def use_trained_model_if_present(page) -> None:  # type: ignore[no-untyped-def]
    """Screenshots look best on the shipped model; the tests pass on random:tiny too."""
    page.locator(".st-key-model button[aria-label='Open']").click()
    option = page.get_by_role("option", name=re.compile(r"^default"))
    page.get_by_role("option").first.wait_for()
    if option.count() > 0:
        option.first.click()
        page.wait_for_function("document.querySelector('.st-key-model input').value.includes('Shakespeare')")
        page.get_by_text(re.compile(r"context 512 ")).wait_for()
    else:
        page.keyboard.press("Escape")


def test_generate_shows_text_and_all_charts(page, app_url: str, screenshot) -> None:  # type: ignore[no-untyped-def]
    open_app(page, app_url)
    use_trained_model_if_present(page)
    prompt = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
    set_prompt(page, prompt)
    set_max_new_tokens(page, 60)
    generate_and_wait(page)
    out = page.locator(".st-key-output")
    assert out.locator(".kv-plain").inner_text().startswith(prompt.strip("\n").split("\n")[0])
    assert out.locator(".kv-chip.kv-g").count() >= 60  # generated chips (+1 in the legend)
    assert out.locator(".kv-chip.kv-p").count() >= len(prompt)
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 4")
    titles = " | ".join(chart_titles(page))
    for expected in ("The KV cache after step 59", "Where the newest token looks", "attention weights",
                     "Time per step"):
        assert expected in titles, titles
    assert "Run #1 finished: 60 tokens" in page.locator(".st-key-run_done_1").inner_text()
    # Each chart's preset margins held its labels: Plotly laid it out once (charts/render_cost.py).
    assert not grown_margins(page, LIVE_TITLES), grown_margins(page, LIVE_TITLES)
    page.mouse.move(0, 0)  # no tooltip in the picture
    screenshot(page, "generate.png")


def test_replay_scrubs_and_plays(page, app_url: str, screenshot) -> None:  # type: ignore[no-untyped-def]
    open_app(page, app_url)
    use_trained_model_if_present(page)
    set_prompt(page, "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n")
    set_max_new_tokens(page, 40)
    generate_and_wait(page)
    slider = page.locator(".st-key-replay_step input[type='range']")
    slider.focus()
    slider.press("Home")
    page.get_by_text("Replaying step 0 of 39").wait_for()
    wait_for_chart_title(page, "after step 0:")
    for i in range(1, 18):  # one key at a time: each step is a rerun, and keys pressed mid-rerun can be lost
        slider.press("ArrowRight")
        page.get_by_text(f"Replaying step {i} of 39").wait_for()
    wait_for_chart_title(page, "after step 17:")
    page.mouse.move(0, 0)
    screenshot(page, "replay.png")
    # Play the last steps at the fastest speed: playback stops by itself at the end.
    slider.focus()
    slider.press("End")
    page.wait_for_function("!document.querySelector('.st-key-run_done_1').textContent.includes('Replaying')")
    for i in (38, 37, 36, 35):
        slider.press("ArrowLeft")
        page.get_by_text(f"Replaying step {i} of 39").wait_for()
    speed = page.locator(".st-key-replay_speed input[type='range']")
    speed.focus()
    speed.press("End")
    page.wait_for_selector(".st-key-replay_speed [data-testid='stSliderThumbValue']:has-text('10')")
    click(page, "replay_play")
    page.wait_for_selector(".st-key-replay_play button:visible:has-text('Pause')")
    page.wait_for_selector(".st-key-replay_play button:visible:has-text('Play')", timeout=60_000)
    # It stopped by itself at the last step.
    page.wait_for_function("!document.querySelector('.st-key-run_done_1').textContent.includes('Replaying')")
    wait_for_chart_title(page, "after step 39:")


def test_stop_keeps_the_partial_run(page, app_url: str) -> None:  # type: ignore[no-untyped-def]
    open_app(page, app_url)
    set_max_new_tokens(page, 300)
    page.locator(".st-key-present label").click()  # presentation speed: slow enough to press Stop
    page.wait_for_selector(".st-key-speed_tps input[type='range']:not([disabled])")
    click(page, "generate")
    page.get_by_text(re.compile(r"generated\s+[3-9] of 300")).wait_for()
    click(page, "stop")
    marker = page.wait_for_selector(".st-key-run_done_1")
    assert "stopped by the user" in marker.inner_text()
    page.get_by_text(re.compile(r"Stopped: run #1 is kept")).wait_for()
    n = int(re.search(r"finished: (\d+) tokens", marker.inner_text()).group(1))
    assert 3 <= n < 300


def test_a_new_run_replaces_the_last_one_on_screen(page, app_url: str) -> None:  # type: ignore[no-untyped-def]
    """While run #2 streams, the page shows run #2 alone: not run #1's text, numbers and charts,
    greyed, inside and under it (Streamlit keeps a replaced block's children; live.py's run view
    drops them), and not after a notice about run #1, which moves everything below it."""
    open_app(page, app_url)
    set_max_new_tokens(page, 300)
    page.locator(".st-key-present label").click()  # presentation speed: slow enough to look mid-run
    page.wait_for_selector(".st-key-speed_tps input[type='range']:not([disabled])")
    click(page, "generate")
    page.get_by_text(re.compile(r"generated\s+[3-9] of 300")).wait_for()
    click(page, "stop")
    page.wait_for_selector(".st-key-run_done_1")
    page.get_by_text(re.compile(r"Stopped: run #1 is kept")).wait_for()  # a notice above the view
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 4")
    click(page, "generate")
    page.wait_for_selector(".st-key-run_live_2")
    page.get_by_text(re.compile(r"generated\s+[3-9] of 300")).wait_for()
    # Stale: drawn by the last script run and not yet by this one (Streamlit greys them). Empty
    # placeholders draw nothing, stale or not.
    shown = page.evaluate("""() => ({chips: document.querySelectorAll('.kv-chips').length,
        done1: document.querySelectorAll('.st-key-run_done_1').length,
        stale: [...document.querySelectorAll("[data-stale='true']")]
            .filter(e => e.firstElementChild?.getAttribute('data-testid') !== 'stEmpty')
            .map(e => e.firstElementChild?.getAttribute('data-testid') + ': ' + e.innerText.slice(0, 40))})""")
    assert shown["chips"] == 1 and shown["done1"] == 0 and not shown["stale"], shown
    click(page, "stop")
    marker = page.wait_for_selector(".st-key-run_done_2")
    assert "stopped by the user" in marker.inner_text()


def test_step_mode_without_a_cache(page, app_url: str, screenshot) -> None:  # type: ignore[no-untyped-def]
    """Step through a no-cache run: every column is recomputed at every step, and nothing is kept."""
    open_app(page, app_url)
    use_trained_model_if_present(page)
    set_prompt(page, "KING RICHARD III:\nNow is the winter of our discontent\n")
    set_max_new_tokens(page, 24)
    page.locator(".st-key-cache_mode label:has-text('No cache')").click()
    page.wait_for_function("document.querySelector('.st-key-cache_mode input[type=radio]:checked')"
                           "?.closest('label')?.textContent.includes('No cache')")
    # Step mode's charts are kept (kvviz/ui/common/kept_chart.py): each press redraws the same nodes with the
    # new step's figure instead of mounting new charts. The cache chart's node after the first press
    # must be the one on the page after every later press, showing that press's step.
    # A chart off screen waits until it scrolls into view, so the page is made tall enough to show all
    # four (a click scrolls back up to the Step button).
    nodes = "[...document.querySelectorAll('.kvviz-kept-chart')]"
    page.set_viewport_size({"width": 1400, "height": 4000})
    first_cols = 0
    for i in range(1, 9):
        click(page, "step")
        page.get_by_text(f"step mode, {i} of 24 steps so far").wait_for()
        wait_for_chart_title(page, f"No cache, step {i - 1}: all")
        page.wait_for_function(f"{nodes}.length === 4")
        if i == 1:
            page.evaluate(f"window.__kvvizFirst = {nodes}")
        kept = page.evaluate(f"{nodes}.map((d, j) => d === window.__kvvizFirst[j] && d.isConnected)")
        assert kept == [True] * 4, (i, kept)
        # The kept cache chart's figure is this step's: one more column per press.
        cols = int(page.evaluate(f"{nodes}[0].layout.title.text.match(/all (\\d+) K\\/V columns/)[1]"))
        if i == 1:
            first_cols = cols
        assert cols == first_cols + i - 1, (i, cols, first_cols)
        # ... and so is the kept time chart's (the last of the four), once this press's figure reaches it.
        page.wait_for_function(f"{nodes}[3].layout.title.text.startsWith('Time per step, {i} of 24 steps')")
    page.mouse.move(0, 0)  # no tooltip in the picture
    screenshot(page, "step-no-cache.png")


def test_hostile_prompt_renders_literally(page, app_url: str) -> None:  # type: ignore[no-untyped-def]
    """HTML, emoji and right-to-left text in the prompt: shown as text, nothing injected, no dialog."""
    open_app(page, app_url)
    set_prompt(page, XSS_PROMPT)
    set_max_new_tokens(page, 8)
    generate_and_wait(page)
    out = page.locator(".st-key-output")
    plain = out.locator(".kv-plain").inner_text()
    assert plain.startswith(XSS_PROMPT.rstrip("\n"))
    assert out.locator("img").count() == 0 and out.locator("b").count() == 0
    assert page.locator("img[src='x']").count() == 0
    chips_text = out.locator(".kv-chips").inner_text()
    assert "<img·src=x·onerror=alert(1)>" in chips_text.replace("\n", "")
    assert "😀" in chips_text and "ש" in chips_text  # bytes grouped back into characters
    # The fixture fails the test if any dialog (alert) opened.


def test_two_sessions_generate_at_the_same_time(browser, app_url: str) -> None:  # type: ignore[no-untyped-def]
    """Two browser sessions share the cached model but not their runs: both finish, same text."""
    contexts = [browser.new_context(viewport={"width": 1400, "height": 900}) for _ in range(2)]
    try:
        pages = [c.new_page() for c in contexts]
        for pg in pages:
            pg.set_default_timeout(120_000)
            open_app(pg, app_url)
            set_max_new_tokens(pg, 80)
        for pg in pages:  # start both before waiting for either
            click(pg, "generate")
        texts = []
        for pg in pages:
            pg.wait_for_selector(".st-key-run_done_1")
            texts.append(pg.locator(".st-key-output .kv-plain").inner_text())
        assert texts[0] == texts[1] and len(texts[0]) > len("ROMEO:")
    finally:
        for c in contexts:
            c.close()


def test_sidebar_values_survive_the_calculator_page(page, app_url: str) -> None:  # type: ignore[no-untyped-def]
    """The calculator page has no sidebar controls; coming back must find them as they were."""
    open_app(page, app_url)
    set_prompt(page, "Kept across pages\n")
    set_max_new_tokens(page, 33)
    page.get_by_role("link", name=re.compile("KV memory calculator")).click()
    page.wait_for_selector(".st-key-prompt", state="detached")
    page.get_by_role("link", name=re.compile("^Generate")).click()
    page.wait_for_selector(".st-key-prompt textarea")
    assert page.locator(".st-key-prompt textarea").input_value() == "Kept across pages\n"
    assert page.locator(".st-key-max_new_tokens input").input_value() == "33"
