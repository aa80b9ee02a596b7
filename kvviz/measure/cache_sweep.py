"""Cache vs no cache over N new tokens: the seeds' claims put to a measured test.

The seeds say a KV cache speeds generation 2-5x at 10-20 tokens, 10-20x at 50-100 and 20-50x
at 200+. Whether that holds depends on the model and the machine: without a cache step t
recomputes all prompt + t positions, so the ratio grows with N only once recomputation is
compute-bound (the quadratic regime). ``python -m kvviz bench --cache-sweep 16,64,256`` times
both on one model, side by side: the modes alternate inside each repeat (sweeps.sweep_total_time),
and each ratio is of the medians.
"""
from __future__ import annotations

from statistics import median
from typing import Any, Sequence

from kvviz.engine.loading.loader import LoadedModel
from kvviz.errors import KVVizError
from kvviz.limits import MAX_SWEEP_POINTS, MAX_TOKENS
from kvviz.measure.sweeps import request_from_text, sweep_total_time

# The seeds' claimed speedups, by the range of N they name (inclusive).
CLAIMS: tuple[tuple[int, int, float, float], ...] = ((10, 20, 2.0, 5.0), (50, 100, 10.0, 20.0), (200, 10**9, 20.0, 50.0))


def parse_ns(text: str) -> list[int]:
    """'16,64,256' -> [16, 64, 256]; a clear message for anything else."""
    try:
        ns = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise KVVizError(f"--cache-sweep takes comma-separated token counts like 16,64,256 (got {text!r})") from None
    if not ns or ns[0] < 1:
        raise KVVizError(f"--cache-sweep needs token counts of at least 1 (got {text!r})")
    if ns[-1] > MAX_TOKENS or len(ns) > MAX_SWEEP_POINTS:  # before a model loads, like every other count
        raise KVVizError(f"--cache-sweep takes at most {MAX_SWEEP_POINTS} counts of at most {MAX_TOKENS:,} tokens "
                         f"(got {len(ns)}, the largest {ns[-1]:,})")
    return ns


def claim_for(n: int) -> tuple[float, float] | None:
    return next(((lo, hi) for a, b, lo, hi in CLAIMS if a <= n <= b), None)


def cache_sweep(model: LoadedModel, prompt: str, ns: Sequence[int], repeats: int) -> dict[str, Any]:
    """Total time of static-cache and no-cache generation at each N; the ratio of the medians."""
    if max(ns) + len(model.tokenizer.encode(prompt)) > model.config.block_size:
        raise KVVizError(f"--cache-sweep: {max(ns)} new tokens do not fit the {model.config.block_size}-token context")
    req = request_from_text(model, prompt, max(ns))  # greedy
    times: dict[tuple[str, int], list[float]] = {}
    made: dict[int, int] = {}
    for s in sweep_total_time(model, req, ns, repeats=repeats, modes=("static", "none")):
        times.setdefault((s.series, int(s.x)), []).append(s.metrics["total_ms"])
        made[int(s.x)] = int(s.metrics["tokens"])  # fewer than asked when the model emitted its end token
    rows = []
    for n in ns:
        cached, uncached = median(times[("static", n)]), median(times[("none", n)])
        claim = claim_for(n)
        rows.append({"new_tokens": n, "generated": made[n], "cached_ms": round(cached, 1), "uncached_ms": round(uncached, 1),
                     "speedup": round(uncached / cached, 2), "seed_claim": list(claim) if claim else None,
                     "cached_runs_ms": [round(t, 1) for t in times[("static", n)]],
                     "uncached_runs_ms": [round(t, 1) for t in times[("none", n)]]})
    return {"model": model.name, "engine": "fast" if model.fast is not None else "readable",
            "prompt_tokens": req.prompt_len, "repeats": repeats, "rows": rows}


def format_sweep(res: dict[str, Any]) -> str:
    lines = [f"cache vs no cache on {res['model']} ({res['engine']} engine), prompt {res['prompt_tokens']} tokens, "
             f"greedy, median of {res['repeats']} alternating runs", "",
             f"{'new':>5}  {'cached ms':>10}  {'no cache ms':>12}  {'speedup':>8}  seeds' claim"]
    for r in res["rows"]:
        claim = r["seed_claim"]
        verdict = "-" if claim is None else (f"{claim[0]:g}-{claim[1]:g}x: "
                                             + ("within" if claim[0] <= r["speedup"] <= claim[1]
                                                else "below" if r["speedup"] < claim[0] else "above"))
        short = "" if r["generated"] == r["new_tokens"] else f"  (stopped at {r['generated']}: end token)"
        lines.append(f"{r['new_tokens']:>5}  {r['cached_ms']:>10.1f}  {r['uncached_ms']:>12.1f}  "
                     f"{r['speedup']:>7.2f}x  {verdict}{short}")
    return "\n".join(lines)
