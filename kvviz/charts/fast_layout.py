"""``set_layout``: ``fig.update_layout`` at a fraction of its cost, for figures rebuilt on every step.

Why: ``update_layout`` (and ``update_xaxes``) route through Plotly's batch-update machinery, which
diffs, dispatches relayout callbacks and re-walks every nested path: about 16 ms for a chart's
title, template, margins and fonts. Assigning each top-level property (``fig.layout[k] = v``)
validates the same values through the same validators in about 3 ms. Step mode rebuilds four
charts per Step press, so this is time a presenter waits for (docs/benchmarks.md).

The result is the same figure: a property the layout already holds is merged with the new
values as ``update_layout`` merges (nested dicts key by key, the new value winning), then
assigned whole. One difference: an array (``shapes``, ``annotations``) is replaced, where
``update_layout`` would merge it element by element into one already there; the charts set each
array once. Names are Plotly's own (``xaxis``, ``paper_bgcolor``), not "magic underscore"
paths such as ``title_text``: those go through ``update_layout``.
"""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go


def _merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    out = dict(old)
    for k, v in new.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def set_layout(fig: go.Figure, **props: Any) -> go.Figure:
    """Set layout properties as ``fig.update_layout(**props)`` would; returns ``fig``."""
    layout = fig.layout
    for key, value in props.items():
        # A template is replaced whole, as update_layout does (and reading an unset one would
        # return Plotly's default template, which must not be merged in).
        if isinstance(value, dict) and key != "template":
            try:
                held = layout[key]
            except KeyError:  # a subplot's axis (xaxis2) not made yet: reading it raises
                held = None
            old = held.to_plotly_json() if hasattr(held, "to_plotly_json") else None
            if old:
                value = _merged(old, value)
        layout[key] = value
    return fig


def set_paths(fig: go.Figure, **paths: Any) -> go.Figure:
    """``set_layout`` for Plotly's "magic underscore" paths (``title_font_size=23``, ``margin_t=96``).

    Each key is split at every underscore, so it must name properties without one of their own
    (``paper_bgcolor`` is not such a path: pass it to ``set_layout``).
    """
    nested: dict[str, Any] = {}
    for path, value in paths.items():
        *parents, leaf = path.split("_")
        node = nested
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return set_layout(fig, **nested)
