"""A serving run's figures: per-request latencies and the summary the CLI's ``--json`` prints.

TTFT: arrival to first token; TPOT: the mean gap between a request's tokens after its first (vLLM's
time per output token); e2e: arrival to the last token. Percentiles interpolate linearly between
order statistics (numpy's default). Throughput: generated tokens over the run's wall time from its
start to the end of the step in which the last request finished.
"""
from __future__ import annotations

import json
import math
from typing import Any

from kvviz.engine.serving.engine import ServeResult


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics; None without values."""
    if not values:
        return None
    xs = sorted(values)
    at = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(at), math.ceil(at)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def last_step(res: ServeResult) -> int | None:
    done = [r.finished_step for r in res.requests if r.finished_step is not None]
    return max(done) if done else None


def summary(res: ServeResult) -> dict[str, Any]:
    reqs = res.requests
    end = last_step(res)
    wall_ms = res.steps[end].t_ms if end is not None else (res.steps[-1].t_ms if res.steps else 0.0)
    tokens = sum(len(r.output_ids) for r in reqs)
    ttft = [r.ttft_ms for r in reqs if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in reqs if r.tpot_ms is not None]
    out: dict[str, Any] = {
        "throughput_tok_s": _r(tokens / (wall_ms / 1000.0)) if wall_ms > 0 else None,
        "output_tokens": tokens,
        "wall_s": _r(wall_ms / 1000.0),
    }
    for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = _r(percentile(xs, q))  # type: ignore[arg-type]
    last = res.steps[-1] if res.steps else None
    out.update({
        "preemptions": len(res.preemptions),
        "prefix_query_tokens": last.prefix_query_tokens if last else 0,
        "prefix_hit_tokens": last.prefix_hit_tokens if last else 0,
        "peak_running": max((len(s.running) + len(s.finished) for s in res.steps), default=0),
        "peak_blocks_used": max((s.blocks_used for s in res.steps), default=0),
        "blocks_leaked": res.blocks_leaked,
        "steps": end + 1 if end is not None else len(res.steps),
        "stopped": res.stopped,
    })
    return out


def request_rows(res: ServeResult) -> list[dict[str, Any]]:
    return [{"id": r.request_id, "output_ids": list(r.output_ids), "output_text": r.output_text,
             "ttft_ms": _r(r.ttft_ms), "tpot_ms": _r(r.tpot_ms), "e2e_ms": _r(r.e2e_ms), "preemptions": r.preemptions,
             "lost_tokens": r.lost_tokens, "prefix_hit_tokens": r.prefix_hit_tokens, "finish_reason": r.finish_reason}
            for r in res.requests]


def events_jsonl(res: ServeResult) -> str:
    """Every step's record, one JSON object a line (the replay reads them), then each preemption."""
    lines = []
    for s in res.steps:
        lines.append(json.dumps({
            "event": "step", "step": s.step, "t_ms": round(s.t_ms, 3), "forward_ms": round(s.forward_ms, 3),
            "scheduled": [{"id": x.request_id, "kind": x.kind, "start": x.start, "num_tokens": x.num_tokens,
                           "prefix_hit_tokens": x.prefix_hit_tokens} for x in s.scheduled],
            "budget": s.budget, "running": list(s.running), "waiting": list(s.waiting), "finished": list(s.finished),
            "preempted": list(s.preempted), "blocks_total": s.blocks_total, "blocks_used": s.blocks_used,
            "blocks_cached": s.blocks_cached, "blocks_free": s.blocks_free, "tokens_in_blocks": s.tokens_in_blocks,
            "prefix_query_tokens": s.prefix_query_tokens, "prefix_hit_tokens": s.prefix_hit_tokens,
            "new_tokens": s.new_tokens}))
    for p in res.preemptions:
        lines.append(json.dumps({"event": "preemption", "step": p.step, "id": p.request_id,
                                 "lost_tokens": p.lost_tokens, "recomputed_at": p.recomputed_at}))
    return "\n".join(lines) + "\n"
