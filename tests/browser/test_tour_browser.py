"""The tour and the presentation layout, as a presenter meets them: the app started as `make run` starts
it, a 1920x1080 window, the layout switched on, every step of the tour taken (N for next, S for Step,
the card's own buttons) and the two pages its steps link to (the calculator and the race), on the
model `make run` opens with (SmolLM2 in chat mode where installed), and then the Shakespeare
model's notebook and attention in the same layout. The other pages are left to their own tests
and to test_layout_fit, which measures every page in this layout at 1366x768 and 1920x1080.

Screenshots of each step and page go to test-results/screenshots/ (``tour-*.png``, ``present-*.png``):
they are what a learner and a presenter see; look at them. The checks are what must hold on any
machine: the sidebar folds away, the base font grows, each step's card says its step, the chips, the
cache notebook and the attention map end above the fold at 1920x1080, each page it opens runs, and the page
never reaches past the machine it runs on (no font CDN, no favicon fetched from elsewhere) nor logs
a JavaScript error. Every wait is on visible state, with generous timeouts for a loaded 2-core box.
"""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

from conftest import SCREENSHOTS, _shrink_png

WIDE = {"width": 1920, "height": 1080}
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
STARTUP_TIMEOUT_MS = 300_000  # the first page loads and dequantizes the default model
SLOW_MS = 300_000  # a measurement page or a run on a loaded 2-core machine
N_NEW = 60
# A chat question whose greedy answer outlasts the tour's six steps (SmolLM2 answers at length).
QUESTION = "In two sentences, what does a KV cache store in a transformer?"
VERSE = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n"
BOXES_JS = """keys => Object.fromEntries(keys.map(k => { const e = document.querySelector('.st-key-' + k);
    const r = e && e.getBoundingClientRect(); return [k, r ? Math.round(r.bottom) : null]; }))"""
# Text cut off at its box's right edge: a metric value or a one-line header wider than its box.
CLIPPED_JS = """() => [...document.querySelectorAll("[data-testid='stMetricValue'] div, .st-key-page_title h2")]
    .filter(e => e.offsetParent && e.scrollWidth > e.clientWidth + 1).map(e => e.innerText)"""
FOLD_VIEWS = ["output", "view_notebook", "view_attention"]


def idle(page, timeout_ms: int = 180_000) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_selector(IDLE, timeout=timeout_ms)


def wait_marker(page, marker: str, timeout_ms: int = SLOW_MS) -> None:  # type: ignore[no-untyped-def]
    """Wait for an app marker (``.st-key-run_done_1``), failing at once if the script raised instead."""
    got = page.wait_for_selector(f"{marker}, [data-testid='stException']", timeout=timeout_ms)
    assert "stException" not in (got.get_attribute("data-testid") or ""), got.inner_text()


def shot(page, name: str, full: bool = False) -> Path:  # type: ignore[no-untyped-def]
    """The window as the audience sees it (``full``: the whole page, grown to its height)."""
    page.mouse.move(5, 1075)  # no hover tooltip in the picture
    page.wait_for_function("[...document.querySelectorAll('.js-plotly-plot')].every(p => p.querySelector('.main-svg'))")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    if full:
        height = page.evaluate("""() => Math.max(...['stMain', 'stAppViewContainer', 'stMainBlockContainer']
            .map(t => document.querySelector(`[data-testid='${t}']`)).filter(e => e).map(e => e.scrollHeight))""")
        page.set_viewport_size({"width": WIDE["width"], "height": int(height) + 24})
        page.wait_for_timeout(500)  # one Plotly resize after the viewport change (not a readiness wait)
        page.screenshot(path=str(path), full_page=True)
        page.set_viewport_size(WIDE)
    else:
        page.wait_for_timeout(300)  # the last Plotly transition (not a readiness wait)
        page.screenshot(path=str(path))
    _shrink_png(path)
    return path


def click(page, key: str) -> None:  # type: ignore[no-untyped-def]
    """Click the button with this key (a button with help text is in the DOM twice, one hidden)."""
    page.locator(f".st-key-{key} button:visible").first.click()


def card_says(page, text: str) -> None:  # type: ignore[no-untyped-def]
    page.locator(".st-key-tour_card").get_by_text(text).first.wait_for()


def key(page, k: str) -> None:  # type: ignore[no-untyped-def]
    """A keyboard shortcut, pressed with nothing focused (as a presenter's clicker would)."""
    page.evaluate("document.activeElement && document.activeElement.blur()")
    page.keyboard.press(k)


def next_step(page, n: int, title: str) -> None:  # type: ignore[no-untyped-def]
    idle(page)
    key(page, "n")
    card_says(page, f"step {n} of 9: {title}")
    idle(page)


def step_to(page, run_id: int, n: int) -> None:  # type: ignore[no-untyped-def]
    page.locator(f".st-key-run_stepping_{run_id}").get_by_text(f"step mode, {n} of {N_NEW} steps").first.wait_for()
    idle(page)


def open_sidebar(page) -> None:  # type: ignore[no-untyped-def]
    page.locator("[data-testid='stExpandSidebarButton']").click()
    page.wait_for_function("(document.querySelector(\"[data-testid='stSidebar']\")?.getBoundingClientRect().right ?? 0) > 200")


def fold_sidebar(page) -> None:  # type: ignore[no-untyped-def]
    collapse = page.locator("[data-testid='stSidebarCollapseButton'] button")
    if collapse.count() and collapse.first.is_visible():
        collapse.first.click()
    page.wait_for_function("(document.querySelector(\"[data-testid='stSidebar']\")?.getBoundingClientRect().right ?? 0) < 5")


def sidebar_nav(page, name: str, path: str) -> None:  # type: ignore[no-untyped-def]
    """Open the folded sidebar, follow a page link until the address is the page's, and fold it again."""
    open_sidebar(page)
    link = page.locator("[data-testid='stSidebarNav']").get_by_role("link", name=re.compile(name))
    for _ in range(3):  # a click during the sidebar's slide-in can land beside the link
        link.click()
        try:
            page.wait_for_url(re.compile(rf"/{path}(\?|$)"), timeout=20_000)
            break
        except Exception:  # noqa: BLE001 - playwright's TimeoutError: click again
            continue
    idle(page)
    fold_sidebar(page)


def select_model(page, prefix: str) -> None:  # type: ignore[no-untyped-def]
    """Pick a model by the start of its picker entry ("shakespeare: byte-level, ...")."""
    if page.locator(".st-key-model input").input_value().startswith(prefix):
        return
    page.locator(".st-key-model button[aria-label='Open']").click()
    page.get_by_role("option", name=re.compile(rf"^{re.escape(prefix)}")).first.click()
    page.wait_for_function(f"document.querySelector('.st-key-model input').value.startsWith({prefix!r})")
    idle(page, STARTUP_TIMEOUT_MS)


def set_prompt_and_length(page, prompt: str) -> None:  # type: ignore[no-untyped-def]
    box = page.locator(".st-key-prompt textarea")
    box.fill(prompt)
    box.press("Control+Enter")
    idle(page)
    n_new = page.locator(".st-key-max_new_tokens input")
    n_new.fill(str(N_NEW))
    n_new.press("Enter")
    page.get_by_text(re.compile(rf"\+ {N_NEW} new = ")).first.wait_for()
    idle(page)


def above_fold(page) -> dict[str, int | None]:  # type: ignore[no-untyped-def]
    return page.evaluate(BOXES_JS, FOLD_VIEWS)


def test_tour_every_step_and_page_in_the_presentation_layout(browser, make_run_url: str) -> None:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport=WIDE, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(180_000)
    errors: list[str] = []
    elsewhere: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("request", lambda r: elsewhere.append(r.url)
            if urlparse(r.url).hostname not in (None, "127.0.0.1", "localhost") and r.url.startswith("http") else None)
    folds: dict[str, dict[str, int | None]] = {}
    clipped: dict[str, list[str]] = {}
    try:
        page.goto(make_run_url)
        page.wait_for_selector(".st-key-generate button", timeout=STARTUP_TIMEOUT_MS)
        idle(page, STARTUP_TIMEOUT_MS)
        default_model = page.locator(".st-key-model input").input_value()
        chat = page.locator(".st-key-chat input[type='checkbox']")
        set_prompt_and_length(page, QUESTION if chat.count() and chat.is_checked() else VERSE)
        # One switch: the sidebar folds away, the fonts grow, the URL says ?present=1.
        page.locator(".st-key-present_layout label").click()
        page.locator("[data-testid='stExpandSidebarButton']").wait_for()
        idle(page)
        assert page.evaluate("getComputedStyle(document.documentElement).fontSize") == "19px"
        assert "present=1" in page.url

        click(page, "tour_start")
        card_says(page, "step 1 of 9: What a token is")
        idle(page)
        assert "tour=1" in page.url
        shot(page, "tour-1-start.png")
        click(page, "tour_action")  # step 1's action: Generate
        wait_marker(page, ".st-key-run_done_1")
        idle(page)
        shot(page, "tour-1-tokens.png")
        folds["tour-1"] = above_fold(page)
        clipped["tour-1"] = page.evaluate(CLIPPED_JS)

        next_step(page, 2, "Q, K and V")
        shot(page, "tour-2-qkv.png")
        next_step(page, 3, "Prefill")
        key(page, "s")  # Step, by its key
        step_to(page, 2, 1)
        shot(page, "tour-3-prefill.png")
        next_step(page, 4, "Decode")
        for i in range(2, 7):
            key(page, "s")
            step_to(page, 2, i)
        shot(page, "tour-4-decode.png")
        next_step(page, 5, "The same without a cache")
        click(page, "tour_action")  # no cache, and the first step
        step_to(page, 3, 1)
        for i in range(2, 5):
            key(page, "s")
            step_to(page, 3, i)
        shot(page, "tour-5-no-cache.png")
        next_step(page, 6, "Attention over the cache")
        click(page, "tour_action")  # the static cache again, and Generate
        wait_marker(page, ".st-key-run_done_4")
        idle(page)
        shot(page, "tour-6-attention.png")
        folds["tour-6"] = above_fold(page)
        clipped["tour-6"] = page.evaluate(CLIPPED_JS)
        next_step(page, 7, "Memory")
        shot(page, "tour-7-memory.png")
        page.get_by_role("link", name=re.compile("Open the calculator")).click()
        page.locator(".st-key-tour_banner").first.wait_for()
        idle(page)
        # It opens on step 7's example: Llama-2-70B at 4,096 tokens, fp16 (80 x 8 x 128 x 2 x 2 B = 320 KiB/token).
        page.get_by_text("320.00 KiB").first.wait_for()
        assert "Llama-2-70B" in page.locator("[data-testid='stMain']").inner_text()
        shot(page, "present-calculator.png")
        shot(page, "present-calculator-full.png", full=True)
        page.get_by_role("link", name=re.compile("Back to the tour")).click()
        card_says(page, "step 7 of 9")
        next_step(page, 8, "Speed")
        shot(page, "tour-8-speed.png")
        # Step 8 links to the race; running it is the timing lessons' test (at its defaults, on the
        # same model) and every page's present layout is measured by test_layout_fit, so here the
        # link only has to land on the race with the tour's banner.
        page.get_by_role("link", name=re.compile("Open the race")).click()
        page.locator(".st-key-tour_banner").first.wait_for()
        page.locator(".st-key-race_start button").first.wait_for()
        idle(page)
        shot(page, "present-race.png")

        # The presentation layout alone, the tour ended: chips, cache and attention above the fold.
        sidebar_nav(page, "Generate", "")
        click(page, "tour_end")
        idle(page)
        idle(page)
        page.locator(".st-key-run_done_4").first.wait_for()  # a stale copy may linger during the rerun
        assert "tour=" not in page.url
        folds["present"] = above_fold(page)
        clipped["present"] = page.evaluate(CLIPPED_JS)
        shot(page, "present-generate.png")
        shot(page, "present-generate-full.png", full=True)

        # The byte-level Shakespeare model in the same layout, at the tour's attention step.
        if not default_model.startswith("shakespeare"):
            open_sidebar(page)
            select_model(page, "shakespeare")
            page.get_by_text(re.compile(r"context 512 ")).first.wait_for()
            set_prompt_and_length(page, VERSE)
            fold_sidebar(page)
            click(page, "tour_start")
            card_says(page, "step 1 of 9")
            for n, title in enumerate(("Q, K and V", "Prefill", "Decode", "The same without", "Attention"), 2):
                next_step(page, n, title)
            click(page, "tour_action")
            wait_marker(page, ".st-key-run_done_5")
            idle(page)
            folds["shakespeare"] = above_fold(page)
            clipped["shakespeare"] = page.evaluate(CLIPPED_JS)
            shot(page, "tour-6-shakespeare.png")
    except Exception:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "tour-FAILED.png"))  # what the page showed when it failed
        raise
    finally:
        context.close()
    for name, bottoms in folds.items():
        assert all(b is not None and b <= WIDE["height"] for b in bottoms.values()), (name, bottoms)
    assert not any(clipped.values()), clipped
    assert not elsewhere, f"the page fetched from other hosts: {sorted(set(elsewhere))[:10]}"
    assert not errors, errors
