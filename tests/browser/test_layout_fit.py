"""Every page fits the screens it is shown on: 1366x768 in the normal and the presentation layout
(``?present=1``) and 1920x1080 in the presentation layout, on the model `make run` opens with
(SmolLM2 where installed).

What a presenter met at 1366x768: buttons cut to "G…", "S X" and "Start t…", chart titles under
their charts' menu buttons, the chips legend broken mid-word ("ne / wline") and a metric's note cut
to "360.0 MiB alloc…". Each page is opened at each size and layout (the Generate page after a short
run, so its numbers are drawn), every chart hovered, and measured in the page itself:
- a button, a metric or anything inside them whose text is wider than its box (scrollWidth against
  clientWidth), or a button label or legend whose word runs over two lines;
- a chart title wider than its chart, or whose box meets its chart's mode bar, Streamlit's toolbar or
  a selector button.
Screenshots go to test-results/screenshots/layout-*.png: look at them.
"""
from __future__ import annotations

import re

import pytest

from conftest import SCREENSHOTS, _shrink_png

IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
PAGES = ["", "race", "prefill", "batching", "chat", "decoding", "compress", "calculator", "live"]
STARTUP_MS = 300_000  # the first page loads and dequantizes the default model on a loaded 2-core box

MEASURE_JS = """() => {
  const shown = e => { const r = e.getBoundingClientRect();
    return e.getClientRects().length > 0 && getComputedStyle(e).visibility !== 'hidden' && r.right > 0 && r.left < innerWidth; };
  const brokenWords = root => {  // words laid out over two lines
    const bad = [];
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      const re = /\\S+/g; let m;
      while ((m = re.exec(n.data))) {
        const r = document.createRange(); r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
        const tops = new Set([...r.getClientRects()].filter(x => x.width > 0).map(x => Math.round(x.top)));
        if (tops.size > 1) bad.push(m[0]);
      }
    }
    return bad;
  };
  const clipped = root => [root, ...root.querySelectorAll('*')].some(e => shown(e) && e.clientWidth > 0 &&
      e.scrollWidth > e.clientWidth + 1 && !['auto', 'scroll'].includes(getComputedStyle(e).overflowX));
  const out = {buttons: [], metrics: [], titles: [], words: []};
  for (const b of document.querySelectorAll('[data-testid=stMain] button, [data-testid=stSidebar] button')) {
    if (!shown(b)) continue;
    const txt = b.innerText.replace(/\\s+/g, ' ').trim();
    if (!txt) continue;
    if (clipped(b)) out.buttons.push(txt);
    const w = brokenWords(b); if (w.length) out.words.push('button ' + txt + ': ' + w.join(' '));
  }
  for (const m of document.querySelectorAll('[data-testid=stMetric]'))
    if (shown(m) && clipped(m)) out.metrics.push(m.innerText.replace(/\\s+/g, ' '));
  for (const l of document.querySelectorAll('.kv-legend, .legendtext, [data-testid=stMetricLabel]')) {
    if (!shown(l)) continue;
    const w = brokenWords(l); if (w.length) out.words.push('legend: ' + w.join(' '));
  }
  for (const p of document.querySelectorAll('.js-plotly-plot')) {
    const t = p.querySelector('.gtitle');
    if (!shown(p) || !t) continue;
    const tr = t.getBoundingClientRect(), boxes = [], pr = p.getBoundingClientRect();
    if (tr.right > pr.right + 1 || tr.left < pr.left - 1) out.titles.push('cut: ' + t.textContent.slice(0, 70));
    const mb = p.querySelector('.modebar');
    if (mb && shown(mb)) boxes.push(mb.getBoundingClientRect());
    const host = (p.closest('[data-testid=stElementContainer]') || p).parentElement;
    if (host) for (const b of host.querySelectorAll('[data-testid=stElementToolbar], [data-testid=stPopover]'))
      if (shown(b)) boxes.push(b.getBoundingClientRect());
    for (const r of boxes)
      if (r.width && tr.right > r.left && tr.left < r.right && tr.bottom > r.top && tr.top < r.bottom)
        out.titles.push(t.textContent.slice(0, 70));
  }
  return out;
}"""


def _measure_with_hover(page) -> dict[str, list[str]]:  # type: ignore[no-untyped-def]
    """The measures, with every chart hovered in turn (toolbars show on hover)."""
    found = page.evaluate(MEASURE_JS)
    plots = page.locator(".js-plotly-plot")
    for i in range(plots.count()):
        plot = plots.nth(i)
        # A chart on a tab not shown (or one a rerun just replaced) has no box to hover: skip it, as
        # MEASURE_JS skips what is not shown. Waiting for it to appear would wait forever.
        if not plot.is_visible():
            continue
        try:
            plot.scroll_into_view_if_needed(timeout=10_000)
        except Exception:  # noqa: BLE001 - playwright's TimeoutError: it went away mid-measure
            continue
        box = plot.bounding_box()
        if box:
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            page.wait_for_timeout(200)  # the toolbar's fade-in (not a readiness wait)
            found["titles"] += page.evaluate(MEASURE_JS)["titles"]
    found["titles"] = sorted(set(found["titles"]))
    return found


def _short_run(page) -> None:  # type: ignore[no-untyped-def]
    """A few tokens on Generate, so its numbers, chips and charts are drawn."""
    box = page.locator(".st-key-max_new_tokens input")
    if box.count() and box.first.is_visible():
        box.first.fill("6")
        box.first.press("Tab")
        page.wait_for_selector(IDLE)
    page.locator(".st-key-generate button:visible").first.click()
    page.wait_for_selector(".st-key-view_metrics [data-testid=stMetric]", timeout=STARTUP_MS)
    page.wait_for_selector(IDLE, timeout=STARTUP_MS)


# 1366x768 in both layouts (the tight screen), 1920x1080 in the presentation layout (its larger
# fonts are the tighter of the two there; the normal layout at 1920 has the most room of all).
CASES = [((1366, 768), False), ((1366, 768), True), ((1920, 1080), True)]


@pytest.mark.parametrize(("size", "present"), CASES,
                         ids=[f"{w}x{h}-{'present' if p else 'normal'}" for (w, h), p in CASES])
def test_every_page_fits(browser, make_run_url: str, size: tuple[int, int], present: bool) -> None:  # type: ignore[no-untyped-def]
    w, h = size
    context = browser.new_context(viewport={"width": w, "height": h}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(STARTUP_MS)
    problems = {}
    try:
        for path in PAGES:
            page.goto(f"{make_run_url}/{path}" + ("?present=1" if present else ""))
            page.wait_for_selector("[data-testid=stMain]")
            page.wait_for_selector(IDLE)
            if path == "":
                _short_run(page)
            page.wait_for_function(
                "[...document.querySelectorAll('.js-plotly-plot')].every(p => p.querySelector('.main-svg'))")
            found = _measure_with_hover(page)
            name = f"layout-{path or 'generate'}-{w}-{'present' if present else 'normal'}.png"
            page.mouse.move(w - 5, h - 5)
            page.evaluate("document.querySelector('[data-testid=stMain]')?.scrollTo(0, 0)")
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / name))
            _shrink_png(SCREENSHOTS / name)
            bad = {k: v for k, v in found.items() if v}
            if bad:
                problems[path or "generate"] = bad
    finally:
        context.close()
    assert not problems, problems


# In view: whole, or (taller than the window) its top at the window's top.
IN_VIEW_JS = """key => { const e = document.querySelector('.st-key-' + key); if (!e) return false;
    const r = e.getBoundingClientRect();
    return r.height > 40 && r.top >= -2 && (r.bottom <= innerHeight + 2 || r.top <= 2); }"""
RECT_JS = """key => { const r = document.querySelector('.st-key-' + key)?.getBoundingClientRect();
    return r ? [Math.round(r.top), Math.round(r.bottom), innerHeight] : null; }"""


def test_tour_scrolls_the_chart_it_names_into_view(browser, make_run_url: str) -> None:  # type: ignore[no-untyped-def]
    """Steps 2 and 6 say "the chart below"; at 1366x768 in the normal layout that chart starts about
    1,000 px under the fold. Arriving at the step brings it into view."""
    context = browser.new_context(viewport={"width": 1366, "height": 768}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(STARTUP_MS)
    try:
        page.goto(f"{make_run_url}/?tour=1")
        page.wait_for_selector(".st-key-tour_card")
        page.wait_for_selector(IDLE)
        _short_run(page)
        page.evaluate("window.scrollTo(0, 0); document.querySelector('[data-testid=stMain]')?.scrollTo(0, 0)")
        page.wait_for_function(f"!({IN_VIEW_JS})('view_notebook')")  # below the fold at the page's top
        for n, title, view in ((2, "Q, K and V", "view_notebook"), (6, "Attention over the cache", "view_attention")):
            card = page.locator(".st-key-tour_card")
            at, total = map(int, re.search(r"step (\d+) of (\d+)", card.inner_text()).groups())
            for k in range(at + 1, n + 1):  # one step at a time: the card must say k before the next click
                page.locator(".st-key-tour_next button:visible").first.click()
                card.get_by_text(f"step {k} of {total}").first.wait_for()
                page.wait_for_selector(IDLE)
            page.locator(".st-key-tour_card").get_by_text(title).first.wait_for()
            try:
                page.wait_for_function(IN_VIEW_JS, arg=view, timeout=30_000)
            except Exception:  # noqa: BLE001 - playwright's TimeoutError: say where the chart is
                page.screenshot(path=str(SCREENSHOTS / f"layout-tour-step{n}-1366-failed.png"))
                raise AssertionError(f"step {n}: {view} not in view, (top, bottom, window) = "
                                     f"{page.evaluate(RECT_JS, view)}") from None
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / f"layout-tour-step{n}-1366.png"))
    finally:
        context.close()
