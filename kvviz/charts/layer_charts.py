"""The bytes each layer's cache holds after a step: hybrid attention made visible (Gemma 3).

Pure Plotly, from ``StepEvent.cache_layer_bytes`` and ``Run.layer_kinds``: a sliding layer levels
off at its window while a global one keeps growing. The Generate page draws it under the metrics
for a model whose layers are not all of one kind.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import plotly.graph_objects as go

from kvviz.charts.fast_layout import set_layout
from kvviz.charts.run_charts import HEIGHTS, _layout, _message_figure

LAYER_COLORS = {"sliding": "#1c7ed6", "full": "#e8590c"}
LAYER_NAMES = {"sliding": "sliding (keeps its window)", "full": "global (keeps every token)"}


def layer_strip(layer_bytes: Sequence[int], kinds: Sequence[str], tokens: int) -> go.Figure:
    """One bar per layer: the bytes its cache holds after ``tokens`` positions, sliding and global
    layers coloured apart; the title gives each kind's total (exact bytes, from the cache)."""
    title = "Bytes each layer holds"
    if not layer_bytes or len(layer_bytes) != len(kinds):
        return _message_figure(title, "Generate with a cache on a model with sliding layers.", HEIGHTS["bars"])
    fig = go.Figure()
    totals = []
    # The axis in the app's binary units (KiB, MiB, GiB: never Plotly's SI "800k"); the hover and the
    # subtitle keep the exact bytes.
    top = max(int(b) for b in layer_bytes)
    unit, div = next(((u, d) for u, d in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top >= d), ("B", 1))
    for kind in ("sliding", "full"):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if not idx:
            continue
        got = [int(layer_bytes[i]) for i in idx]
        totals.append(f"{len(idx)} {kind if kind == 'sliding' else 'global'}: {sum(got):,} B")
        fig.add_trace(go.Bar(x=np.array(idx, dtype=np.int32), y=np.array(got, dtype=np.float64) / div,
                             marker_color=LAYER_COLORS[kind], name=LAYER_NAMES[kind],
                             customdata=np.array(got, dtype=np.float64),
                             hovertemplate="layer %{x}<br>%{customdata:,.0f} B<extra></extra>"))
    set_layout(fig, xaxis=dict(title=dict(text="layer"), tickmode="linear", dtick=1 if len(kinds) <= 32 else 4),
               yaxis=dict(title=dict(text=f"held ({unit})"), rangemode="tozero", exponentformat="none"),
               bargap=0.15, legend=dict(orientation="h", x=1.0, xanchor="right", y=1.02, yanchor="bottom"))
    sub = f"after {tokens:,} tokens · " + " · ".join(totals) + f" · total {sum(int(b) for b in layer_bytes):,} B"
    return _layout(fig, title, sub, HEIGHTS["bars"])
