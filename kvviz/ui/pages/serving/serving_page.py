"""Serving: many requests at once. A workload builder, a Run that streams the serving engine's
steps live (a thread of its own: ``serving_run.py``), and after the run the latency table, the
replay, the downloads and the three policies side by side (``serving_views.py``)."""
from __future__ import annotations

from typing import Any

import streamlit as st

from kvviz import KVVizError, LoadedModel
from kvviz.engine.serving.engine import ServeConfig
from kvviz.engine.serving.workloads import encode, shipped_prompts
from kvviz.measure.sweeps import DIFFERENT_TEXTS, DOCUMENT
from kvviz.ui.common.busy_notes import acquire_or_warn, busy_note
from kvviz.ui.common.measuring_page import page_model, where
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.pages.serving import serving_views as views
from kvviz.ui.pages.serving import workload as wl
from kvviz.ui.pages.serving.serving_run import COMPARE_ORDER, ServeJob, check, start
from kvviz.ui.settings import Settings
from kvviz.ui.state import persist, session
from kvviz.units import dtype_bytes, fmt_bytes, kv_bytes_per_token

TITLE = "Serving: many requests at once"
INTRO = (
    "A server holds many requests at once in **one pool of KV blocks**. Each step, its scheduler picks what "
    "runs: one decode token for every running request, then prompt chunks of the waiting ones, up to a "
    "**token budget**; every token of that step goes through the weights in **one forward**. When the pool "
    "runs out, the newest request is **preempted**: its blocks are freed and its tokens computed again later. "
    "Blocks whose tokens another request already computed (a shared system prompt) are reused: the **prefix "
    "cache**. Build a workload, run it, and watch the scheduler (vLLM V1's rules, on this model's real weights)."
)
SYSTEM_PROMPT = shipped_prompts()[0] + " " + DOCUMENT  # serve-bench's system prompt, cycled to its tokens
BLOCK_SIZES = (4, 8, 16, 32, 64)
OUTPUTS = ("fixed", "uniform")
UNITS = ("blocks", "MiB")
LEN_MAX = 100_000  # a prompt's or an output's tokens, as typed (the model's context is checked after)
# The workload builder's widgets, kept across pages (persist.py); the replay slider is kept per run.
KEPT_KEYS = ("serve_requests", "serve_arrival", "serve_rate", "serve_seed", "serve_burst_size", "serve_burst_every",
             "serve_prompt", "serve_prompt_len", "serve_prompt_max", "serve_output", "serve_output_len",
             "serve_output_max", "serve_shared", "serve_shared_len", "serve_pool_unit", "serve_blocks", "serve_mib",
             "serve_block_size", "serve_budget", "serve_max_running")


def page() -> None:
    got = page_model(TITLE, INTRO)
    if got is None:
        return
    s, model = got
    busy_note()
    spec, config = _builder(model)
    workload = _workload(s, model, spec)
    msgs = wl.problems(spec, workload, context=model.config.block_size, num_blocks=config.num_blocks,
                       block_size=config.block_size, budget=config.max_num_batched_tokens)
    if not msgs and workload:
        engine_says = check(model, config, workload)
        msgs = [engine_says[0].upper() + engine_says[1:]] if engine_says else []
    for m in msgs:
        st.error(md_plain(m))
    _run(model, config, workload, bad=bool(msgs))


def _builder(model: LoadedModel) -> tuple[wl.WorkloadSpec, ServeConfig]:
    """The workload builder's widgets (keys ``serve_*``) -> the workload's spec and the engine's settings.

    Every widget takes its value from ``persist`` (the sidebar's mechanism): Streamlit forgets a
    widget's value after a script run that does not draw it, which is every run of another page, and
    here also a run where the arrival or the pool unit hides it; the shadow copy puts it back."""
    c = model.config
    st.subheader("Workload")
    a, b, r, d = st.columns([1, 2.2, 1, 1])
    n = int(a.number_input("Requests", 0, wl.MAX_REQUESTS, _num("serve_requests", 8, 0, wl.MAX_REQUESTS),
                           key="serve_requests"))
    arrival = b.radio("Arrival", tuple(wl.ARRIVALS), format_func=wl.ARRIVALS.get,
                      index=persist.keep_index("serve_arrival", "poisson", tuple(wl.ARRIVALS)), key="serve_arrival",
                      horizontal=True, help="In scheduler steps, so a run is the same step for step every time")
    rate, burst, every = 1.0, 4, 10
    if arrival in ("steady", "poisson"):
        rate = float(r.number_input("Requests per step", 0.01, 64.0, _num("serve_rate", 0.5, 0.01, 64.0), step=0.25,
                                    key="serve_rate"))
    elif arrival == "bursts":
        burst = int(r.number_input("Burst size", 1, wl.MAX_REQUESTS, _num("serve_burst_size", 4, 1, wl.MAX_REQUESTS),
                                   key="serve_burst_size"))
        every = int(d.number_input("Every (steps)", 1, 1000, _num("serve_burst_every", 10, 1, 1000),
                                   key="serve_burst_every"))
    seed = int(d.number_input("Seed", 0, 2**31 - 1, _num("serve_seed", 0, 0, 2**31 - 1),
                              key="serve_seed")) if arrival != "bursts" else 0
    a, b, c2, d, e, f = st.columns([1.8, 1, 1, 1.2, 1, 1])
    prompt = a.radio("Prompt lengths", tuple(wl.LENGTHS), format_func=wl.LENGTHS.get,
                     index=persist.keep_index("serve_prompt", "uniform", tuple(wl.LENGTHS)), key="serve_prompt",
                     horizontal=True)
    p_lo = int(b.number_input("Prompt tokens" if prompt == "fixed" else "from", 1, LEN_MAX,
                              _num("serve_prompt_len", 8, 1, LEN_MAX), key="serve_prompt_len",
                              disabled=prompt == "real"))
    p_hi = int(c2.number_input("to", 1, LEN_MAX, _num("serve_prompt_max", 40, 1, LEN_MAX), key="serve_prompt_max",
                               disabled=prompt != "uniform"))
    output = d.radio("Output lengths", OUTPUTS, index=persist.keep_index("serve_output", "uniform", OUTPUTS),
                     key="serve_output", horizontal=True)
    o_lo = int(e.number_input("Output tokens" if output == "fixed" else "from", 1, LEN_MAX,
                              _num("serve_output_len", 4, 1, LEN_MAX), key="serve_output_len"))
    o_hi = int(f.number_input("to", 1, LEN_MAX, _num("serve_output_max", 16, 1, LEN_MAX), key="serve_output_max",
                              disabled=output != "uniform"))
    a, b, u, p, bs_col, t, m = st.columns([1.4, 1, 1.2, 1, 0.9, 1, 1])
    shared = float(a.slider("Shared system prompt", 0.0, 1.0, _num("serve_shared", 0.5, 0.0, 1.0), step=0.05,
                            key="serve_shared",
                            help="The fraction of requests whose prompt starts with the same system prompt"))
    shared_len = int(b.number_input("its tokens", 0, LEN_MAX, _num("serve_shared_len", 32, 0, LEN_MAX),
                                    key="serve_shared_len"))
    unit = u.radio("Pool in", UNITS, index=persist.keep_index("serve_pool_unit", "blocks", UNITS),
                   key="serve_pool_unit", horizontal=True)
    block_size = int(bs_col.selectbox("Block size", BLOCK_SIZES,
                                      index=persist.keep_index("serve_block_size", 16, BLOCK_SIZES),
                                      key="serve_block_size"))
    per_token = kv_bytes_per_token(c.n_layer, c.kv_heads, c.head_dim, dtype_bytes(model.dtype_name))
    if unit == "blocks":
        blocks = int(p.number_input("Blocks", 1, 1 << 16, _num("serve_blocks", 32, 1, 1 << 16), key="serve_blocks"))
    else:
        mib = float(p.number_input("MiB", 0.01, 65536.0, _num("serve_mib", 4.0, 0.01, 65536.0), key="serve_mib"))
        blocks = wl.pool_blocks_from_mib(mib, per_token, block_size)
    budget = int(t.number_input("Token budget", 1, 1 << 16, _num("serve_budget", 64, 1, 1 << 16), key="serve_budget",
                                help="max_num_batched_tokens: the tokens one step may feed"))
    max_running = int(m.number_input("Max running", 1, 1024, _num("serve_max_running", 8, 1, 1024),
                                     key="serve_max_running", help="max_num_seqs"))
    persist.remember(*KEPT_KEYS)
    st.caption(f"Pool: {blocks:,} blocks × {block_size} tokens × {fmt_bytes(per_token)} per token "
               f"(2 × {c.n_layer} layers × {c.kv_heads} K/V heads × {c.head_dim} × {dtype_bytes(model.dtype_name)} B) "
               f"= {fmt_bytes(blocks * block_size * per_token)} · greedy, EOS ignored · {where(model)} · the readable "
               "model's forward (the engine's ragged step)")
    spec = wl.WorkloadSpec(requests=n, arrival=arrival, rate=rate, burst_size=burst, burst_every=every, prompt=prompt,
                           prompt_len=p_lo, prompt_max=max(p_lo, p_hi), output=output, output_len=o_lo,
                           output_max=max(o_lo, o_hi), shared_fraction=shared, shared_len=shared_len, seed=seed)
    return spec, ServeConfig(num_blocks=max(1, blocks), block_size=block_size, max_num_batched_tokens=budget,
                             max_num_seqs=max_running)


def _num(key: str, default: float, lo: float, hi: float) -> Any:
    """A number widget's kept value within its bounds, of its default's type (Streamlit refuses an
    int value beside float bounds)."""
    return type(default)(persist.keep(key, default, bounds=(lo, hi)))


def _workload(s: Settings, model: LoadedModel, spec: wl.WorkloadSpec) -> list[dict[str, object]]:
    if spec.requests < 1:
        return []
    tok = model.tokenizer if model.has_tokenizer else None
    texts = [tok.encode(t + DOCUMENT) for t in DIFFERENT_TEXTS] if tok else [[i % 50 + 1 for i in range(64)]]
    system = tok.encode(SYSTEM_PROMPT) if tok else list(range(1, 65))
    real: list[list[int]] = []
    real_shared: list[list[int]] = []
    if spec.prompt == "real" and tok:
        # serve-bench's shipped prompts (assets/serve_prompts.json), through the chat template when
        # Chat is on: there the shared system prompt is the template's system message.
        sys_text, prompts = shipped_prompts()
        for text in prompts:
            try:
                real.append(list(encode(model, text, s.chat)))
                if s.chat:
                    real_shared.append(list(encode(model, text, True, sys_text)))
            except KVVizError:
                real.append(tok.encode(text))
    return wl.build(spec, texts, system, real, real_shared)


def _run(model: LoadedModel, config: ServeConfig, workload: list[dict[str, object]], bad: bool) -> None:
    job: ServeJob | None = session.get(session.SERVE_JOB)
    cmp_job: ServeJob | None = session.get(session.SERVE_COMPARE)
    live = next((j for j in (job, cmp_job) if j is not None and not j.done.is_set()), None)
    with st.container(horizontal=True):
        run_it = st.button("Run", key="serve_run", type="primary", disabled=bad or live is not None)
        stop = st.button("Stop", key="serve_stop", disabled=live is None,
                         help="Stop after the current step; what was computed is kept")
        compare = st.button("Compare the three policies", key="serve_compare", disabled=bad or live is not None,
                            help="The same workload one at a time, as static batches and with continuous batching")
    if stop and live is not None:
        live.abort()
    if (run_it or compare) and live is None:
        lock = acquire_or_warn()
        if lock is not None:
            live = start(model, config, workload, COMPARE_ORDER if compare else ("continuous",), release=lock)
            session.put(session.SERVE_COMPARE if compare else session.SERVE_JOB, live)
    if live is not None:
        view = views.LiveView()
        while not live.done.wait(views.TEXT_EVERY_S):
            view.draw(live, model)
        st.rerun()  # the finished run drawn whole, without the live places
    if job is not None and job.error:
        st.error(md_plain(job.error))
    if job is not None and "continuous" in job.results:
        st.subheader("The run")
        _changed_note(job, config, workload)
        views.results(job, job.results["continuous"], model)
    elif job is None:
        st.info("Press **Run** to serve this workload with continuous batching, or **Compare the three policies**.")
    if cmp_job is not None:
        st.subheader("Three policies, one workload")
        _changed_note(cmp_job, config, workload)
        if cmp_job.error:
            st.error(md_plain(cmp_job.error))
        views.comparison(cmp_job)


def _changed_note(job: ServeJob, config: ServeConfig, workload: list[dict[str, object]]) -> None:
    """A finished run stays on the page when a setting changes (nothing computed is thrown away);
    this says plainly that it was made with the settings it started with, not the ones shown above."""
    if job.config == config and job.workload == workload:
        return
    cfg = job.config
    st.info(f"The settings above changed after this run. What follows is the run as it was made: "
            f"{len(job.workload)} requests, {cfg.num_blocks:,} blocks of {cfg.block_size} tokens, a budget of "
            f"{cfg.max_num_batched_tokens:,} tokens, at most {cfg.max_num_seqs} running. Press **Run** to serve "
            "the new workload; until then its downloads are this run's.")
