"""set_layout gives the figure update_layout gives (it is only faster), merges as it merges, and
the step-mode charts built with it keep their look."""
from __future__ import annotations

import json

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from kvviz.charts.fast_layout import set_layout, set_paths
from kvviz.charts.run_charts import TEMPLATE


def _json(fig: go.Figure) -> dict:
    return json.loads(pio.to_json(fig))


CASES = [
    # (props set before, props set after): the second call merges into the first
    ({"margin": {"l": 5, "t": 40}}, {"margin": {"t": 96, "b": 7}}),
    ({"title": {"text": "a", "font": {"size": 19}, "pad": {"l": 12}}}, {"title": {"pad": {"t": 14}}}),
    ({}, {"template": TEMPLATE, "height": 430, "font": {"size": 15, "color": "#212529"}}),
    ({"xaxis": {"range": [0, 3], "title": {"text": "x"}}}, {"xaxis": {"tickangle": -50, "title": {"standoff": 6}}}),
    ({}, {"xaxis2": {"anchor": "y2", "matches": "x"}, "yaxis2": {"domain": [0.0, 0.46]}}),
    ({}, {"shapes": [{"type": "line", "x0": 0, "x1": 1, "y0": 0, "y1": 1}], "annotations": [{"text": "n"}]}),
    ({"legend": {"x": 1.0}}, {"legend": {"orientation": "h"}, "bargap": 0.15}),
]


@pytest.mark.parametrize("first,second", CASES)
def test_set_layout_equals_update_layout(first: dict, second: dict) -> None:
    slow = go.Figure(go.Bar(x=[1, 2], y=[3, 4]))
    fast = go.Figure(go.Bar(x=[1, 2], y=[3, 4]))
    slow.update_layout(**first)
    slow.update_layout(**second)
    set_layout(fast, **first)
    assert set_layout(fast, **second) is fast
    assert _json(fast) == _json(slow)


def test_a_bad_property_is_refused_as_update_layout_refuses_it() -> None:
    with pytest.raises(ValueError):
        set_layout(go.Figure(), height="tall")
    with pytest.raises(ValueError):
        set_layout(go.Figure(), nonsense=1)


def test_an_array_property_is_replaced_whole() -> None:
    """Documented difference: update_layout merges arrays of shapes element by element; the charts
    set each array once, and set_layout replaces it."""
    fig = set_layout(go.Figure(), shapes=[{"type": "line", "x0": 0, "x1": 1, "y0": 0, "y1": 1}])
    set_layout(fig, shapes=[{"type": "rect", "x0": 2, "x1": 3, "y0": 0, "y1": 1}])
    assert [(s.type, s.x0) for s in fig.layout.shapes] == [("rect", 2)]


def test_set_paths_equals_update_layout_with_magic_underscores() -> None:
    paths = {"font_size": 18, "title_subtitle_font_size": 16, "title_font_size": 23, "margin_t": 116,
             "legend_yref": "container", "legend_y": 0.0, "hoverlabel_font_size": 17, "height": 300}
    base = {"title": {"text": "t", "font": {"size": 19}}, "margin": {"l": 60, "t": 96}, "font": {"color": "#212529"}}
    slow = go.Figure().update_layout(**base).update_layout(**paths)
    fast = set_paths(set_layout(go.Figure(), **base), **paths)
    assert _json(fast) == _json(slow)
