"""Text that reads on the screen a figure is shown on: dark axis titles everywhere, larger on a projector.

Pure Plotly. Builders keep their own look; ``legible`` only raises what is too small or too
light, in one ``update_layout`` call (a Plotly layout update costs milliseconds, so figures that
already read well are left alone unless a projector needs more).
"""
from __future__ import annotations

import plotly.graph_objects as go

INK = "#212529"  # axis titles, ticks and legends: Plotly's default blue-grey reads faint on a projector
MIN_SIZE = 15  # px: the smallest base font a chart keeps
PROJECTOR_SIZE = 18  # px: the base font while presenting
PROJECTOR_TITLE = 23


def legible(fig: go.Figure, projector: bool = False, height: int | None = None) -> go.Figure:
    """``fig`` with a base font of at least MIN_SIZE px in INK; PROJECTOR_SIZE px and larger titles
    when ``projector``; ``height`` if given. Returns the same figure."""
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
        kw["title_subtitle_font_size"] = 16
        kw["hoverlabel_font_size"] = 17
    if height is not None and fig.layout.height != height:
        kw["height"] = height
    if kw:
        fig.update_layout(**kw)
    return fig
