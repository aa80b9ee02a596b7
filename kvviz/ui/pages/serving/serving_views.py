"""What the serving page draws from a run: the live charts (while steps arrive, at a bounded rate),
and after the run the numbers, the paragraph in plain words, the latency table, the replay
scrubber, the downloads and the policy comparison."""
from __future__ import annotations

import time
from typing import Any

import pandas as pd
import streamlit as st

from kvviz.charts import serving as sc
from kvviz.charts import serving_compare as scmp
from kvviz.charts import serving_data as sd
from kvviz.engine.serving.engine import ServeResult
from kvviz.engine.serving.records import StepRecord
from kvviz.ui.common.figs import show
from kvviz.ui.common.frames import safe_frame
from kvviz.ui.pages.serving import workload as wl
from kvviz.ui.pages.serving.serving_run import ServeJob
from kvviz.ui.state import persist, session

CHART_EVERY_S = 1.0  # live charts at most once a second (a chart frame costs a small machine's browser ~0.5 s)
TEXT_EVERY_S = 0.25  # the status line and the streaming text four times a second
STREAMED = 3  # requests whose text streams live


class _Places:
    """The six chart placeholders and the ledger line, in the live view's and the replay's layout."""

    def __init__(self) -> None:
        a, b = st.columns([3, 2])
        self.timeline, self.pool = a.empty(), b.empty()
        c, d = st.columns(2)
        self.comp, self.queues = c.empty(), d.empty()
        e, f = st.columns(2)
        self.usage, self.hits = e.empty(), f.empty()
        self.ledger = st.empty()


class LiveView(_Places):
    """The placeholders of the live view, made once per script run and redrawn into."""

    def __init__(self) -> None:
        with st.container(key="serve_live"):
            self.status = st.empty()
            self.text = st.empty()
            super().__init__()
        self.draws = 0
        self.last_chart = 0.0

    def draw(self, job: ServeJob, model: Any, force: bool = False) -> None:
        steps = list(job.steps)
        n_done = sum(len(s.finished) for s in steps)
        policy = scmp.POLICY_NAMES.get(job.current, job.current)
        last = steps[-1] if steps else None
        self.status.markdown(
            f"**Running {policy}** ({len(job.results) + 1} of {len(job.policies)}) · step {len(steps)} · "
            f"{len(last.running) if last else 0} running, {len(last.waiting) if last else 0} waiting · "
            f"{n_done} of {len(job.workload)} requests finished · {time.monotonic() - job.started:.0f} s"
            if not job.done.is_set() else "")
        outs = job.outputs()
        if model.has_tokenizer:
            lines = [f"{rid}: {model.tokenizer.decode(outs.get(rid, []))}" for rid in job.request_ids[:STREAMED]]
            self.text.text("\n".join(lines))  # plain text: model output never becomes markup
        now = time.monotonic()
        if steps and (force or now - self.last_chart >= CHART_EVERY_S):
            self.last_chart = now
            self.draws += 1
            charts(self, steps, job, job.config.block_size, key=f"live{job.id}_{self.draws}")


def charts(view: Any, steps: list[StepRecord], job: ServeJob, block_size: int, key: str,
           upto: int | None = None) -> None:
    """The six run charts into ``view``'s places (a LiveView, or the replay's own)."""
    ids = job.request_ids
    at = steps[-1] if upto is None else steps[upto]
    show(view.timeline, sc.timeline(steps, ids, upto), key=f"serve_tl_{key}")
    show(view.pool, sc.pool_grid(at, ids, block_size), key=f"serve_pool_{key}")
    show(view.comp, sc.step_composition(steps, upto), key=f"serve_comp_{key}")
    show(view.queues, sc.queues(steps, upto), key=f"serve_q_{key}")
    show(view.usage, sc.kv_usage(steps, block_size, upto), key=f"serve_kv_{key}")
    show(view.hits, sc.prefix_hit_rate(steps, upto), key=f"serve_hit_{key}")
    preempted = [(s.step, r) for s in steps for r in s.preempted]
    if preempted:
        view.ledger.caption("Preempted: " + "; ".join(f"{r} at step {k}" for k, r in preempted[:20])
                            + (" …" if len(preempted) > 20 else ""))


def paragraph(summary: sd.RunSummary, result: ServeResult, block_size: int, budget: int) -> str:
    """What each chart shows, in plain words, with this run's numbers."""
    s, steps = summary, result.steps
    ser = sd.series(steps, block_size)
    peak_gap = int(ser["waste_tokens"].max()) if len(steps) else 0
    mid = int(len(steps) // 2)
    hit = (f"{s.prefix_hit_tokens:,} of {s.prefix_query_tokens:,} prompt tokens "
           f"({100 * s.prefix_hit_tokens / s.prefix_query_tokens:.1f}%)" if s.prefix_query_tokens else "no tokens")
    ttft = s.ttft_ms[0]
    again = steps[-1] if steps else None
    return (
        f"**The timeline** gives each of the {s.requests} requests a row and each of the {s.steps} scheduler steps "
        "a column: grey while it waits, blue while its prompt is prefilled (a long prompt in several chunks), green "
        "for each decode step, red once it has been preempted and until it is recomputed; ✕ marks its finish. "
        f"**Tokens per step** stacks each step's prefill and decode tokens under the budget of {budget}: decodes "
        "(one token per running request) go first, prefill chunks take what is left. **Queues** counts the requests "
        f"running and waiting after each step; at most {s.peak_running} ran at once. "
        f"**The block pool** shows, for the step chosen, which request holds each block of {block_size} tokens "
        f"(purple: shared by several through the prefix cache; grey: cached, free to reuse or evict); the run held "
        f"at most {s.peak_blocks_used} of {steps[0].blocks_total if steps else 0} blocks"
        + (f"; its sliding-window layers gave back {again.window_freed_blocks:,} blocks before their requests "
           "ended, as the window moved past them (they show as cached or free). "
           if again is not None and again.window_freed_blocks else ". ")
        + "**KV usage** draws two lines: the share of blocks held (what a server reports as KV usage) and the share of "
        f"slots actually written; the gap is the unfilled end of each request's last block, at most {peak_gap} "
        f"slots here (step {mid}: {ser['usage_blocks_pct'][mid]:.1f}% by blocks, "
        f"{ser['usage_tokens_pct'][mid]:.1f}% by tokens). **Prefix-cache hits**: {hit} were found already computed "
        "(a shared system prompt counts only in whole blocks, and never the prompt's last token)"
        + (f"; the {again.preempted_query_tokens:,} tokens of re-admissions after a preemption, "
           f"{again.preempted_hit_tokens:,} of them found cached, are counted apart, as vLLM counts them. "
           if again is not None and again.preempted_query_tokens else ". ")
        + (f"**Preemption**: {s.preemptions} preemption{'s' if s.preemptions != 1 else ''} threw away "
           f"{s.lost_tokens:,} computed tokens, which were computed again. " if s.preemptions else
           "**Preemption**: none; the pool held every running request. ")
        + f"In all {s.output_tokens:,} tokens in {s.duration_ms / 1000:.2f} s"
        + (f" ({s.throughput_tok_s:,.1f} tokens/s); the median request waited {ttft:,.0f} ms for its first token."
           if s.throughput_tok_s is not None and ttft is not None else ".")
    )


def results(job: ServeJob, result: ServeResult, model: Any) -> None:
    """After the run: numbers, paragraph, latency chart and table, replay, downloads."""
    cfg = job.config
    summary = sd.summarize(result.steps, result.requests)
    longest = max((len(r["prompt_ids"]) + int(r["max_tokens"]) for r in job.workload), default=0)  # type: ignore[arg-type]
    conc = wl.max_concurrency(cfg.num_blocks, cfg.block_size, longest)
    with st.container(key="serve_numbers", horizontal=True):
        st.metric("Throughput", f"{summary.throughput_tok_s:,.1f} tok/s" if summary.throughput_tok_s else "n/a")
        st.metric("TTFT p50", _ms(summary.ttft_ms[0]))
        st.metric("TPOT p50", _ms(summary.tpot_ms[0]))
        st.metric("Peak running", f"{summary.peak_running}")
        st.metric("Max concurrency (calculator)", f"{conc:.2f}x",
                  help=f"vLLM's rule: {cfg.num_blocks} blocks / ceil({longest} tokens / {cfg.block_size}) blocks "
                       "per request at the longest request's length")
        st.metric("Preemptions", f"{summary.preemptions}")
        st.metric("Prefix hits", f"{summary.prefix_hit_tokens:,} tok")
    if result.stopped:
        st.warning(f"Stopped at step {len(result.steps)}: the unfinished requests ended \"aborted\" with the "
                   "tokens they had; everything below is what was computed.")
    if result.blocks_leaked:
        st.error(f"{result.blocks_leaked} blocks were still held after the run (a bug in the engine).")
    st.markdown(paragraph(summary, result, cfg.block_size, cfg.max_num_batched_tokens))
    st.caption(f"The peak running count ({summary.peak_running}) beside the calculator's maximum concurrency "
               f"({conc:.2f}x for {longest}-token requests): the calculator assumes every request grows to its "
               "longest; the scheduler admits by what each request holds now, and preempts when that runs out.")
    a, b = st.columns([1, 1])
    show(a, sc.latency_percentiles(result.requests), key=f"serve_lat_{job.id}")
    b.dataframe(safe_frame(sd.request_rows(result.requests)), hide_index=True, key="serve_table",
                height=min(360, 38 + 35 * len(result.requests)))  # no empty rows under a short table
    _replay(job, result)
    with st.container(horizontal=True):
        st.download_button("Events (JSON Lines)", sd.events_jsonl(result.steps, result.requests),
                           file_name=f"kvviz-serve-{job.id}.jsonl", mime="application/x-ndjson", key="serve_dl_events",
                           on_click="ignore")  # a download needs no rerun
        st.download_button("Requests (CSV)", sd.requests_csv(result.requests), file_name=f"kvviz-serve-{job.id}.csv",
                           mime="text/csv", key="serve_dl_csv", on_click="ignore")


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.1f} ms"


def _replay(job: ServeJob, result: ServeResult) -> None:
    steps = result.steps
    if not steps:
        return
    st.subheader("Replay")
    last = len(steps) - 1
    if session.get(session.SERVE_REPLAY_FOR) != job.id:  # a new run opens at its last step
        session.put("serve_replay", last)
        session.put(session.SERVE_REPLAY_FOR, job.id)
    # Kept across pages like the builder's widgets (persist.py): the step chosen is still shown on return.
    at = st.slider("Step", 0, last, int(persist.keep("serve_replay", last, bounds=(0, last))), key="serve_replay",
                   help="Scrub over the recorded run: the pool as it stood after that step, a dashed line on the charts")
    persist.remember("serve_replay")
    view = _Places()
    charts(view, steps, job, job.config.block_size, key=f"replay{job.id}_{at}", upto=at)
    s = steps[at]
    st.caption(f"Step {s.step}: {s.prefill_tokens} prefill + {s.decode_tokens} decode tokens of {s.budget} · "
               f"running {', '.join(s.running) or 'none'} · waiting {len(s.waiting)} · "
               f"{s.blocks_used} blocks used, {s.blocks_cached} cached, {s.blocks_free} free",
               )



def comparison(job: ServeJob) -> None:
    """The same workload under the policies that ran, side by side."""
    sums = {p: sd.summarize(r.steps, r.requests) for p, r in job.results.items()}
    if not sums:
        return
    show(st, scmp.policy_comparison(sums), key=f"serve_cmp_{job.id}")
    rows = []
    for p, s in sums.items():
        rows.append({"policy": scmp.POLICY_NAMES.get(p, p), "tokens/s": _round(s.throughput_tok_s),
                     "TTFT p50 ms": _round(s.ttft_ms[0]), "TTFT p90 ms": _round(s.ttft_ms[1]),
                     "TTFT p99 ms": _round(s.ttft_ms[2]), "TPOT p50 ms": _round(s.tpot_ms[0]),
                     "TPOT p90 ms": _round(s.tpot_ms[1]), "TPOT p99 ms": _round(s.tpot_ms[2]),
                     "steps": s.steps, "preemptions": s.preemptions,
                     "stopped": bool(job.results[p].stopped)})
    st.dataframe(pd.DataFrame(rows), hide_index=True, key="serve_cmp_table")
    cont, seq = sums.get("continuous"), sums.get("sequential")
    if cont and seq and cont.throughput_tok_s and seq.throughput_tok_s:
        st.caption(f"Continuous batching: {cont.throughput_tok_s / seq.throughput_tok_s:.2f}× one-at-a-time's "
                   "aggregate throughput on this workload, measured on this machine.")


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)
