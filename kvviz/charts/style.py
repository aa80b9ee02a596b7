"""Text that reads on the screen a figure is shown on: dark axis titles everywhere, larger on a projector.

Pure Plotly. Builders keep their own look; ``legible`` only raises what is too small or too
light, mostly in one layout update (``set_paths``: a Plotly layout update costs milliseconds, so
figures that already read well are left alone unless a projector needs more).
"""
from __future__ import annotations

import math

import plotly.graph_objects as go

from kvviz.charts.fast_layout import set_paths
from kvviz.charts.render_cost import visible_len

INK = "#212529"  # axis titles, ticks and legends: Plotly's default blue-grey reads faint on a projector
MIN_SIZE = 15  # px: the smallest base font a chart keeps
PROJECTOR_SIZE = 18  # px: the base font while presenting
PROJECTOR_TITLE = 23
PROJECTOR_SUBTITLE = 16
# A projector's charts sit two to a row: a subtitle longer than this wraps onto a second line
# (at PROJECTOR_SUBTITLE px a half-width chart holds about 100 characters).
WRAP_CHARS = 90
LINE_PX = 20  # one more subtitle line: the top margin grows by this
BOTTOM_GROWTH = 6  # px more below a projector chart's plot: its 18 px axis title (the time chart needed 5)
# Token labels a half-width projector chart holds on one axis (tokens.MAX_TICKS is for 1,000 px).
PROJECTOR_TICKS = 30
# Room under a projector chart's plot for its tick labels, its x-axis title and a legend row or two:
# a legend placed a fraction of the plot's height below it lands on the larger axis title.
PROJECTOR_BOTTOM = 120
# A vertical axis title longer than this runs past a projector chart's short plot into its subtitle:
# it goes on two lines, a little smaller.
Y_TITLE_CHARS = 18
Y_TITLE_SIZE = 16


def legible(fig: go.Figure, projector: bool = False, height: int | None = None) -> go.Figure:
    """``fig`` with a base font of at least MIN_SIZE px in INK; ``height`` if given. With ``projector``
    (charts two to a row, read from across a room): PROJECTOR_SIZE px and larger titles, a long
    subtitle on two lines, token axes thinned to PROJECTOR_TICKS labels, a bottom legend under the
    axis title. Returns the same figure."""
    font = fig.layout.font
    size = font.size or 12
    want = max(size, PROJECTOR_SIZE if projector else MIN_SIZE)
    kw: dict = {}
    if want != size:
        kw["font_size"] = want
    if font.color != INK:
        kw["font_color"] = INK
    if projector:
        kw["title_font_size"] = max(fig.layout.title.font.size or 0, PROJECTOR_TITLE)
        kw["title_subtitle_font_size"] = PROJECTOR_SUBTITLE
        kw["hoverlabel_font_size"] = 17
        sub = fig.layout.title.subtitle.text
        wrapped = wrap_subtitle(sub) if sub else sub
        if wrapped != sub:
            kw["title_subtitle_text"] = wrapped
            kw["margin_t"] = (fig.layout.margin.t or 96) + LINE_PX
        _grow_margins(fig, kw, PROJECTOR_SIZE / MIN_SIZE)
        _thin_token_axes(fig)
        _legend_below_axis_title(fig, kw)
        _short_y_titles(fig)
    if height is not None and fig.layout.height != height:
        kw["height"] = height
    if kw:
        set_paths(fig, **kw)  # update_layout's result, at a fraction of its cost (fast_layout.py)
    return fig


def wrap_subtitle(text: str, width: int = WRAP_CHARS) -> str:
    """``text`` split in two lines at the space nearest its middle (outside any tag) when it is longer
    than ``width`` visible characters; unchanged when it is short or already has a line break."""
    if "<br" in text or visible_len(text) <= width:
        return text
    depth, spaces = 0, []
    for i, ch in enumerate(text):
        depth += ch == "<"
        depth -= ch == ">" and depth > 0
        if ch == " " and depth == 0:
            spaces.append(i)
    if not spaces:
        return text
    mid = len(text) / 2
    cut = min(spaces, key=lambda i: abs(i - mid))
    return text[:cut] + "<br>" + text[cut + 1:]


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` visible characters, broken at spaces outside tags (a
    word longer than ``width`` keeps a line of its own). Text that has a line break already is one
    line: its author chose where it breaks."""
    if "<br" in text or visible_len(text) <= width:
        return [text]
    lines: list[str] = []
    line, depth, start = "", 0, 0
    words = []
    for i, ch in enumerate(text):  # split at spaces outside tags, so "<span style=...>" stays whole
        depth += ch == "<"
        depth -= ch == ">" and depth > 0
        if ch == " " and depth == 0:
            words.append(text[start:i])
            start = i + 1
    words.append(text[start:])
    for w in words:
        if line and visible_len(line) + 1 + visible_len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return lines + [line]


def _grow_margins(fig: go.Figure, kw: dict, factor: float) -> None:
    """Margins a builder preset for its labels (charts/render_cost.py) grown with the font, so Plotly's
    automargin need not lay the chart out a second time (it still would for a longer label). The
    sides hold labels in the base font and grow with it; below the plot only the axis title grows
    (token labels keep their own 12 px font): BOTTOM_GROWTH px, measured."""
    m = fig.layout.margin
    for side in ("l", "r"):
        px = getattr(m, side)
        if px is not None:
            kw[f"margin_{side}"] = math.ceil(px * factor)
    if m.b is not None:
        kw["margin_b"] = m.b + BOTTOM_GROWTH


def _thin_token_axes(fig: go.Figure) -> None:
    """On each x axis labelled by an array (the token axes), keep a tick only at least 1/PROJECTOR_TICKS
    of the axis after the last kept one: at most about PROJECTOR_TICKS labels, never crowded."""
    for ax in fig.select_xaxes():
        vals, text, rng = ax.tickvals, ax.ticktext, ax.range
        # Spacing, not count: a short run's few word labels can still sit two positions apart.
        if ax.tickmode != "array" or vals is None or text is None or rng is None or len(vals) < 2:
            continue
        gap = (rng[1] - rng[0]) / PROJECTOR_TICKS
        keep_v: list = []
        keep_t: list = []
        for v, t in zip(vals, text):
            if not keep_v or v - keep_v[-1] >= gap:
                keep_v.append(v)
                keep_t.append(t)
        ax.update(tickvals=keep_v, ticktext=keep_t)


def _legend_below_axis_title(fig: go.Figure, kw: dict) -> None:
    """A horizontal legend under the plot moves to the figure's bottom edge (``yref="container"``),
    with room above it for the x axis's larger labels and title, so it never overprints them."""
    legend = fig.layout.legend
    if legend.orientation == "h" and legend.yref == "container":  # a builder put it there: room for 18 px
        kw["margin_b"] = max(kw.get("margin_b", fig.layout.margin.b or 0), PROJECTOR_BOTTOM)
        return
    if legend.orientation != "h" or legend.y is None or legend.y >= 0:
        return
    kw.update(legend_yref="container", legend_y=0.0, legend_yanchor="bottom",
              margin_b=max(fig.layout.margin.b or 0, PROJECTOR_BOTTOM))


def _short_y_titles(fig: go.Figure) -> None:
    """Long y-axis titles on two lines at Y_TITLE_SIZE px, so they stay beside the plot."""
    for ax in fig.select_yaxes():
        text = ax.title.text
        if text and visible_len(text) > Y_TITLE_CHARS and "<br" not in text:
            ax.update(title_text=wrap_subtitle(text, Y_TITLE_CHARS), title_font_size=Y_TITLE_SIZE)


def integer_ticks(top: float, most: int = 6) -> dict:
    """An axis from 0 to a little above ``top`` with ticks at whole multiples of 1, 2 or 5 x 10^n,
    at most ``most`` of them: a count per second reads 0, 2, 4, 6, 8, never Plotly's 0, 1.75,
    3.5... printed as "0, 2, 4, 5, 7, 9" by an integer tick format."""
    top = max(float(top), 1.0) if math.isfinite(top) else 1.0
    step = 1
    while top / step > most:
        step = _next_step(step)
    return dict(range=[0.0, top * 1.05], tick0=0, dtick=step, tickmode="linear")


def top_tick(ticks: dict) -> float:
    """The highest tick an ``integer_ticks`` axis draws: 100 for a top of 96 (the axis runs to 100.8),
    a digit more than the top itself."""
    return math.floor(ticks["range"][1] / ticks["dtick"]) * ticks["dtick"]


def _next_step(step: int) -> int:
    """1 -> 2 -> 5 -> 10 -> 20 -> 50 -> 100 ..."""
    lead = int(str(step)[0])
    return step * 2 if lead == 1 else (step * 5 // 2 if lead == 2 else step * 2)
