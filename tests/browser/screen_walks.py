"""One walk of the app's pages per screen, whose measures test_cut_labels and test_layout_fit assert on.

Both tests open every page at the same screens on the app as `make run` starts it, and the tour's
scroll test walks the same tour at 1366x768: walked once each (the ``screen_walk`` fixture in
conftest.py keeps each walk for the session), a page is loaded and run once, not two or three times.
Each page is measured in the state each test always measured it in:
- test_layout_fit (``layout_measure.measure_with_hover``): every page of ``FIT_PAGES`` as opened,
  the Generate page after a 6-token answer; screenshots ``layout-*.png``.
- test_cut_labels (``cut_labels.cut_labels``, every chart scrolled into view): after what is cheap
  to run on the page (``CUT_RUNS``), every tour step, and the presentation layout after a short
  run, with its cache and attention charts drawn; screenshots ``cut-*.png``.
- test_layout_fit's tour test: at 1366x768 in the normal layout, steps 2 and 6 ("the chart
  below") bring their chart into view; screenshots ``layout-tour-step*-1366.png``.

Three walks: 1366x768 in the normal layout (the pages, then the tour), 1366x768 in the presentation
layout, and 1920x1080 (the Generate page in the normal layout, then the pages in the presentation
layout). A walk's own failure (a page that never loads) is raised to every test that uses it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from conftest import SCREENSHOTS, _shrink_png
from cut_labels import cut_labels
from layout_measure import measure_with_hover

IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
STARTUP_MS = 300_000  # the first page loads and dequantizes the default model on a loaded 2-core box
RUN_MS = 180_000
PLOTS_DRAWN = "[...document.querySelectorAll('.js-plotly-plot')].every(p => p.querySelector('.main-svg'))"
# A vLLM startup log, as vLLM V1 prints it (numbers made up; the reconciler explains each line).
VLLM_LOG = ("INFO 05-01 12:00:00 [gpu_worker.py:227] Available KV cache memory: 30.00 GiB\n"
            "INFO 05-01 12:00:00 [kv_cache_utils.py:716] GPU KV cache size: 245,760 tokens\n"
            "INFO 05-01 12:00:00 [kv_cache_utils.py:720] Maximum concurrency for 8,192 tokens per request: 30.00x\n"
            "INFO 05-01 12:00:00 [gpu_model_runner.py:1680] Model loading took 0.26 GiB and 1.2 seconds\n")
TIGHT = (1366, 768)
WIDE = (1920, 1080)
CHART_ON_SCREEN = 200  # px of the presentation layout's charts on the first screen, at least (the title and a plot)
# In view: whole, or (taller than the window) its top at the window's top.
IN_VIEW_JS = """key => { const e = document.querySelector('.st-key-' + key); if (!e) return false;
    const r = e.getBoundingClientRect();
    return r.height > 40 && r.top >= -2 && (r.bottom <= innerHeight + 2 || r.top <= 2); }"""
RECT_JS = """key => { const r = document.querySelector('.st-key-' + key)?.getBoundingClientRect();
    return r ? [Math.round(r.top), Math.round(r.bottom), innerHeight] : null; }"""
# The tour steps that say "the chart below", and the chart each names.
TOUR_CHARTS = {2: ("Q, K and V", "view_notebook"), 6: ("Attention over the cache", "view_attention")}


@dataclass
class Walk:
    """What one walk measured: test_layout_fit's problems by page, test_cut_labels' by page and
    screen, and the tour scroll test's (1366x768 normal layout only)."""
    fits: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    cut: dict[str, list[str]] = field(default_factory=dict)
    tour_view: list[str] = field(default_factory=list)


def _idle(page, timeout: int = RUN_MS) -> None:  # type: ignore[no-untyped-def]
    page.wait_for_selector(IDLE, timeout=timeout)


def set_number(page, key: str, value: int, timeout: int = RUN_MS) -> None:  # type: ignore[no-untyped-def]
    """Type ``value`` into the number input ``key``, leave it, and wait for the app's rerun."""
    box = page.locator(f".st-key-{key} input").first
    box.fill(str(value))
    box.press("Tab")
    page.wait_for_function(f"() => document.querySelector('.st-key-{key} input').value === '{value}'")
    _idle(page, timeout)


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
    """A 6-token answer on Generate, so its numbers, chips and charts are drawn."""
    set_number(page, "max_new_tokens", 6)
    _click_until(page, "generate", ".st-key-view_metrics [data-testid=stMetric]")


def _race(page) -> None:  # type: ignore[no-untyped-def]
    set_number(page, "max_new_tokens", 8)
    _click_until(page, "race_start", ".st-key-race_verdict")
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 7", timeout=RUN_MS)


def _compress(page) -> None:  # type: ignore[no-untyped-def]
    set_number(page, "kvq_new", 8)
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
        set_number(page, key, value)
    _click_until(page, "serve_run", ".st-key-serve_numbers [data-testid=stMetric]")
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 7", timeout=RUN_MS)


# test_cut_labels' pages (path: what to run first, after Generate's short run), test_layout_fit's,
# and the order a walk opens them in (each once).
CUT_RUNS = {"": None, "race": _race, "prefill": None, "batching": None, "chat": None, "decoding": None,
            "compress": _compress, "serving": _serving, "calculator": _calculator}
FIT_PAGES = ["", "race", "prefill", "batching", "chat", "decoding", "compress", "calculator", "live"]
WALK_ORDER = ["", "race", "prefill", "batching", "chat", "decoding", "compress", "serving", "calculator", "live"]


def _check_cut(page, name: str, problems: dict[str, list[str]], size: tuple[int, int],  # type: ignore[no-untyped-def]
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


def _check_fit(page, path: str, walk: Walk, size: tuple[int, int], present: bool) -> None:  # type: ignore[no-untyped-def]
    """test_layout_fit's measure of the page as it stands, every chart hovered; its screenshot."""
    w, h = size
    page.wait_for_function(PLOTS_DRAWN)
    found = measure_with_hover(page)
    name = f"layout-{path or 'generate'}-{w}-{'present' if present else 'normal'}.png"
    page.mouse.move(w - 5, h - 5)
    page.evaluate("document.querySelector('[data-testid=stMain]')?.scrollTo(0, 0)")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / name))
    _shrink_png(SCREENSHOTS / name)
    bad = {k: v for k, v in found.items() if v}
    if bad:
        walk.fits[path or "generate"] = bad


def _open(page, url: str) -> None:  # type: ignore[no-untyped-def]
    page.goto(url)
    page.wait_for_selector("[data-testid=stMain]")
    _idle(page, STARTUP_MS)


def _present_generate(page, walk: Walk, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """test_cut_labels on the presentation layout after the short run: the metrics show from the first
    step, the cache and attention charts once the run's last rerun draws them (on a busy machine
    seconds later), so the layout is judged with them drawn. The point of the layout: those charts on
    the screen with the chips (at 1366x768 they started at its bottom edge): at least CHART_ON_SCREEN
    px of each must show."""
    w, h = size
    for key in ("view_notebook", "view_attention"):
        page.wait_for_selector(f".st-key-{key} .js-plotly-plot", timeout=RUN_MS)
    _idle(page)
    _check_cut(page, "present", walk.cut, size)
    for key in ("view_notebook", "view_attention"):
        top = page.evaluate(f"document.querySelector('.st-key-{key} .js-plotly-plot')?.getBoundingClientRect().top ?? 1e9")
        if top > h - CHART_ON_SCREEN:
            walk.cut.setdefault(f"present {w}x{h}", []).append(f"{key} starts {top:.0f} px down a {h} px screen")


def _present_pages(page, url: str, walk: Walk, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """Every FIT_PAGES page in the presentation layout (test_layout_fit), the Generate page after a
    short run, measured then for test_cut_labels too."""
    for path in FIT_PAGES:
        _open(page, f"{url}/{path}?present=1")
        if path == "":
            _generate(page)
        _check_fit(page, path, walk, size, present=True)
        if path == "":
            _present_generate(page, walk, size)


def _tour_view(page, n: int, walk: Walk) -> None:  # type: ignore[no-untyped-def]
    """Step ``n`` (2 or 6) says "the chart below": arriving at it brings that chart into view."""
    title, view = TOUR_CHARTS[n]
    try:
        page.locator(".st-key-tour_card").get_by_text(title).first.wait_for(timeout=30_000)
    except Exception:  # noqa: BLE001 - playwright's TimeoutError: the step is not the one named
        walk.tour_view.append(f"step {n}: the card does not say {title!r}: {page.locator('.st-key-tour_card').inner_text()[:200]}")
        return
    try:
        page.wait_for_function(IN_VIEW_JS, arg=view, timeout=30_000)
    except Exception:  # noqa: BLE001 - playwright's TimeoutError: say where the chart is
        page.screenshot(path=str(SCREENSHOTS / f"layout-tour-step{n}-1366-failed.png"))
        walk.tour_view.append(f"step {n}: {view} not in view, (top, bottom, window) = {page.evaluate(RECT_JS, view)}")
        return
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"layout-tour-step{n}-1366.png"))


def _tour(page, url: str, walk: Walk, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """Every tour step's card (its Back, Next and action buttons) after a short run (test_cut_labels),
    and on the way the tour scroll test's steps 2 and 6, from the page's top each time."""
    page.goto(f"{url}/?tour=1")
    page.wait_for_selector(".st-key-tour_card")
    _idle(page, STARTUP_MS)
    _generate(page)
    # At the page's top the chart step 2 names is below the fold: the step must scroll to it.
    page.evaluate("window.scrollTo(0, 0); document.querySelector('[data-testid=stMain]')?.scrollTo(0, 0)")
    try:
        page.wait_for_function(f"!({IN_VIEW_JS})('view_notebook')", timeout=30_000)
    except Exception:  # noqa: BLE001 - playwright's TimeoutError
        walk.tour_view.append(f"step 1: view_notebook already in view at the page's top: {page.evaluate(RECT_JS, 'view_notebook')}")
    card = page.locator(".st-key-tour_card")
    total = int(re.search(r"step \d+ of (\d+)", card.inner_text()).group(1))
    for n in range(1, total + 1):
        if n > 1:  # one step at a time: the card must say n before the next click
            page.evaluate("window.scrollTo(0, 0)")  # stMain is at its top after the last step's check
            page.locator(".st-key-tour_next button:visible").first.click()
            card.get_by_text(f"step {n} of {total}").first.wait_for()
            _idle(page)
        if n in TOUR_CHARTS:
            _tour_view(page, n, walk)
        _check_cut(page, f"tour-step{n}", walk.cut, size, full=False)


def walk_screen(browser, url: str, size: tuple[int, int], present: bool) -> Walk:  # type: ignore[no-untyped-def]
    """One walk (see the module's docstring); at 1920x1080 ``present`` is ignored: one walk there."""
    w, h = size
    walk = Walk()
    context = browser.new_context(viewport={"width": w, "height": h}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(STARTUP_MS)
    try:
        if size == TIGHT and not present:
            for path in WALK_ORDER:
                _open(page, f"{url}/{path}")
                if path == "":
                    _generate(page)
                if path in FIT_PAGES:
                    _check_fit(page, path, walk, size, present=False)
                if path in CUT_RUNS:
                    if CUT_RUNS[path]:
                        CUT_RUNS[path](page)
                    _check_cut(page, path or "generate", walk.cut, size)
            _tour(page, url, walk, size)
        elif size == TIGHT:
            _present_pages(page, url, walk, size)
        else:
            # The normal layout has the most room of all here (test_layout_fit's cases say so too):
            # only the Generate page (the widest text: chips, legend, metrics) for test_cut_labels.
            _open(page, f"{url}/")
            _generate(page)
            _check_cut(page, "generate", walk.cut, size)
            _present_pages(page, url, walk, size)
    except Exception:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"walk-{w}-{'present' if present else 'normal'}-FAILED.png"))
        raise
    finally:
        context.close()
    return walk
