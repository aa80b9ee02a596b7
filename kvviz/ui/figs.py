"""Every Plotly chart goes on screen here: the app's own colours (not Streamlit's theme, whose small
light-grey axis titles a projector washes out), legible text, larger while presenting."""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from kvviz.charts.style import legible
from kvviz.ui import present

CONFIG = {"displaylogo": False, "toImageButtonOptions": {"scale": 2}}


def show(where: Any, fig: go.Figure, key: str, height: int | None = None, **kw: Any) -> Any:
    """``where.plotly_chart(fig)`` (``where``: st, a column or an st.empty slot) with kvviz's look."""
    projector = present.active()
    # No hover toolbar on a projector: it would cover the selector buttons in the charts' corners.
    config = {**CONFIG, "displayModeBar": False} if projector else CONFIG
    return where.plotly_chart(legible(fig, projector, height), key=key, theme=None, config=config, **kw)
