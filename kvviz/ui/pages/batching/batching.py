"""Batching: cached decode at batch sizes 1..16, throughput vs per-request latency, KV bytes vs B."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from kvviz import LoadedModel
from kvviz.charts import perf as pc
from kvviz.measure.sweeps import BATCH_SIZES, batch_memory, batch_sizes, document_ids, sweep_batch
from kvviz.measure.sizing import pick_batch
from kvviz.measure.stats import Sample, aggregate
from kvviz.ui.common.busy_notes import acquire_or_warn, busy_note
from kvviz.ui.common.measuring_page import page_model, prompt_ids, results_key, where
from kvviz.ui.common.session_probes import estimator
from kvviz.ui.common.sweep_driver import SweepState, drive
from kvviz.ui.settings import ENGINES, Settings
from kvviz.ui.common.figs import show
from kvviz.units import MIB, fmt_bytes
from kvviz.ui.state import session

INTRO = (
    "A decode step reads every weight to produce one token per request. Put B requests in one batch and "
    "the same weight reads serve B tokens: **aggregate throughput** climbs almost for free while the step is "
    "memory-bound, and each request waits a little longer per token (**latency**). The KV cache, though, "
    "is per request: its bytes grow linearly with B."
)
PROMPT_CHOICES = {"same": "Same prompt repeated", "different": "Different prompts (cut to one length)"}


def page() -> None:
    got = page_model("Batching", INTRO)
    if got is None:
        return
    s, model = got
    state = SweepState("batch_status")
    state.settle()
    busy_note()
    st.caption(f"Engine: {ENGINES[s.engine]}.")
    _sweep(s, model, state)


def _base(s: Settings, model: LoadedModel) -> list[int]:
    """The sidebar prompt's tokens (the 'same prompt'), or a document when there is none."""
    ids = list(prompt_ids(s, model)[0])
    return ids or list(document_ids(model, 64))


def _sweep(s: Settings, model: LoadedModel, state: SweepState) -> None:
    cfg = model.config
    c1, c2, c3, c4 = st.columns([2.4, 1, 1, 1])
    prompts = c1.radio("Prompts", tuple(PROMPT_CHOICES), format_func=PROMPT_CHOICES.get, key="batch_prompts",
                       horizontal=True, help="Same: the sidebar prompt on every row. Different: distinct texts, "
                       "each cut to the same number of tokens (batches here need equal lengths)")
    prompt_len = int(c2.number_input("Prompt tokens", 4, max(4, cfg.block_size // 2), min(32, cfg.block_size // 2),
                                     key="batch_prompt_len"))
    n_new = int(c3.number_input("New tokens", 4, max(4, cfg.block_size - prompt_len), 32, key="batch_new_tokens"))
    sizes = batch_sizes(model, prompt_len, n_new)
    est = estimator(model, s.engine == "fast")
    # The default sizes and repeats finish in about a minute on this machine, at the load now
    # (measure.sizing); more is one click away.
    fit, default_repeats = pick_batch(est, sizes, prompt_len, n_new) if est is not None and sizes else (sizes, 1)
    repeats = int(c4.number_input("Repeats", 1, 10, default_repeats, key="batch_repeats"))

    skipped = [b for b in BATCH_SIZES if b not in sizes]
    slow = [b for b in sizes if b not in fit]
    if slow and not st.checkbox(f"Also B = {', '.join(map(str, slow))}", key="batch_all_sizes",
                                help="Batch sizes left out of the default because the sweep would take over a "
                                     "minute here with them"):
        sizes = fit
    else:
        slow = []
    note = f"Batch sizes {', '.join(map(str, sizes)) or 'none'}"
    if slow:
        note += f" (B = {', '.join(map(str, slow))} left out: over a minute here with them)"
    if skipped:
        note += (f" (skipped {', '.join(map(str, skipped))}: over a quarter of free memory; B={skipped[0]} "
                 f"would need ≈{fmt_bytes(batch_memory(model, skipped[0], prompt_len, n_new))})")
    cost = f" · {est.here(est.batch_s(sizes, prompt_len, n_new, repeats))}" if est is not None and sizes else ""
    st.caption(f"{note} · {n_new} new tokens per row (EOS ignored so every run generates {n_new} tokens) · "
               f"{repeats} repeats{cost} · static KV cache · {where(model)}")
    with st.container(horizontal=True):
        run_it = st.button("Run the batch sweep", key="batch_run", type="primary", disabled=not sizes)
        st.button("Stop", key="batch_stop", help="Stop the sweep; the points measured so far are kept")

    key = results_key("batch", model)
    stored: dict[str, list[Sample]] = session.setdefault(key, {})
    live = st.empty()
    series = "different prompts" if prompts == "different" else "same prompt"
    if run_it:
        lock = acquire_or_warn()
        if lock is None:
            return
        stored[series] = []
        state.begin()
        try:
            drive(sweep_batch(model, _base(s, model), sizes, prompt_len, n_new, repeats, prompts == "different",
                              fast=s.engine == "fast"),
                  stored[series], "Measuring…",
                  lambda xs: show(live, _tradeoff(xs, model), key=f"batch_live_{len(xs)}"))
            state.end()
        finally:
            lock.release()
        live.empty()
    samples = [x for v in stored.values() for x in v]
    if not samples:
        st.info("Press **Run the batch sweep**. Run it with both prompt choices to compare them on one chart.")
        return
    if state.status == "stopped":
        st.warning("The sweep was stopped: the charts show the batch sizes it measured.")
    _results(model, samples)


def _tradeoff(samples: list[Sample], model: LoadedModel):  # type: ignore[no-untyped-def]
    return pc.batch_tradeoff(aggregate(samples, "tpot_ms"), aggregate(samples, "tokens_per_s"), where(model))


def _results(model: LoadedModel, samples: list[Sample]) -> None:
    n = len(samples)
    a, b = st.columns([3, 2])
    show(a, _tradeoff(samples, model), key=f"batch_tradeoff_{n}")
    show(b, pc.batch_kv(aggregate(samples, "kv_bytes_allocated"), aggregate(samples, "kv_bytes_used"),
                               where(model)), key=f"batch_kv_{n}")
    st.dataframe(_table(samples), hide_index=True, key="batch_table")
    st.caption("Per-request latency = median decode step time (every request in the batch gets one token per "
               "step). Aggregate throughput = B tokens per step / that time. Medians over repeats; ranges are "
               "min–max. 'Distinct outputs' counts different continuations among the B rows.")


def _table(samples: list[Sample]) -> pd.DataFrame:
    lat, tps = aggregate(samples, "tpot_ms"), aggregate(samples, "tokens_per_s")
    kv, outs = aggregate(samples, "kv_bytes_allocated"), aggregate(samples, "distinct_outputs")
    rows = []
    for i, r in lat.iterrows():
        t, k, o = tps.iloc[i], kv.iloc[i], outs.iloc[i]
        rows.append({
            "prompts": r["series"], "batch size": int(r["x"]),
            "ms/token per request": round(float(r["median"]), 2),
            "range (ms)": f"{r['min']:.2f}–{r['max']:.2f}",
            "aggregate tokens/s": round(float(t["median"]), 1),
            "KV allocated (MiB)": round(float(k["median"]) / MIB, 2),
            "distinct outputs": int(o["median"]),
            "repeats": int(r["n"]),
        })
    return pd.DataFrame(rows)
