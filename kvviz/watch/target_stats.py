"""The figures of a workload sent to a server, from what the client saw: pure arithmetic over recorded
times, so the tests hold it to hand-computed values.

Each request is timed as vLLM's own benchmark times it (``vllm/benchmarks/lib/endpoint_request_func.py``,
``async_request_openai_completions``, and ``benchmarks/serve.py``'s ``calculate_metrics``):
- TTFT: from just before the POST to the first streamed chunk that carries output;
- TPOT: (last output chunk - first output chunk) / (output tokens - 1), the output tokens being the
  server's ``usage.completion_tokens`` where it sends usage (a chunk may carry several tokens);
- end to end: from just before the POST to the last output chunk.
kvviz's own engine defines the same three from its clock (``engine/serving/records.RequestRecord``:
first token - arrival, (last token - first token) / (n - 1), finish - arrival), so the two columns of
the side-by-side mean the same thing. Percentiles interpolate linearly between order statistics, as
numpy's default (what vLLM's benchmark reports).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamTrace:
    """What the client recorded for one request (seconds on one monotonic clock)."""

    id: str
    sent_s: float  # just before the POST
    chunk_s: list[float] = field(default_factory=list)  # every chunk that carried output text or ids
    output_ids: list[int] | None = None  # None: the server never sent token ids
    output_text: str = ""
    completion_tokens: int | None = None  # the server's usage.completion_tokens
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    finish_reason: str | None = None
    max_tokens: int = 0
    ignore_eos: bool = False

    def output_len(self) -> int:
        """Output tokens: the server's count where it gave one, else the ids, else one per chunk."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        if self.output_ids is not None:
            return len(self.output_ids)
        return len(self.chunk_s)


def _ms(seconds: float) -> float:
    return seconds * 1000.0


def _r(x: float | None) -> float | None:
    """Three decimals, as serve-bench rounds kvviz's own figures (engine/serving/summary.py)."""
    return None if x is None else round(x, 3)


def request_row(t: StreamTrace) -> dict[str, Any]:
    """One request as ``serve-bench --json`` writes it. Preemptions, lost tokens and prefix hits are a
    scheduler's per-request facts that no server's API returns: null (the summary has the totals)."""
    n = t.output_len()
    first = t.chunk_s[0] if t.chunk_s else None
    last = t.chunk_s[-1] if t.chunk_s else None
    return {
        "id": t.id,
        "output_ids": t.output_ids,
        "output_text": t.output_text,
        "ttft_ms": None if first is None else _r(_ms(first - t.sent_s)),
        "tpot_ms": None if first is None or last is None or n < 2 else _r(_ms(last - first) / (n - 1)),
        "e2e_ms": None if last is None else _r(_ms(last - t.sent_s)),
        "preemptions": None,
        "lost_tokens": None,
        "prefix_hit_tokens": None,
        "output_tokens": n,
        "prompt_tokens": t.prompt_tokens,
        "finish_reason": t.finish_reason,
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between order statistics (numpy's default); None if empty."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    rank = (len(xs) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _delta(after: float | None, before: float | None) -> int | None:
    """A counter's growth over the run; None when the server does not count it or it was reset."""
    if after is None or before is None or after < before:
        return None
    return int(round(after - before))


@dataclass(frozen=True)
class ServerCounts:
    """The server's /metrics around the run: counters before and after, gauges polled during it."""

    prefix_queries: tuple[float | None, float | None] = (None, None)  # (before, after), tokens
    prefix_hits: tuple[float | None, float | None] = (None, None)
    preemptions: tuple[float | None, float | None] = (None, None)
    busy_steps: tuple[float | None, float | None] = (None, None)  # vLLM's iteration_tokens_total _count
    peak_running: float | None = None  # the most num_requests_running any poll saw
    peak_usage: float | None = None  # the highest KV usage fraction any poll saw
    final_usage: float | None = None  # the KV usage read after the last request ended
    used_block_total: int | None = None  # what the usage fraction divides by, in blocks (None: unknown)
    polls: int = 0


def _blocks(usage: float | None, total: int | None) -> int | None:
    return None if usage is None or total is None else int(round(usage * total))


NOT_MEASURED = {
    "requests[].preemptions": "a server reports preemptions only as one counter, never per request",
    "requests[].lost_tokens": "no server API says how many computed tokens a preemption threw away",
    "requests[].prefix_hit_tokens": "prefix-cache hits are one counter on /metrics, not per request",
    "summary.steps": "a server's scheduler iterations are not visible to a client "
                     "(vLLM counts its busy ones: summary.server_busy_steps)",
}


def summarize(traces: Sequence[StreamTrace], start_s: float, counts: ServerCounts) -> dict[str, Any]:
    """The ``summary`` object of ``serve-bench --json``, plus what only a server measures
    (``server_busy_steps``, ``peak_kv_usage``). Throughput is every output token over the wall time from
    the run's start to the last request's last output chunk, as vLLM's benchmark divides it."""
    rows = [request_row(t) for t in traces]
    ends = [t.chunk_s[-1] for t in traces if t.chunk_s]
    tokens = sum(t.output_len() for t in traces)
    wall = (max(ends) - start_s) if ends else None
    ttft = [r["ttft_ms"] for r in rows if r["ttft_ms"] is not None]
    tpot = [r["tpot_ms"] for r in rows if r["tpot_ms"] is not None]
    out: dict[str, Any] = {
        "throughput_tok_s": _r(tokens / wall) if wall else None,
        **{f"ttft_ms_p{q}": _r(percentile(ttft, q)) for q in (50, 90, 99)},
        **{f"tpot_ms_p{q}": _r(percentile(tpot, q)) for q in (50, 90, 99)},
        "preemptions": _delta(*reversed(counts.preemptions)),
        "prefix_query_tokens": _delta(*reversed(counts.prefix_queries)),
        "prefix_hit_tokens": _delta(*reversed(counts.prefix_hits)),
        "peak_running": None if counts.peak_running is None else int(counts.peak_running),
        "peak_blocks_used": _blocks(counts.peak_usage, counts.used_block_total),
        "blocks_leaked": _blocks(counts.final_usage, counts.used_block_total),
        "steps": None,
        "output_tokens": tokens,
        "wall_s": _r(wall),
        "stopped": False,  # a run against a server ends with every request, or raises
        "server_busy_steps": _delta(*reversed(counts.busy_steps)),
        "peak_kv_usage": counts.peak_usage,
        "metrics_polls": counts.polls,
    }
    return out
