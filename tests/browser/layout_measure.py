"""What the browser shows cramped, measured in the page (issue 36's presenter at 1366x768):
``measure_with_hover(page)`` returns, by kind, each button or metric whose text is wider than its
box, each word a button label or legend lays out over two lines, and each chart title wider than
its chart or under its mode bar, Streamlit's toolbar or a selector button (every chart hovered in
turn, since the toolbars show on hover). test_layout_fit.py asserts on it (screen_walks.py walks
the pages).
"""
from __future__ import annotations

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


def measure_with_hover(page) -> dict[str, list[str]]:  # type: ignore[no-untyped-def]
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
