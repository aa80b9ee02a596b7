"""What the browser shows cut, measured in the page: ``cut_labels(page)`` returns one line per cut label.

A label is cut when the browser draws less of it than the app gave:
- HTML: a button, tab, selectbox value, metric, table cell or header, code block or tour card whose
  text is wider than its box (``scrollWidth > clientWidth``: the browser clips it, adds "…", or hides
  it behind a sideways scroll bar, which on a code block nobody scrolls);
- Plotly: a chart title, subtitle, axis title, annotation or bar label whose SVG text differs from
  the text the figure gives (Plotly drops a bar label that does not fit), whose box reaches outside
  its chart (the SVG clips it), or whose box overlaps another label's, a legend entry's or a tick
  label's.
Boxes are compared with a 1 px slack: the browser rounds text boxes to sub-pixels, and 1 px is less
than any glyph, so a real overlap or cut is never hidden by it.
"""
from __future__ import annotations

CUT_JS = r"""() => {
  const SLACK = 1;
  // On screen sideways: a folded sidebar is moved left of the window, not hidden.
  const shown = e => { const r = e.getBoundingClientRect();
    return e.getClientRects().length > 0 && r.width > 0 && getComputedStyle(e).visibility !== 'hidden' &&
      r.right > 0 && r.left < innerWidth; };
  const txt = e => (e.innerText || e.textContent || '').replace(/\s+/g, ' ').trim();
  const out = [];
  // 1. HTML text wider than its box, in any element under the ones a user reads.
  const wide = e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + SLACK;
  const cutInside = root => [root, ...root.querySelectorAll('*')].some(e => shown(e) && wide(e) &&
      !['auto', 'scroll'].includes(getComputedStyle(e).overflowX));
  const kinds = [
    ['button', '[data-testid=stMain] button, [data-testid=stSidebar] button'],
    ['tab', '[role=tab]'],
    ['metric', '[data-testid=stMetric]'],
    ['table', '[data-testid=stTable] th, [data-testid=stTable] td'],
    ['tour card', '.st-key-tour_card'],
  ];
  for (const [kind, sel] of kinds)
    for (const e of document.querySelectorAll(sel))
      if (shown(e) && txt(e) && cutInside(e)) out.push(`${kind} cut: ${txt(e).slice(0, 90)}`);
  // A selectbox shows its value in an input that clips it (Streamlit 1.67: no ellipsis, no scroll bar).
  for (const i of document.querySelectorAll('[data-testid=stSelectbox] input, input[role=combobox]'))
    if (shown(i) && i.value && wide(i)) out.push(`selectbox cut: ${i.value.slice(0, 60)}`);
  // A code block scrolls sideways instead of clipping: its hidden part is as lost to a reader.
  for (const e of document.querySelectorAll('[data-testid=stCode] pre'))
    if (shown(e) && wide(e)) out.push(`code block cut sideways: ${txt(e).slice(0, 60)}`);
  // A glide-grid dataframe draws on a canvas and keeps each cell's full text in an accessible copy.
  // Streamlit sizes each column to its widest text but at most 31.25rem (its maxColumnAutoWidth), so a
  // text wider than that (in the grid's 14 px font, plus 8 px padding each side) is drawn cut.
  const ctx = document.createElement('canvas').getContext('2d');
  const cap = 31.25 * parseFloat(getComputedStyle(document.documentElement).fontSize);
  for (const g of document.querySelectorAll('[data-testid=stDataFrame]')) {
    if (!shown(g) || !g.querySelector('canvas')) continue;
    ctx.font = '14px ' + getComputedStyle(g.querySelector('canvas')).fontFamily;
    for (const c of g.querySelectorAll('[role=columnheader], [role=gridcell]')) {
      const t = (c.textContent || '').trim();
      if (ctx.measureText(t).width + 16 > cap + SLACK) out.push(`table cell cut: ${t.slice(0, 60)}`);
    }
  }
  // 2. Plotly: the text given against the text drawn, inside the chart, overlapping no other label.
  const plain = s => String(s == null ? '' : s).replace(/<br\s*\/?>/gi, ' ').replace(/<[^>]*>/g, '')
      .replace(/&nbsp;/g, ' ').replace(/&amp;/g, '&').replace(/&lt;/g, '<').replace(/&gt;/g, '>').replace(/\s+/g, '');
  const meets = (a, b) => a.right > b.left + SLACK && a.left < b.right - SLACK &&
      a.bottom > b.top + SLACK && a.top < b.bottom - SLACK;
  for (const p of document.querySelectorAll('.js-plotly-plot')) {
    if (!shown(p) || !p._fullLayout) continue;
    const fl = p._fullLayout, pr = p.getBoundingClientRect();
    const lt = p.layout && p.layout.title, titleText = typeof lt === 'string' ? lt : (lt && lt.text) || '';
    const name = titleText.replace(/<[^>]*>/g, ' ').replace(/\s+/g, ' ').trim().slice(0, 50) || '(untitled chart)';
    const labels = [];  // [what, element]
    const given = [];   // [what, text given, element or null]
    const t = p.querySelector('.gtitle');
    if (titleText) given.push(['title', titleText, t]);
    if (t) labels.push(['title', t]);
    const sub = p.querySelector('.gtitle-subtitle'), subText = lt && lt.subtitle && lt.subtitle.text;
    if (subText) given.push(['subtitle', subText, sub]);
    if (sub) labels.push(['subtitle', sub]);
    // Texts from the figure as given (p.layout): Plotly's full layout holds a placeholder
    // ("Click to enter X axis title") for an axis given no title, which it never draws.
    const given_ = (o, k) => { const t = o && o[k] && o[k].title; return typeof t === 'string' ? t : (t && t.text) || ''; };
    for (const k of Object.keys(fl).filter(k => /^[xy]axis\d*$/.test(k))) {
      const ax = fl[k], text = given_(p.layout, k); if (!ax || !ax.visible || !text) continue;
      const e = p.querySelector(`.g-${k[0]}${k.slice(5)}title text, .${k[0]}${k.slice(5)}title`);
      given.push([`${k} title`, text, e]);
      if (e) labels.push([`${k} title`, e]);
    }
    const annEls = [...p.querySelectorAll('.annotation')];
    (fl.annotations || []).forEach((a, i) => {
      if (a.visible === false || !a.text) return;
      const e = annEls.find(x => x.getAttribute('data-index') === String(i));
      given.push([`annotation ${i}`, a.text, e ? e.querySelector('.annotation-text') : null]);
      if (e) labels.push([`annotation "${plain(a.text).slice(0, 20)}"`, e.querySelector('.annotation-text')]);
    });
    // Bar labels: the n-th visible bar trace is the n-th trace group in the bar layer.
    const barGroups = [...p.querySelectorAll('.barlayer .trace')];
    (p._fullData || []).filter(tr => tr.type === 'bar' && tr.visible === true).forEach((tr, ti) => {
      const texts = Array.isArray(tr.text) ? tr.text : [];
      if (!barGroups[ti] || tr.textposition === 'none') return;
      [...barGroups[ti].querySelectorAll('.point')].forEach((pt, j) => {
        if (!texts[j]) return;
        const e = pt.querySelector('.bartext');
        given.push([`bar label ${j}`, texts[j], e]);
        if (e) labels.push([`bar label "${plain(texts[j])}"`, e]);
      });
    });
    for (const e of p.querySelectorAll('.legend .traces'))
      labels.push([`legend "${e.textContent.trim().slice(0, 20)}"`, e]);
    for (const [what, text, e] of given) {
      const drawn = e ? plain(e.textContent) : '';
      if (plain(text) && drawn !== plain(text)) out.push(`chart "${name}": ${what} drawn "${drawn.slice(0, 40)}", given "${plain(text).slice(0, 40)}"`);
    }
    const boxes = labels.filter(([, e]) => e && e.getClientRects().length).map(([w, e]) => [w, e.getBoundingClientRect()])
        .filter(([, r]) => r.width > 0);
    for (const [w, r] of boxes)
      if (r.left < pr.left - SLACK || r.right > pr.right + SLACK || r.top < pr.top - SLACK || r.bottom > pr.bottom + SLACK)
        out.push(`chart "${name}": ${w} outside the chart`);
    const ticks = [...p.querySelectorAll('.xtick text, .ytick text, .x2tick text, .y2tick text')]
        .filter(e => e.textContent.trim() && e.getClientRects().length).map(e => ['tick "' + e.textContent.trim().slice(0, 12) + '"', e.getBoundingClientRect()]);
    for (let i = 0; i < boxes.length; i++) {
      for (let j = i + 1; j < boxes.length; j++)
        if (meets(boxes[i][1], boxes[j][1])) out.push(`chart "${name}": ${boxes[i][0]} overlaps ${boxes[j][0]}`);
      for (const [tw, tr] of ticks)
        if (meets(boxes[i][1], tr)) out.push(`chart "${name}": ${boxes[i][0]} overlaps ${tw}`);
    }
  }
  return [...new Set(out)];
}"""


def cut_labels(page) -> list[str]:  # type: ignore[no-untyped-def]
    """One line per label the page shows cut or overlapped (an empty list: none)."""
    return list(page.evaluate(CUT_JS))
