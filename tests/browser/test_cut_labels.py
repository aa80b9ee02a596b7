"""No cut label on any page at 1366x768 or 1920x1080 (issue 36).

The app as `make run` starts it (SmolLM2 where installed, so the sidebar's model box shows its real
label). One browser, one context per screen size. At 1366x768 every page is opened, what is cheap
to run is run (a 6-token answer on Generate, an 8-token race, the Compression lab's 8-token
comparison, three short requests served, a made-up vLLM log in the calculator's reconciler), every
step of the tour is walked, and the presentation layout (``?present=1``) is opened after a short
run, where the cache and attention charts must start on the first screen. At 1920x1080, where the
normal layout has the most room, the Generate page and the presentation layout (its larger type is
the tight case there). On each, ``cut_labels`` (cut_labels.py) must find nothing: no button, tab,
selectbox value, metric, table cell, code block or chart label cut, and no chart label outside its
chart or over another label. Screenshots of each go to test-results/screenshots/cut-*.png: look at
them.
"""
from __future__ import annotations

import re

import pytest

from conftest import SCREENSHOTS, _shrink_png
from cut_labels import cut_labels

IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
STARTUP_MS = 300_000  # the first page loads the default model on a loaded 2-core box
RUN_MS = 180_000
PLOTS_DRAWN = "[...document.querySelectorAll('.js-plotly-plot')].every(p => p.querySelector('.main-svg'))"
# A vLLM startup log, as vLLM V1 prints it (numbers made up; the reconciler explains each line).
VLLM_LOG = ("INFO 05-01 12:00:00 [gpu_worker.py:227] Available KV cache memory: 30.00 GiB\n"
            "INFO 05-01 12:00:00 [kv_cache_utils.py:716] GPU KV cache size: 245,760 tokens\n"
            "INFO 05-01 12:00:00 [kv_cache_utils.py:720] Maximum concurrency for 8,192 tokens per request: 30.00x\n"
            "INFO 05-01 12:00:00 [gpu_model_runner.py:1680] Model loading took 0.26 GiB and 1.2 seconds\n")


def _idle(page, timeout: int = RUN_MS) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_selector(IDLE, timeout=timeout)


def _set_number(page, key: str, value: int) -> None:  # type: ignore[no-untyped-def]
    box = page.locator(f".st-key-{key} input").first
    box.fill(str(value))
    box.press("Tab")
    page.wait_for_function(f"() => document.querySelector('.st-key-{key} input').value === '{value}'")
    _idle(page)


def _click_until(page, key: str, done: str) -> None:  # type: ignore[no-untyped-def]
    """Click the button ``key`` and wait for the selector ``done``; a click that lands while a rerun
    replaces the button is lost, so once the app is idle without ``done`` it is clicked again."""
    for _ in range(2):
        page.locator(f".st-key-{key} button:visible").first.click()
        try:
            page.wait_for_selector(done, timeout=20_000)
            break
        except Exception:  # noqa: BLE001 - playwright's TimeoutError: a long run, or a lost click
            _idle(page)
            if page.locator(done).count():
                break
    page.wait_for_selector(done, timeout=RUN_MS)
    _idle(page)


def _generate(page) -> None:  # type: ignore[no-untyped-def]
    _set_number(page, "max_new_tokens", 6)
    _click_until(page, "generate", ".st-key-view_metrics [data-testid=stMetric]")


def _race(page) -> None:  # type: ignore[no-untyped-def]
    _set_number(page, "max_new_tokens", 8)
    _click_until(page, "race_start", ".st-key-race_verdict")
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 7", timeout=RUN_MS)


def _compress(page) -> None:  # type: ignore[no-untyped-def]
    _set_number(page, "kvq_new", 8)
    _click_until(page, "kvq_run", ".js-plotly-plot")


def _calculator(page) -> None:  # type: ignore[no-untyped-def]
    box = page.locator(".st-key-mem_eng_log textarea").first
    box.fill(VLLM_LOG)
    box.press("Control+Enter")  # a text area takes its text on Ctrl+Enter or on leaving it
    page.get_by_text("Side by side").first.wait_for()  # the reconciled table's caption
    _idle(page)
    page.evaluate("document.querySelector('[data-testid=stMain]').scrollTo(0, 1e9)")  # the table is last
    page.wait_for_function("() => [...document.querySelectorAll('[data-testid=stDataFrame], [data-testid=stTable]')]"
                           ".some(t => t.textContent.includes('GPU KV cache size'))")


def _serving(page) -> None:  # type: ignore[no-untyped-def]
    for key, value in (("serve_requests", 3), ("serve_prompt_max", 12), ("serve_output_max", 4),
                       ("serve_shared_len", 8)):
        _set_number(page, key, value)
    _click_until(page, "serve_run", ".st-key-serve_numbers [data-testid=stMetric]")
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 7", timeout=RUN_MS)


# (path, what to run first): each page once per size.
PAGES = [("", _generate), ("race", _race), ("prefill", None), ("batching", None), ("chat", None),
         ("decoding", None), ("compress", _compress), ("serving", _serving), ("calculator", _calculator)]
TIGHT = (1366, 768)
SIZES = [TIGHT, (1920, 1080)]
CHART_ON_SCREEN = 200  # px of the presentation layout's charts on the first screen, at least (the title and a plot)


def _check(page, name: str, problems: dict[str, list[str]], size: tuple[int, int],  # type: ignore[no-untyped-def]
           full: bool = True) -> None:
    """Measure every chart, scrolled into view in turn (Plotly lays out a chart only once shown), then
    the page; screenshot the page's top, and with ``full`` the whole page (a tour step's page is the
    Generate page's, shot whole already: its card is at the top)."""
    page.wait_for_function(PLOTS_DRAWN)
    found = cut_labels(page)
    # A grid dataframe writes its cells' text only while on screen: bring each (and each chart) into view.
    shown = page.locator(".js-plotly-plot, [data-testid=stDataFrame]")
    for i in range(shown.count()):
        try:
            shown.nth(i).evaluate("e => e.scrollIntoView({block: 'center'})", timeout=5_000)
        except Exception:  # noqa: BLE001 - playwright's Error: a rerun replaced it; it is measured where it is
            continue
        found += cut_labels(page)
    found = sorted(set(found))
    if found:
        problems[f"{name} {size[0]}x{size[1]}"] = found
    page.evaluate("document.querySelector('[data-testid=stMain]')?.scrollTo(0, 0)")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.mouse.move(size[0] - 5, size[1] - 5)  # no tooltip over the picture
    page.screenshot(path=str(SCREENSHOTS / f"cut-{name}-{size[0]}.png"))  # the screen as a user sees it
    _shrink_png(SCREENSHOTS / f"cut-{name}-{size[0]}.png")
    # And the whole page: the window grown to the page's height (Streamlit scrolls inside stMain).
    height = page.evaluate("document.querySelector('[data-testid=stMain]').scrollHeight")
    if full and height > size[1] + 24:
        page.set_viewport_size({"width": size[0], "height": int(height) + 24})
        page.wait_for_function(PLOTS_DRAWN)
        page.screenshot(path=str(SCREENSHOTS / f"cut-{name}-{size[0]}-full.png"))
        _shrink_png(SCREENSHOTS / f"cut-{name}-{size[0]}-full.png")
        page.set_viewport_size({"width": size[0], "height": size[1]})


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_no_label_is_cut(browser, make_run_url: str, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    w, h = size
    context = browser.new_context(viewport={"width": w, "height": h}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(STARTUP_MS)
    problems: dict[str, list[str]] = {}
    try:
        # Every page and tour step at the tight screen; at 1920x1080 the normal layout has the most room
        # of all (test_layout_fit says so too), so there the Generate page (the widest text: chips,
        # legend, metrics) and the presentation layout below, whose larger type is the tight case.
        walk = PAGES if size == TIGHT else PAGES[:1]
        for path, run in walk:
            page.goto(f"{make_run_url}/{path}")
            page.wait_for_selector("[data-testid=stMain]")
            _idle(page, STARTUP_MS)
            if run:
                run(page)
            _check(page, path or "generate", problems, size)
        if size == TIGHT:
            # The tour: every step's card (its Back, Next and action buttons), after a short run.
            page.goto(f"{make_run_url}/?tour=1")
            page.wait_for_selector(".st-key-tour_card")
            _idle(page, STARTUP_MS)
            _generate(page)
            card = page.locator(".st-key-tour_card")
            total = int(re.search(r"step \d+ of (\d+)", card.inner_text()).group(1))
            for n in range(1, total + 1):
                if n > 1:
                    page.locator(".st-key-tour_next button:visible").first.click()
                    card.get_by_text(f"step {n} of {total}").first.wait_for()
                    _idle(page)
                _check(page, f"tour-step{n}", problems, size, full=False)
        # The presentation layout, after a short run.
        page.goto(f"{make_run_url}/?present=1")
        page.wait_for_selector("[data-testid=stMain]")
        _idle(page, STARTUP_MS)
        _generate(page)
        # The metrics show from the first step; the cache and attention charts once the run's last
        # rerun draws them (on a busy machine seconds later): the layout is judged with them drawn.
        for key in ("view_notebook", "view_attention"):
            page.wait_for_selector(f".st-key-{key} .js-plotly-plot", timeout=RUN_MS)
        _idle(page)
        _check(page, "present", problems, size)
        # The point of the layout: the cache and attention charts on the screen with the chips. At
        # 1366x768 they started at its bottom edge; at least CHART_ON_SCREEN px of each must show.
        for key in ("view_notebook", "view_attention"):
            top = page.evaluate(f"document.querySelector('.st-key-{key} .js-plotly-plot')?.getBoundingClientRect().top ?? 1e9")
            if top > h - CHART_ON_SCREEN:
                problems.setdefault(f"present {w}x{h}", []).append(f"{key} starts {top:.0f} px down a {h} px screen")
    finally:
        context.close()
    assert not problems, "\n".join(f"{k}:\n  " + "\n  ".join(v) for k, v in problems.items())
