"""The numbers the serving page and its charts read from a run's records: per-step series, each
request's state at each step, latency percentiles, the run's summary, the per-request table and
the two exports (events as JSON Lines, requests as CSV).

Pure Python and numpy over ``engine/serving/records.py``'s dataclasses; no torch, no plotly, no
streamlit. Nothing here is estimated: every figure is a count or a clock the records carry, or
arithmetic on them.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvviz.engine.serving.records import RequestRecord, StepRecord

# A request's state at one step, as the timeline colours it (NaN: not arrived yet, or done).
WAITING, PREFILL, DECODE, IDLE_RUNNING, PREEMPTED = 0, 1, 2, 3, 4
STATE_NAMES = ("waiting", "prefill chunk", "decode", "running, not scheduled", "preempted (waiting to recompute)")
PERCENTILES = (50, 90, 99)


def request_states(steps: Sequence[StepRecord], request_ids: Sequence[str]) -> np.ndarray:
    """(requests, steps) float32 codes: what each request did at each step (``STATE_NAMES``), NaN
    before it arrived and after it finished. A request preempted stays PREEMPTED while it waits,
    until a step schedules it again (its recompute)."""
    row = {r: i for i, r in enumerate(request_ids)}
    out = np.full((len(request_ids), len(steps)), np.nan, dtype=np.float32)
    lost: set[str] = set()  # preempted and not scheduled since
    for j, s in enumerate(steps):
        done: set[str] = set()
        for sc in s.scheduled:
            if sc.request_id in row:
                out[row[sc.request_id], j] = PREFILL if sc.kind == "prefill" else DECODE
                done.add(sc.request_id)
                lost.discard(sc.request_id)
        for r in s.preempted:
            lost.add(r)
            if r in row:
                out[row[r], j] = PREEMPTED
                done.add(r)
        for r in s.running:
            if r in row and r not in done:
                out[row[r], j] = IDLE_RUNNING
        for r in s.waiting:
            if r in row and r not in done:
                out[row[r], j] = PREEMPTED if r in lost else WAITING
    return out


def finish_points(steps: Sequence[StepRecord]) -> list[tuple[int, str]]:
    """(step, request id) of every request's finish, in step order."""
    return [(s.step, r) for s in steps for r in s.finished]


def series(steps: Sequence[StepRecord], block_size: int) -> dict[str, np.ndarray]:
    """Per-step arrays: the step number, its clock, the tokens it scheduled (prefill, decode), the
    budget, the queues, the pool's blocks by state, KV usage in % of the pool by blocks and by
    tokens written, the last-block waste in tokens, and the cumulative prefix-cache hit rate in %
    (NaN before the first query)."""
    def arr(values: Iterable[float]) -> np.ndarray:
        return np.asarray(list(values), dtype=np.float64)

    total = arr(s.blocks_total for s in steps)
    used = arr(s.blocks_used for s in steps)
    written = arr(s.tokens_in_blocks for s in steps)
    queries = arr(s.prefix_query_tokens for s in steps)
    hits = arr(s.prefix_hit_tokens for s in steps)
    with np.errstate(divide="ignore", invalid="ignore"):
        hit_rate = np.where(queries > 0, 100.0 * hits / np.where(queries > 0, queries, 1), np.nan)
        cap = np.where(total > 0, total * block_size, 1)
        by_blocks = np.where(total > 0, 100.0 * used / np.where(total > 0, total, 1), 0.0)
        by_tokens = np.where(total > 0, 100.0 * written / cap, 0.0)
    return {
        "step": arr(s.step for s in steps),
        "t_ms": arr(s.t_ms for s in steps),
        "prefill": arr(s.prefill_tokens for s in steps),
        "decode": arr(s.decode_tokens for s in steps),
        "budget": arr(s.budget for s in steps),
        "running": arr(len(s.running) for s in steps),
        "waiting": arr(len(s.waiting) for s in steps),
        "preempted": arr(len(s.preempted) for s in steps),
        "blocks_used": used,
        "blocks_cached": arr(s.blocks_cached for s in steps),
        "blocks_free": arr(s.blocks_free for s in steps),
        "usage_blocks_pct": by_blocks,
        "usage_tokens_pct": by_tokens,
        "waste_tokens": used * block_size - written,
        "hit_rate_pct": hit_rate,
    }


def percentiles(values: Iterable[float | None], qs: Sequence[int] = PERCENTILES) -> tuple[float | None, ...]:
    """numpy's linear percentiles (as vLLM's benchmark_serving computes them) of the values that
    exist; all None when none does."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return tuple(None for _ in qs)
    return tuple(float(x) for x in np.percentile(np.asarray(got, dtype=np.float64), list(qs)))


@dataclass(frozen=True)
class RunSummary:
    """One run, in the figures the page, the comparison and the paragraph quote."""
    requests: int
    finished: int
    output_tokens: int
    duration_ms: float  # from the run's start to the end of the step the last request finished in
    throughput_tok_s: float | None  # output tokens / duration
    ttft_ms: tuple[float | None, ...]  # p50, p90, p99
    tpot_ms: tuple[float | None, ...]
    e2e_ms: tuple[float | None, ...]
    preemptions: int
    lost_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    peak_running: int
    peak_blocks_used: int
    steps: int  # scheduler iterations from step 0 through the last finish, idle ones included


def summarize(steps: Sequence[StepRecord], requests: Mapping[str, RequestRecord] | Sequence[RequestRecord]
              ) -> RunSummary:
    reqs = list(requests.values()) if isinstance(requests, Mapping) else list(requests)
    finish_steps = [s for s in steps if s.finished]
    last = finish_steps[-1] if finish_steps else (steps[-1] if steps else None)
    duration = float(last.t_ms) if last is not None else 0.0
    out_tokens = sum(len(r.output_ids) for r in reqs)
    last_step = steps[-1] if steps else None
    return RunSummary(
        requests=len(reqs),
        finished=sum(r.state == "finished" for r in reqs),
        output_tokens=out_tokens,
        duration_ms=duration,
        throughput_tok_s=out_tokens * 1000.0 / duration if duration > 0 else None,
        ttft_ms=percentiles(r.ttft_ms for r in reqs),
        tpot_ms=percentiles(r.tpot_ms for r in reqs),
        e2e_ms=percentiles(r.e2e_ms for r in reqs),
        preemptions=sum(r.preemptions for r in reqs),
        lost_tokens=sum(r.lost_tokens for r in reqs),
        prefix_query_tokens=last_step.prefix_query_tokens if last_step else 0,
        prefix_hit_tokens=last_step.prefix_hit_tokens if last_step else 0,
        peak_running=max((len(s.running) + len(set(s.finished) - set(s.running)) for s in steps), default=0),
        peak_blocks_used=max((s.blocks_used for s in steps), default=0),
        steps=(last.step + 1) if last is not None else 0,
    )


TABLE_COLUMNS = ("id", "state", "arrival", "prompt tokens", "max tokens", "output tokens", "TTFT ms",
                 "TPOT ms", "E2E ms", "preemptions", "lost tokens", "prefix hit tokens", "finish")


def request_rows(requests: Mapping[str, RequestRecord] | Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """The per-request table: one dict per request (``TABLE_COLUMNS``), times in ms to 0.01."""
    def ms(v: float | None) -> float | None:
        return None if v is None else round(float(v), 2)

    reqs = list(requests.values()) if isinstance(requests, Mapping) else list(requests)
    return [{"id": r.request_id, "state": r.state, "arrival": r.arrival, "prompt tokens": r.prompt_len,
             "max tokens": r.max_tokens, "output tokens": len(r.output_ids), "TTFT ms": ms(r.ttft_ms),
             "TPOT ms": ms(r.tpot_ms), "E2E ms": ms(r.e2e_ms), "preemptions": r.preemptions,
             "lost tokens": r.lost_tokens, "prefix hit tokens": r.prefix_hit_tokens,
             "finish": r.finish_reason or ""} for r in reqs]


def requests_csv(requests: Mapping[str, RequestRecord] | Sequence[RequestRecord]) -> str:
    """The per-request table as CSV (an empty cell for a time that does not exist)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(TABLE_COLUMNS), lineterminator="\n")
    w.writeheader()
    for row in request_rows(requests):
        w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buf.getvalue()


def events_jsonl(steps: Sequence[StepRecord], requests: Mapping[str, RequestRecord] | Sequence[RequestRecord]
                 ) -> str:
    """The run's events, one JSON object a line: every step (``"event": "step"``, the StepRecord's
    fields), then every request (``"event": "request"``, the RequestRecord's fields and its TTFT,
    TPOT and E2E)."""
    reqs = list(requests.values()) if isinstance(requests, Mapping) else list(requests)
    lines = [json.dumps({"event": "step", **dataclasses.asdict(s)}) for s in steps]
    for r in reqs:
        lines.append(json.dumps({"event": "request", **dataclasses.asdict(r), "ttft_ms": r.ttft_ms,
                                 "tpot_ms": r.tpot_ms, "e2e_ms": r.e2e_ms}))
    return "\n".join(lines) + ("\n" if lines else "")
