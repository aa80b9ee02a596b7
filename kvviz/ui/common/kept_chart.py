"""A Plotly chart that stays mounted across script runs and takes each new figure in place.

Why: Streamlit 1.67 derives an ``st.plotly_chart``'s element id from its figure
(``key_as_main_identity=False``), so a chart whose figure changes is a new element even under the
same key: the browser unmounts it and Plotly builds it from scratch. In step mode that was four
charts per Step press, about 1 s of the browser's main thread (docs/benchmarks.md, 2026-11-27). A
components-v2 element keeps its identity under its key, and its script gets each new figure and
hands it to ``Plotly.react`` on the same node: the traces whose data changed are recomputed and
redrawn, but the chart's DOM is not built anew. A chart off screen waits until it scrolls into view.

Security: the figure goes to the browser as data (its JSON, parsed by ``JSON.parse``), never into
HTML or script text, and Plotly draws its text as SVG text as it does for ``st.plotly_chart``.
plotly.js is the copy the Python ``plotly`` package ships (its ``package_data`` folder, served by
Streamlit's own custom-component file route: a v1 component declared for that folder and never
mounted), or Streamlit's own bundled plotly.js where a ``st.plotly_chart`` already put it on the
page as ``window.Plotly`` (the same 4.x line); either way the page needs no network.
"""
from __future__ import annotations

import os
from typing import Any

import plotly
import plotly.graph_objects as go
import plotly.io as pio
import streamlit as st
from streamlit.components.v1 import declare_component

PLOTLY_DIR = os.path.join(os.path.dirname(plotly.__file__), "package_data")  # holds plotly.min.js
CSS_CLASS = "kvviz-kept-chart"  # the node Plotly draws into; a browser test checks it survives a press

# An ES module: Streamlit calls its default export on mount and again with each new ``data``, with
# the same ``parentElement`` (light DOM: Plotly's global styles must reach it). plotly.js loads once
# per page; every chart waits on the same promise.
JS = """
function plotlyReady(src) {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!window.__kvvizPlotly) {
    window.__kvvizPlotly = new Promise((resolve, reject) => {
      const s = document.createElement("script");
      s.src = src;
      s.onload = () => resolve(window.Plotly);
      s.onerror = () => { window.__kvvizPlotly = undefined; reject(new Error("plotly.js did not load from " + src)); };
      document.head.appendChild(s);
    });
  }
  return window.__kvvizPlotly;
}

// Every kept node of the page. Unmounted ones (a finished run, another page) are let go at the next
// call: not by a cleanup returned to Streamlit, which can run one late, after a newer figure was drawn.
const kept = (window.__kvvizKept = window.__kvvizKept || new Set());

function sweep() {
  for (const d of kept) {
    if (d.isConnected) continue;
    kept.delete(d);
    if (d.__kvvizResize) d.__kvvizResize.disconnect();
    if (d.__kvvizSeen) d.__kvvizSeen.disconnect();
    if (d.__kvvizPlotlyLib) d.__kvvizPlotlyLib.purge(d);
  }
}

export default function ({ data, parentElement }) {
  sweep();
  let div = parentElement.querySelector("div.%(cls)s");
  if (!div) {
    div = document.createElement("div");
    div.className = "%(cls)s";
    div.style.width = "100%%";
    parentElement.appendChild(div);
    kept.add(div);
  }
  if (div.__kvvizWant && div.__kvvizWant.spec === data.spec) return;  // a script run that changed nothing here
  const fig = JSON.parse(data.spec);
  delete fig.layout.width;  // fill the column, as st.plotly_chart's default width="stretch" does
  div.__kvvizWant = { spec: data.spec, fig, config: data.config, src: data.src };
  if (div.__kvvizVisible !== false) draw(div);  // on screen, or not yet known (the first draw)
  if (!div.__kvvizSeen) {
    // A chart off screen (below the fold) is redrawn when it scrolls into view, not on every press:
    // the browser's time after a press goes to the charts the presenter is looking at.
    div.__kvvizSeen = new IntersectionObserver((entries) => {
      div.__kvvizVisible = entries[entries.length - 1].isIntersecting;
      if (div.__kvvizVisible) draw(div);
    }, { rootMargin: "100px" });
    div.__kvvizSeen.observe(div);
  }
}

function draw(div) {
  const want = div.__kvvizWant;
  if (!want || div.__kvvizDrawn === want) return;
  // The newest figure wins: a slow plotly.js load must not draw an older figure over a newer one.
  plotlyReady(want.src).then((loaded) => {
    if (div.__kvvizWant !== want) return;
    // One plotly.js per node: Streamlit's own bundle may set window.Plotly after ours did.
    const Plotly = (div.__kvvizPlotlyLib = div.__kvvizPlotlyLib || loaded);
    Plotly.react(div, want.fig.data, want.fig.layout, want.config);
    div.__kvvizDrawn = want;
    if (!div.__kvvizResize) {  // follow the column's width (the sidebar opening, a window resize)
      // Only a node on the page with a box: a rerun hides or detaches old elements (width 0), and
      // Plotly's resize of an undisplayed div rejects ("Resize must be passed a displayed plot div").
      div.__kvvizResize = new ResizeObserver(() => {
        if (!div._fullLayout || !div.isConnected || div.getClientRects().length === 0 || div.offsetWidth === 0) return;
        Promise.resolve(Plotly.Plots.resize(div)).catch(() => {});  // hidden between the check and the call
      });
      div.__kvvizResize.observe(div);
    }
  }).catch((e) => { div.textContent = String(e.message); });
}
""" % {"cls": CSS_CLASS}

_component = st.components.v2.component("kvviz_kept_chart", js=JS, isolate_styles=False)


def plotly_js_url() -> str:
    """Where the browser fetches plotly.min.js: the v1 component route for the plotly package's folder.

    Declared on every call (cheap, idempotent): Streamlit registers a v1 component only inside a
    script run, on the runtime that runs it.
    """
    served = declare_component("plotlyjs", path=PLOTLY_DIR)
    base = str(st.get_option("server.baseUrlPath") or "").strip("/")
    return "/" + (base + "/" if base else "") + f"component/{served.name}/plotly.min.js"


def kept_chart(where: Any, fig: go.Figure, key: str, config: dict) -> Any:
    """Draw ``fig`` into ``where`` (an st.empty slot or a column) as a chart kept under ``key``.

    Same ``key`` and place on the next script run: the browser keeps the node and redraws it with
    the new figure. The spec is the JSON ``st.plotly_chart`` sends (``plotly.io.to_json``, so the
    same template and look); the chart fills its column, as ``st.plotly_chart``'s default does.
    """
    data = {"spec": pio.to_json(fig, validate=False), "config": {**config, "responsive": True},
            "src": plotly_js_url()}
    # Inside the slot itself, not a container in it: a new container each run would remount the chart.
    with where:
        return _component(key=key, data=data, height="content")
