"""kept_chart: the figure reaches the browser as JSON data (never HTML or script text), under a
stable key, with plotly.js from the plotly package's own file."""
from __future__ import annotations

import json
import os

from streamlit.testing.v1 import AppTest

from kvviz.ui.common import kept_chart


def _script() -> None:
    import plotly.graph_objects as go
    import streamlit as st

    from kvviz.ui.common.kept_chart import kept_chart

    title = "<img src=x onerror=alert(1)> step " + str(st.session_state.get("n", 0))
    kept_chart(st.empty(), go.Figure(go.Bar(y=[1, 2, 3]), layout={"title": {"text": title}, "width": 300}),
               key="nb", config={"displaylogo": False})


def test_the_figure_is_data_under_a_stable_key() -> None:
    at = AppTest.from_function(_script).run()
    assert not at.exception
    (el,) = at.get("bidi_component")
    data = json.loads(el.proto.json)
    spec = json.loads(data["spec"])
    assert spec["layout"]["title"]["text"] == "<img src=x onerror=alert(1)> step 0"  # as typed, in the JSON
    assert spec["layout"]["width"] == 300  # the browser drops it (the chart fills its column)
    assert "alert(1)" not in el.proto.js_content + el.proto.html_content  # the module is constant code
    assert data["config"] == {"displaylogo": False, "responsive": True}
    assert data["src"].startswith("/component/kvviz.ui.common.kept_chart.plotlyjs/") and data["src"].endswith("/plotly.min.js")
    first_id = el.proto.id
    at.session_state["n"] = 1
    at.run()
    (el,) = at.get("bidi_component")
    assert el.proto.id == first_id  # a new figure, the same element: the browser keeps its node
    assert json.loads(json.loads(el.proto.json)["spec"])["layout"]["title"]["text"].endswith("step 1")


def test_plotly_js_is_the_packaged_file() -> None:
    assert os.path.isfile(os.path.join(kept_chart.PLOTLY_DIR, "plotly.min.js"))
