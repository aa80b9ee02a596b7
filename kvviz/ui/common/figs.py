"""Every Plotly chart goes on screen here: the app's own colours (not Streamlit's theme, whose small
light-grey axis titles a projector washes out), legible text, larger while presenting."""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from kvviz.charts.style import legible
from kvviz.ui import present
from kvviz.ui.common.kept_chart import kept_chart

# No Plotly hover toolbar (mode bar) on any chart: it sat over the right end of the titles, and on a
# projector over the selector buttons in the charts' corners. Drag to zoom and double-click to reset
# still work; Streamlit's own toolbar keeps full screen.
CONFIG = {"displaylogo": False, "displayModeBar": False}


def show(where: Any, fig: go.Figure, key: str, height: int | None = None, kept: bool = False, **kw: Any) -> Any:
    """``where.plotly_chart(fig)`` (``where``: st, a column or an st.empty slot) with kvviz's look.

    ``kept``: a chart the browser keeps across script runs under ``key`` and redraws in place
    (``kept_chart``; ``where`` an st.empty slot or a column), for views that change a little on
    every click (step mode), where ``st.plotly_chart`` would build the chart anew each time.
    """
    projector = present.active()
    if kept:
        return kept_chart(where, legible(fig, projector, height), key, CONFIG)
    return where.plotly_chart(legible(fig, projector, height), key=key, theme=None, config=CONFIG, **kw)
