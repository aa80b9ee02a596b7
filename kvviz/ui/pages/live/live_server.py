"""Live server: point kvviz at a running vLLM, SGLang or llama.cpp server and watch its KV cache.

Each reading is the server's own /metrics (kvviz/watch/), taken every few seconds by a fragment
(``st.fragment(run_every=...)`` re-runs only this panel); kvviz's calculator figures stand beside
the server's (what the pool holds in tokens, what "usage %" means, the maximum concurrency). A failed
reading is one warning line; the charts keep the last good readings.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import streamlit as st
import torch

from kvviz.charts.server import latency_bars, server_timeline
from kvviz.errors import KVVizError
from kvviz.calculator.presets import load_presets
from kvviz.ui.state import session
from kvviz.watch.scrape import parse_target
from kvviz.watch.server_metrics import rates
from kvviz.watch.watch import Snapshot, read_server

MAX_READINGS = 900  # 30 minutes at 2 s: bounded memory per browser session
INTERVALS = (1.0, 2.0, 5.0, 10.0)
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llama.cpp": "llama.cpp"}  # as the projects write them


@dataclass
class Watch:
    """This session's readings of one server (the last good ones stay when a reading fails)."""

    url: str
    snaps: list[Snapshot] = field(default_factory=list)
    tok_s: list[float | None] = field(default_factory=list)
    error: str | None = None


@st.cache_resource(show_spinner=False)
def _presets() -> dict:
    return load_presets()


def _state(url: str) -> Watch:
    w = session.get(session.LIVE_WATCH)
    if not isinstance(w, Watch) or w.url != url:
        w = Watch(url)
        session.put(session.LIVE_WATCH, w)
    return w


def _read(w: Watch, header: str, device: str) -> None:
    try:
        target = parse_target(w.url, [header] if header.strip() else [])
        snap = read_server(target, _presets(), timeout_s=3.0, device=device)
    except KVVizError as e:
        w.error = str(e)
        return
    w.error = None
    before = w.snaps[-1] if w.snaps else None
    rt = rates(snap.reading, before.reading if before else None, snap.at - before.at if before else 0.0)
    w.snaps.append(snap)
    w.tok_s.append(rt.generation_tok_s)
    del w.snaps[:-MAX_READINGS], w.tok_s[:-MAX_READINGS]


def _metrics(w: Watch) -> None:
    snap = w.snaps[-1]
    r, c = snap.reading, snap.calc
    first = w.snaps[0]
    cols = st.columns(6)
    cols[0].metric("KV usage", "n/a" if r.kv_cache_usage is None else f"{100 * r.kv_cache_usage:.1f}%")
    cols[1].metric("Running", "n/a" if r.requests_running is None else f"{r.requests_running:,.0f}")
    cols[2].metric("Waiting", "n/a" if r.requests_waiting is None else f"{r.requests_waiting:,.0f}")
    hit, since = None, "since you started watching"
    if r.prefix_cache_queries is not None and first.reading.prefix_cache_queries is not None:
        q = r.prefix_cache_queries - first.reading.prefix_cache_queries
        h = (r.prefix_cache_hits or 0) - (first.reading.prefix_cache_hits or 0)
        if q <= 0 and r.prefix_cache_queries > 0:  # nothing looked up while watched: the server's whole life
            q, h, since = r.prefix_cache_queries, r.prefix_cache_hits or 0, "since the server started"
        hit = h / q if q > 0 else None
    cols[3].metric("Prefix-cache hits", "n/a" if hit is None else f"{100 * hit:.1f}%",
                   help=f"hit tokens / looked-up tokens {since} (the counters' deltas)")
    cols[4].metric("Preemptions", "n/a" if r.preemptions is None else f"{r.preemptions:,.0f}",
                   help="since the server started")
    tok = w.tok_s[-1]
    cols[5].metric("Tokens/s", "n/a" if tok is None else f"{tok:,.1f}", help="generated tokens between the last two readings")
    if c.kv_cache_tokens is not None:
        used = "" if c.used_tokens is None else (f" At {100 * (r.kv_cache_usage or 0):.1f}% usage, about "
                                                 f"**{c.used_tokens:,.0f} tokens** of K/V are held.")
        conc = "" if c.max_concurrency is None else (f" One request of the served maximum length "
                                                     f"({r.max_model_len:,} tokens) takes its share of that, so at most "
                                                     f"**{c.max_concurrency:.2f}** such requests fit at once.")
        st.markdown(f"**kvviz's calculator** ({c.model}, {ENGINE_NAMES[r.engine]}'s own rules): the pool holds "
                    f"**{c.kv_cache_tokens:,} tokens**.{used}{conc}")
        if c.formula:
            with st.expander("How kvviz computed it"):
                st.code("\n".join(c.formula), language=None)
    elif c.why_not:
        st.caption(f"kvviz's calculator: {c.why_not}")


def _charts(w: Watch) -> None:
    t0 = w.snaps[0].at
    rs = [s.reading for s in w.snaps]
    st.plotly_chart(server_timeline([s.at - t0 for s in w.snaps], [r.kv_cache_usage for r in rs],
                                    [r.requests_running for r in rs], [r.requests_waiting for r in rs], w.tok_s),
                    key=f"live_timeline_{len(w.snaps)}", config={"displayModeBar": False})
    r = rs[-1]
    rows = [(name, *(None if h is None else (h.quantile(q) or 0) * 1000 for q in (0.5, 0.9, 0.99)))
            for name, h in (("time to first token", r.ttft), ("inter-token", r.itl)) if h is not None and h.count]
    if rows:
        st.caption("Latency percentiles since the server started, from its own histograms (Prometheus' "
                   "histogram_quantile: linear within a bucket, so a figure is as fine as the buckets).")
        st.plotly_chart(latency_bars(rows), key=f"live_latency_{len(w.snaps)}", config={"displayModeBar": False})


def _panel(url: str, header: str, device: str) -> None:
    w = _state(url)
    _read(w, header, device)
    if w.error:
        st.warning(w.error + (" (the charts keep the last good readings)" if w.snaps else ""))
    if not w.snaps:
        return
    snap = w.snaps[-1]
    st.caption(f"{ENGINE_NAMES[snap.reading.engine]} serving {snap.reading.model or '(model not named)'}: "
               f"{len(w.snaps)} reading(s)" + (f"; {'; '.join(snap.notes)}" if snap.notes else ""))
    _metrics(w)
    _charts(w)


def page() -> None:
    st.title("Live server")
    st.markdown("Point kvviz at a running **vLLM**, **SGLang** or **llama.cpp** server. It reads the server's "
                "own `/metrics` (and `/v1/models`), so every figure here is what the engine reports; kvviz adds "
                "what those figures mean in tokens. Try it on this machine: `make vllm`, then "
                "`python -m kvviz export --model smollm2 /tmp/smollm2-hf` and serve that folder "
                "(docs/usage.md says how).")
    c1, c2, c3, c4 = st.columns([3, 2, 1, 1])
    url = c1.text_input("Server URL", value="http://127.0.0.1:8000", key="live_url", max_chars=2000)
    header = c2.text_input("Header (optional)", value="", key="live_header", type="password",
                           placeholder="Authorization: Bearer ...", max_chars=4000)
    interval = c3.selectbox("Every (s)", INTERVALS, index=1, key="live_interval")
    # The walkthrough above serves on this machine, so its device is the first guess; a remote server's is the
    # user's to pick (its metrics do not say).
    here = 0 if torch.cuda.is_available() else 1
    device = c4.selectbox("Runs on", ("cuda", "cpu"), index=here, key="live_device", format_func=lambda d: d.upper(),
                          help="where the server runs (first guess: this machine's device); vLLM's CPU backend keeps "
                               "one batch in flight, a GPU two, which changes what a sliding-window layer holds (its "
                               "metrics do not say)")
    watching = st.toggle("Watch live", value=False, key="live_watch",
                         help="read the server every few seconds; off: read once per click of Read now")
    st.button("Read now", key="live_read")
    st.fragment(run_every=interval if watching else None)(_panel)(url, header, device)
