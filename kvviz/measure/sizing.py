"""Defaults sized to this machine: what a measurement will cost here, before it runs.

Every timing page's default must finish in about a minute wherever it runs (a busy 2-core laptop
or a GPU), so the defaults are not constants: ``calibrate`` times the model itself once (a short
prefill and a few decode steps, on the engine the page uses), and the analytic FLOPs of
``engine/generation/flops.py`` scale that to other lengths. The ``*_s`` functions estimate a measurement's
seconds; the ``pick_*`` functions choose the largest settings whose estimate fits the budget.

The estimates plan, they are not results: no page shows them as measurements, only as "about N s
here" next to a button. They lean long on purpose (``MARGIN``), because an overrun costs the user a
wait and an underrun only a smaller default.

The calibration is timed once per session, but other work comes and goes: a page calibrated on a
quiet machine promised "about 55 s" and took 77 s once other processes kept six cores busy. So an
``Estimator`` also takes the CPU contention now against the contention the calibration ran under
(``contention``: runnable threads per core, the load average over the cores), scales every
estimate by it, and says so (``Estimator.here``); the ``pick_*`` functions then choose smaller
defaults on a busy machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any, Callable, Sequence

from kvviz.engine.generation.flops import forward_flops, weight_bytes
from kvviz.engine.loading.loader import LoadedModel
from kvviz.measure.sweeps import Request, backend_name, document_ids, prompt_lengths, run_once, warmup
from kvviz.units import kv_bytes_per_token

BUDGET_S = 60.0  # a default measurement finishes within this, on the machine that runs it
# Defaults are chosen to an estimate of at most this: on a 2-core machine at load 8 a measurement
# took up to 1.25x its estimate (the calibration is one short run, and the page's own drawing
# competes too), and the default must still finish within BUDGET_S.
PICK_S = BUDGET_S / 1.3
MARGIN = 1.3  # estimates are multiplied by this: a busy machine drifts, and an overrun costs a wait
CAL_PROMPT = 64  # tokens of the calibration prefill
CAL_NEW = 6  # decode steps of the calibration run (their median is the step time)
# A decode step reads the weights and the cache. On a small CPU its time grew about four times
# faster with the context than the cache's bytes alone predict (attention reads K/V in short rows),
# so the cache's share of a step counts KV_WEIGHT times.
KV_WEIGHT = 4.0


@dataclass(frozen=True)
class Calibration:
    """One model on this machine: a prefill of ``prompt`` tokens and a short-context decode step."""

    prefill_ms: float  # the prefill of ``prompt`` tokens
    decode_ms: float  # the median decode step right after it
    prompt: int
    weight_bytes: int  # what a decode step reads besides the cache
    kv_bytes_per_token: int  # batch 1, the model's dtype
    contention: float = 1.0  # ``contention(...)`` when it was timed: 1 on a machine with a core per thread

    @property
    def prefill_ms_per_token(self) -> float:
        return self.prefill_ms / self.prompt


def calibrate(model: LoadedModel, fast: bool = True) -> Calibration:
    """Time one short run of ``model`` (after a warm-up): about a second for SmolLM2 on 2 cores."""
    c = model.config
    n = max(1, min(CAL_PROMPT, c.block_size - CAL_NEW - 1))
    warmup(model, ("static",))
    run = run_once(model, Request(prompt_ids=(document_ids(model, n),), max_new_tokens=CAL_NEW,
                                  backend=backend_name(fast)), "static")
    dec = [e.latency_ms for e in run.events[1:]] or [run.events[0].latency_ms]
    return Calibration(run.events[0].latency_ms, float(median(dec)), n, weight_bytes(c, model.dtype.itemsize),
                       int(kv_bytes_per_token(c.n_layer, c.kv_heads, c.head_dim, model.dtype.itemsize)))


def contention(load: float | None, cores: int) -> float:
    """How much slower a forward runs than on a machine with a free core per thread: the runnable
    threads per core (the load average over the cores), at least 1. The kernel shares the cores
    fairly, so at a load of 8 on 2 cores each runnable thread gets a quarter of one. Not the busy
    cores of ``cpu_load``: other processes can keep at most all the cores busy, however many wait.
    ``load`` None (no load average here) counts as a quiet machine."""
    return max(1.0, (load or 0.0) / max(1, cores))


class Estimator:
    """Seconds of each measurement for one model's shape and one calibration.

    ``contention``: the machine's now (``contention(...)``); every estimate is scaled by it over the
    calibration's, never below 1 (a calibration timed on a busy machine only leans long).
    ``load``: the load average that contention came from, for the sentence that says so.
    """

    def __init__(self, cal: Calibration, config: object, contention: float = 1.0, load: float | None = None) -> None:
        self.cal, self.cfg = cal, config
        self.slowdown = max(1.0, contention / max(1.0, cal.contention))
        self.load = load

    # --- single forwards (milliseconds) ---
    def prefill_ms(self, tokens: int, batch: int = 1) -> float:
        """A forward over ``tokens`` (times ``batch`` rows). Up to the calibrated prompt, a fixed cost
        plus one per row: a straight line from the decode step (one row) to the calibrated prefill,
        since a short forward still streams every weight once (scaling by FLOPs alone made Gemma 3's
        race, whose no-cache steps are forwards of 5-34 tokens, take 1.35x its estimate). Beyond it,
        the calibrated prefill scaled by FLOPs (attention grows faster), never below its rate."""
        c = self.cal
        cfg: Any = self.cfg
        rows = batch * tokens
        if rows <= c.prompt:
            ms = c.decode_ms + (c.prefill_ms - c.decode_ms) * (rows - 1) / max(1, c.prompt - 1)
        else:
            ms = c.prefill_ms * max(forward_flops(cfg, tokens, 0, 1, batch) / forward_flops(cfg, c.prompt, 0),
                                    rows / c.prompt)
        return self.slowdown * ms

    def decode_ms(self, context: int, batch: int = 1) -> float:
        """One decode step at ``context`` tokens; each extra batch row costs a prefill token."""
        c = self.cal
        grow = 1.0 + KV_WEIGHT * c.kv_bytes_per_token * max(0, context - c.prompt) / max(1, c.weight_bytes)
        return self.slowdown * (c.decode_ms * grow + (batch - 1) * c.prefill_ms_per_token)

    def run_ms(self, prompt: int, n_new: int, mode: str = "static", batch: int = 1) -> float:
        """One generation of ``n_new`` tokens after ``prompt``: cached, or recomputing every step."""
        if mode == "none":
            return sum(self.prefill_ms(prompt + t) for t in range(n_new))
        steps = sum(self.decode_ms(prompt + t, batch) for t in range(1, n_new))
        return self.prefill_ms(prompt, batch) + steps * (1.2 if mode == "concat" else 1.0)

    def race_fraction(self, prompt: int, n_new: int, mode: str, made: int,
                      modes: Sequence[str] = ("static", "concat", "none")) -> float:
        """How much of a race (modes run in order) is done once ``mode`` has made ``made`` tokens,
        by estimated time: the no-cache mode's tokens cost more and more, so counting tokens would lie."""
        total = sum(self.run_ms(prompt, n_new, m) for m in modes)
        before = sum(self.run_ms(prompt, n_new, m) for m in modes[: list(modes).index(mode)])
        return min(1.0, (before + self.run_ms(prompt, made, mode)) / total) if total > 0 else 0.0

    def here(self, seconds: float) -> str:
        """An estimate as a page shows it: "about 40 s here", and when other work slows this machine
        down, by how much the calibration was scaled for it."""
        text = f"{about(seconds)} here"
        if self.slowdown > 1.0:
            load = f" (load average {self.load:.1f})" if self.load is not None else ""
            text += (f", scaled ×{self.slowdown:.1f} because the machine is busier now{load} than when this page "
                     "timed the model: the model gets a smaller share of the cores")
        return text

    # --- whole measurements (seconds, with the margin) ---
    def race_s(self, prompt: int, n_new: int, modes: Sequence[str] = ("static", "concat", "none")) -> float:
        return MARGIN * sum(self.run_ms(prompt, n_new, m) for m in modes) / 1000.0

    def total_time_sweep_s(self, prompt: int, ns: Sequence[int], repeats: int,
                           modes: Sequence[str] = ("static", "none")) -> float:
        return MARGIN * repeats * sum(self.run_ms(prompt, n, m) for n in ns for m in modes) / 1000.0

    def prefill_decode_s(self, context: int, repeats: int, prompt: int = 16) -> float:
        ttft = sum(self.prefill_ms(n) for n in prompt_lengths(context))
        decode = self.prefill_ms(prompt) + sum(self.decode_ms(t) for t in range(prompt + 1, context))
        return MARGIN * repeats * (ttft + decode) / 1000.0

    def example_s(self, short: int, long: int, n_new: int, repeats: int) -> float:
        return MARGIN * repeats * (self.run_ms(short, n_new) + self.run_ms(long, n_new)) / 1000.0

    def batch_s(self, sizes: Sequence[int], prompt: int, n_new: int, repeats: int) -> float:
        return MARGIN * repeats * sum(self.run_ms(prompt, n_new, "static", b) for b in sizes) / 1000.0

    def spec_s(self, prompt: int, n_new: int, repeats: int) -> float:
        """Plain and speculative, each ``repeats`` timed runs after a warm-up (speculation counted as plain)."""
        return MARGIN * 2 * (repeats + 1) * self.run_ms(prompt, n_new) / 1000.0


# --- choosing defaults --------------------------------------------------------------------------

def pick_context(est: Estimator, options: Sequence[int], budget_s: float = PICK_S) -> tuple[int, int]:
    """(context, repeats) for the prefill/decode sweeps: the longest context that fits with 3
    repeats, else with 2; the shortest with 1 when nothing does."""
    for ctx in sorted(options, reverse=True):
        for repeats in (3, 2):
            if est.prefill_decode_s(ctx, repeats) <= budget_s:
                return ctx, repeats
    return min(options), 1


def pick_ns(est: Estimator, prompt: int, ns: Sequence[int], budget_s: float = PICK_S,
            min_points: int = 4) -> tuple[list[int], int]:
    """(Ns, repeats) for the total-time sweep: the most of the smallest Ns (at least ``min_points``
    for the slope fit) at 3 repeats, else 2, else 1."""
    ns = sorted(ns)
    for repeats in (3, 2, 1):
        best = [n for k, n in enumerate(ns) if est.total_time_sweep_s(prompt, ns[: k + 1], repeats) <= budget_s]
        if len(best) >= min(min_points, len(ns)):
            return best, repeats
    # A slow machine: the Ns that fit once each, at least two (a slope needs two points).
    best = [n for k, n in enumerate(ns) if est.total_time_sweep_s(prompt, ns[: k + 1], 1) <= budget_s]
    return (best if len(best) >= 2 else ns[:2]), 1


def pick_batch(est: Estimator, sizes: Sequence[int], prompt: int, n_new: int,
               budget_s: float = PICK_S) -> tuple[list[int], int]:
    """(batch sizes, repeats): every size at 3 repeats if it fits, else fewer repeats, else fewer sizes."""
    sizes = sorted(sizes)
    for repeats in (3, 2, 1):
        if est.batch_s(sizes, prompt, n_new, repeats) <= budget_s:
            return sizes, repeats
    kept = [b for k, b in enumerate(sizes) if est.batch_s(sizes[: k + 1], prompt, n_new, 1) <= budget_s]
    return kept or sizes[:1], 1


def pick_repeats(seconds: Callable[[int], float], budget_s: float = PICK_S, most: int = 3) -> int:
    """The most repeats, up to ``most``, whose measurement (``seconds(repeats)``) fits; 1 when none does."""
    return next((r for r in range(most, 0, -1) if seconds(r) <= budget_s), 1)


def pick_tokens(seconds: Callable[[int], float], asked: int, budget_s: float = PICK_S, least: int = 16) -> int:
    """New tokens for a measurement whose cost grows with them (``seconds(n)``): ``asked`` when it
    fits the budget, else the most that do, never under ``least`` (a shorter run shows too little)
    unless fewer were asked."""
    if seconds(asked) <= budget_s:
        return asked
    lo, hi = min(asked, least), asked  # seconds grows with n: the largest n that fits, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if seconds(mid) <= budget_s else (lo, mid - 1)
    return lo


def pick_race_tokens(est: Estimator, prompt: int, asked: int, budget_s: float = PICK_S, least: int = 16) -> int:
    """New tokens per mode for the race: ``pick_tokens`` over its three modes (the no-cache mode's
    steps grow with every token)."""
    return pick_tokens(lambda n: est.race_s(prompt, n), asked, budget_s, least)


def about(seconds: float) -> str:
    """An estimate in words: "about 40 s", "about 3 min"."""
    if seconds < 90:
        return f"about {max(1, round(seconds / 5) * 5 if seconds >= 10 else round(seconds)):.0f} s"
    return f"about {seconds / 60:.0f} min"
