"""Which charts on a page Plotly had to lay out twice: their automargin grew a preset margin.

The live charts preset their margins to what their labels need (kvviz/charts/render_cost.py), because a
margin that automargin must grow makes Plotly draw the chart a second time, which doubled what
Chromium spent on a chart frame. This reads back, from the browser, the margins each chart was
given and the ones Plotly laid it out with.
"""
from __future__ import annotations

MARGINS_JS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(d => {
  const m = (d.layout && d.layout.margin) || {}, s = d._fullLayout._size;
  return {title: (d._fullLayout.title && d._fullLayout.title.text) || '', given: [m.l, m.r, m.b], laid: [s.l, s.r, s.b]};
})"""


def grown_margins(page, titles: tuple[str, ...]) -> list[str]:  # type: ignore[no-untyped-def]
    """One line per chart whose title starts with one of ``titles`` and whose left, right or bottom
    margin Plotly grew past the preset (an empty list: every such chart was drawn once)."""
    charts = [c for c in page.evaluate(MARGINS_JS) if c["title"].startswith(titles)]
    assert charts, f"no chart titled {titles} on the page"
    return [f"{c['title'][:60]}: given (l, r, b) {c['given']}, laid out with {c['laid']}"
            for c in charts if c["given"] != c["laid"]]
