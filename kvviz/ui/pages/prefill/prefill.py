"""Prefill vs decode: TTFT vs prompt length, decode latency vs context, a roofline of this machine,
and the short-question vs long-document example."""
from __future__ import annotations

import math
from typing import Any

import streamlit as st

from kvviz import LoadedModel
from kvviz.charts import perf as pc
from kvviz.units import fmt_bytes, kv_bytes_per_token
from kvviz.engine.generation.flops import weight_bytes
from kvviz.measure.sweeps import SHORT_QUESTION, document_ids, prompt_lengths, sweep_decode, sweep_short_long, sweep_ttft
from kvviz.measure import doubts
from kvviz.measure.sizing import PICK_S, Estimator, pick_context, pick_repeats
from kvviz.measure.stats import Sample, aggregate, phase_verdict, roofline_points
from kvviz.engine.generation.request import resolve_chat
from kvviz.errors import KVVizError
from kvviz.measure.measuring import BusyWindow
from kvviz.ui.common.busy_notes import acquire_or_warn, busy_note
from kvviz.ui.common.measuring_page import page_model, prompt_ids, results_key, where
from kvviz.ui.common.session_probes import estimator, machine_probe
from kvviz.ui.common.sweep_driver import SweepState, drive
from kvviz.ui.settings import ENGINES
from kvviz.ui.common.figs import show
from kvviz.ui.state import session

EXAMPLE_NEW = 16  # the example's default new tokens: enough decode steps for a median per-token rate
INTRO = (
    "Generation has two phases. **Prefill** feeds the whole prompt through the model in one forward pass: "
    "every weight read from memory is used for many tokens, so it is usually **compute-bound**. **Decode** "
    "feeds one token per forward pass: all the weights (and the growing KV cache) are read again for a single "
    "token, so it is usually **memory-bound**. Below, both are measured on this machine and placed on its "
    "roofline."
)


def page() -> None:
    got = page_model("Prefill vs decode", INTRO)
    if got is None:
        return
    s, model = got
    sweep_state, example_state = SweepState("pd_status"), SweepState("pd_example_status")
    sweep_state.settle()
    example_state.settle()
    busy_note()
    results: dict[str, list[Sample]] = session.setdefault(results_key("pd_results", model), {})
    fast = s.engine == "fast"  # the sidebar's engine runs every measured step
    est = estimator(model, fast)
    ctx, repeats = _context_limit(model, est)
    st.caption(f"Engine: {ENGINES[s.engine]}. EOS ignored so every run generates the tokens it asks for.")
    _sweeps(model, results, sweep_state, ctx, repeats, fast, est)
    st.divider()
    _example(model, results, example_state, prompt_ids(s, model)[0], _example_context(model, est, ctx), fast, est)


def _context_limit(model: LoadedModel, est: Estimator | None) -> tuple[int, int]:
    """How far the sweeps go, and the default repeats: the longest context whose sweeps finish in about
    a minute on this machine (``measure.sizing``); the model's own context is one drag away."""
    block = model.config.block_size
    options = sorted({c for c in (64, 128, 256, 512, 1024, 2048, 4096) if c < block} | {block})
    ctx, repeats = pick_context(est, options) if est is not None else (min(options), 1)
    got = int(st.select_slider("Longest context to measure (tokens)", options, value=ctx, key="pd_max_context",
                               width=420,
                               help="The prompt-length sweep, the decode sweep and the long document stop here. "
                                    "The default finishes in about a minute on this machine; the model's own "
                                    "context is the right-most value."))
    return got, repeats


def _example_context(model: LoadedModel, est: Estimator | None, ctx: int) -> int:
    """The example's context: the slider's, or longer where the example (two runs, not a sweep) still
    finishes in about a minute here with its default new tokens and one repeat, so the document is
    long enough to make its point (on a busy machine the slider's 64 made a "document" as long as the
    question: "1× longer"); the repeats then take what time is left."""
    block = model.config.block_size
    fits = [c for c in (256, 512, 1024, 2048, 4096, 8192) if c <= block and est is not None
            and est.example_s(48, c - EXAMPLE_NEW, EXAMPLE_NEW, 1) <= PICK_S]
    return max([ctx, *fits])


def _base_ids(model: LoadedModel) -> list[int]:
    """Real text for the sweeps' prompts (cycled to length), whatever the tokenizer."""
    return list(document_ids(model, 256))


def _decode_bin(ctx: int) -> int:
    return max(8, ctx // 32)


def _sweeps(model: LoadedModel, results: dict[str, list[Sample]], state: SweepState, ctx: int, default_repeats: int,
            fast: bool, est: Estimator | None) -> None:
    lengths = prompt_lengths(ctx)
    st.subheader("TTFT vs prompt length, decode latency vs context")
    with st.container(horizontal=True, vertical_alignment="bottom"):
        repeats = st.number_input("Repeats", 1, 10, default_repeats, key="pd_repeats", width=140,
                                  help="Every point is the median of this many runs; bars and bands show min–max")
        run_it = st.button("Measure prefill and decode", key="pd_run", type="primary")
        st.button("Stop", key="pd_stop", help="Stop the sweep; the points measured so far are kept")
    cost = f" · {est.here(est.prefill_decode_s(ctx, int(repeats)))}" if est is not None else ""
    st.caption(f"Prompt lengths {', '.join(map(str, lengths))} · decode steps at contexts of 17–{ctx - 1:,} "
               f"tokens (EOS ignored so the run from a 16-token prompt generates all {ctx - 16:,} tokens) · "
               f"{_n(int(repeats), 'repeat')}{cost} · {where(model)}")
    live = st.empty()
    if run_it:
        lock = acquire_or_warn()
        if lock is None:
            return
        state.begin()
        results["busy"] = []  # the busy clause goes in the results, which are per (model, device, dtype)
        window = BusyWindow()
        try:
            machine_probe(model)
            base = _base_ids(model)
            results["ttft"], results["decode"] = [], []
            drive(sweep_ttft(model, base, lengths, int(repeats), fast=fast), results["ttft"], "Prefill sweep…",
                  lambda xs: show(live, pc.ttft_chart(aggregate(xs, "ttft_ms"), where(model)),
                                               key=f"pd_live_ttft_{len(xs)}"))
            drive(sweep_decode(model, base, int(repeats), max_context=ctx, fast=fast), results["decode"], "Decode sweep…",
                  lambda xs: show(live, 
                      pc.decode_chart(aggregate(xs, "latency_ms", _decode_bin(ctx)), where(model)),
                      key=f"pd_live_decode_{len(xs)}"))
            state.end()
        finally:
            lock.release()
            results["busy"] = [window.clause()]
        live.empty()
    if not results.get("ttft"):
        st.info("Press **Measure prefill and decode** (it probes this machine first, once per session).")
        return
    if state.status == "stopped":
        st.warning("The sweep was stopped: the charts show the points it measured.")
    _sweep_results(model, results)


def _sweep_results(model: LoadedModel, results: dict[str, list[Sample]]) -> None:
    dec = results.get("decode", [])
    ctx = int(max((x.x for x in dec), default=64))  # bin by the range actually measured
    sub = where(model)
    st.caption(measured_caption(results.get("ttft", []), dec))
    n = len(results.get("ttft", [])) + len(results.get("decode", []))
    a, b = st.columns(2)
    ttft = aggregate(results["ttft"], "ttft_ms")
    show(a, pc.ttft_chart(ttft, sub), key=f"pd_ttft_{n}")
    decode = aggregate(results["decode"], "latency_ms", _decode_bin(ctx)) if results.get("decode") else None
    if decode is not None:
        show(b, pc.decode_chart(decode, sub), key=f"pd_decode_{n}")
    found = sweep_doubts(ttft, decode, (results.get("busy") or [None])[0])
    if found:
        with st.container(key="pd_doubts"):
            st.warning(doubts.verdict(found), icon=":material/report:")
    probe = session.get(session.MACHINE_PROBES, {}).get((str(model.device), model.dtype_name))
    if probe is None:
        return
    if session.get("pd_reprobe"):  # the button below was clicked on the previous run
        lock = acquire_or_warn()
        if lock is not None:
            try:
                probe = machine_probe(model, again=True)
            finally:
                lock.release()
    points = {"prefill": roofline_points(results["ttft"])}
    if results.get("decode"):
        points["decode"] = roofline_points(results["decode"], 4 * _decode_bin(ctx))
    a, b = st.columns([3, 2])
    show(a, pc.roofline(probe, points), key=f"pd_roofline_{n}")
    with b:
        st.markdown("**This machine** (probed once per session)")
        st.caption(probe.describe() + f" · probe took {probe.seconds:.1f} s")
        st.button("Probe again", key="pd_reprobe", help="Measure peak FLOP/s and bandwidth anew (about a second)")
        if found:
            # One or the other: a page that doubts its own timings (the box above) draws no
            # conclusion from them; the roofline still shows the points as measured.
            with st.container(key="pd_no_verdict"):
                st.markdown("**No verdict from these measurements**")
                st.caption("They contradict what they should show (see the box above), so this page does not say "
                           "which phase is compute- or memory-bound from them. Measure again on a quiet machine.")
            return
        st.markdown("**Verdict, from the measurements**")
        for phase, df in points.items():
            if not len(df):
                continue
            # Prefill at its longest prompt; decode at the middle of the context range.
            row = df.iloc[-1] if phase == "prefill" else df.iloc[len(df) // 2]
            unit = "prompt" if phase == "prefill" else "context"
            at = f"at a {int(row['x']):,}-token {unit}"
            st.markdown("- " + phase_verdict(phase, float(row["intensity"]), float(row["median"]), probe, at))
        st.caption("Intensity = analytic matmul FLOPs / minimum bytes moved (weights once + KV read and written); "
                   "achieved GFLOP/s = those FLOPs / the measured time.")


def measured_caption(ttft: list[Sample], decode: list[Sample]) -> str:
    """What the charts below hold, from the samples themselves (a stopped sweep holds less than it asked)."""
    parts = []
    if ttft:
        xs = sorted({int(x.x) for x in ttft})
        parts.append(f"prefill of {xs[0]:,}–{xs[-1]:,}-token prompts ({len(xs)} lengths, "
                     f"{_n(len({x.repeat for x in ttft}), 'repeat')})")
    if decode:
        xs = sorted({int(x.x) for x in decode})
        runs = _n(len({x.repeat for x in decode}), "run")
        parts.append(f"decode steps at contexts of {xs[0]:,}–{xs[-1]:,} tokens ({runs})")
    return "Measured: " + "; ".join(parts) + "." if parts else ""


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def sweep_doubts(ttft: Any, decode: Any, busy: str | None) -> list[str]:
    """What in the sweeps contradicts their expected shape (kvviz.measure.doubts): a time to first
    token that does not grow with the prompt, repeats far apart, a busy CPU."""
    shape = [doubts.rises(ttft["x"].to_numpy(), ttft["median"].to_numpy(), "the time to first token")]
    return doubts.sweep(shape, [(ttft, "repeats of the same prompt length"),
                                (decode, "repeats of a decode step at the same context")], busy)


# --- the seeds' example ------------------------------------------------------------------------

def short_question(model: LoadedModel, fallback: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
    """The question's ids as Generate feeds it with Chat on (the model's own template, when it has one),
    and whether the template was used."""
    if not model.has_tokenizer:
        return fallback[:16], False
    try:
        rows, _ = resolve_chat(model, SHORT_QUESTION, None, None)
        return tuple(rows[0]), True
    except KVVizError:  # no chat template: the bare question
        return tuple(model.tokenizer.encode(SHORT_QUESTION)), False


def _example(model: LoadedModel, results: dict[str, list[Sample]], state: SweepState,
             prompt_ids: tuple[int, ...], ctx: int, fast: bool, est: Estimator | None) -> None:
    st.subheader("A short question vs a long pasted document")
    short, templated = short_question(model, prompt_ids)
    if not short:
        st.info("This model has no tokenizer: type a prompt in the sidebar to use as the short question.")
        return
    with st.container(horizontal=True, vertical_alignment="bottom"):
        n_new = int(st.number_input("New tokens", 8, max(8, min(256, ctx // 2)), min(EXAMPLE_NEW, ctx // 2), step=8,
                                    key="pd_example_tokens", width=160,
                                    help="Generated after each prompt; the per-token rate is their median"))
        run_it = st.button("Run the example", key="pd_example", type="primary")
        st.button("Stop", key="pd_example_stop", help="Stop; the runs that finished are kept")
    long_len = ctx - n_new
    how = " in the model's chat template, as Generate sends it" if templated else ""
    # As many repeats (up to 3) as finish in about a minute here, at the load now.
    repeats = pick_repeats(lambda r: est.example_s(len(short), long_len, n_new, r)) if est is not None else 3
    cost = f" · {est.here(est.example_s(len(short), long_len, n_new, repeats))}" if est is not None else ""
    st.caption(f"Question: “{SHORT_QUESTION}”{how} ({len(short)} tokens) vs a document that fills a "
               f"{ctx:,}-token context ({long_len:,} tokens); {n_new} new tokens after each, EOS ignored so every "
               f"run generates {n_new} tokens; {_n(repeats, 'repeat')}{cost} · {where(model)}")
    if run_it:
        lock = acquire_or_warn()
        if lock is None:
            return
        state.begin()
        results["example"] = []
        try:
            drive(sweep_short_long(model, short, long_len, n_new, repeats=repeats, fast=fast), results["example"],
                  "Measuring…")
            state.end()
        finally:
            lock.release()
    samples = results.get("example")
    if not samples:
        return
    if state.status == "stopped":
        st.warning("Stopped: showing the runs that finished.")
    ttft, tpot = aggregate(samples, "ttft_ms"), aggregate(samples, "tpot_ms")
    show(st, pc.short_long_chart(ttft, tpot, where(model)), key=f"pd_example_chart_{len(samples)}")
    st.markdown(_example_sentence(ttft, tpot, model))


def _example_sentence(ttft: Any, tpot: Any, model: LoadedModel) -> str:
    def get(df: Any, series: str) -> tuple[float, float] | None:
        row = df[df["series"] == series]
        return (float(row["median"].iloc[0]), float(row["x"].iloc[0])) if len(row) else None

    s_t, l_t = get(ttft, "short question"), get(ttft, "long document")
    s_d, l_d = get(tpot, "short question"), get(tpot, "long document")
    if not (s_t and l_t):
        return ""
    if not (s_d and l_d and all(math.isfinite(v) and v > 0 for v in (s_d[0], l_d[0]))):
        # Never a "nan": a run that made one token has no decode step to time.
        return (f"Time to first token: {s_t[0]:,.1f} → {l_t[0]:,.1f} ms. Each new token took — (no decode step "
                "was timed: a run stopped after its first token), so the decode comparison is missing.")
    change = l_d[0] / s_d[0] - 1
    head = (f"The document is {l_t[1] / s_t[1]:,.0f}× longer than the question. Its time to first token grew "
            f"{l_t[0] / s_t[0]:,.1f}× ({s_t[0]:,.1f} → {l_t[0]:,.1f} ms): the prefill must process the whole prompt. "
            f"After that, each new token took {s_d[0]:,.2f} vs {l_d[0]:,.2f} ms ({change * 100:+.0f}%): with the cache, "
            "a decode step processes one token whatever came before. ")
    if abs(change) < 0.15:
        return head + "The per-token rate barely moves; only the attention over the longer cache adds a little."
    kv = kv_bytes_per_token(model.config.n_layer, model.config.kv_heads, model.config.head_dim, model.dtype.itemsize) * int(l_t[1])
    w = weight_bytes(model.config, _itemsize(model))
    return head + (f"What does grow is the cache each step reads: {fmt_bytes(kv)} of K/V for the document next to "
                   f"{fmt_bytes(w)} of weights, so in a model this small the longer cache is a visible share of "
                   "a decode step (in a big model the weights dwarf it). Still far less than the TTFT grew.")


def _itemsize(model: LoadedModel) -> int:
    return model.dtype.itemsize
