"""Pure analysis of measurements: spreads, aggregation, log-log slopes, roofline labels, prose.

No torch and no streamlit: the harness (``kvviz.measure.sweeps``) produces ``Sample``s and a
``MachineProbe``; this module and ``kvviz.charts.perf`` turn them into tables, fits and words.
Everything here is deterministic arithmetic, so it is tested against hand-computed values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np

from kvviz.measure import doubts
from kvviz.units import fmt_bytes

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from kvviz.engine.generation.events import Run

MODES = ("static", "concat", "none")  # race order: the two caches, then recomputation
MODE_LABELS = {"static": "KV cache (static)", "concat": "KV cache (concat)", "none": "no cache"}


@dataclass(frozen=True)
class Sample:
    """One measured point of a sweep, tagged with where it was measured."""

    sweep: str  # "total_time" | "ttft" | "decode" | "short_long" | "batch"
    series: str  # the curve it belongs to: a cache mode, "same prompt", "short question", ...
    x: float  # the swept variable: new tokens, prompt length, context length, batch size
    repeat: int  # 0-based repeat index
    metrics: Mapping[str, float] = field(default_factory=dict)  # e.g. {"total_ms": 12.3}
    device: str = ""
    dtype: str = ""
    done: int = 0  # samples measured so far in this sweep (progress bar)
    total: int = 0  # samples planned for this sweep


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float  # min over repeats
    hi: float  # max over repeats
    n: int


@dataclass(frozen=True)
class Fit:
    """log10(y) = slope * log10(x) + intercept, fitted on the large-x points only."""

    slope: float
    intercept: float
    x_min: float  # the fitted range (the line is drawn only there)
    x_max: float
    n_points: int

    def predict(self, x: Sequence[float] | np.ndarray) -> np.ndarray:
        return 10.0 ** (self.slope * np.log10(np.asarray(x, dtype=np.float64)) + self.intercept)


@dataclass(frozen=True)
class MachineProbe:
    """Peak matmul FLOP/s and memory bandwidth of this machine, measured in a short probe."""

    device: str
    dtype: str
    peak_flops: float  # FLOP/s, best of several n x n matmuls
    bandwidth: float  # bytes/s, best of a large copy (read + write) and a large sum (read)
    matmul_n: int  # side of the square matmul
    copy_bytes: int  # size of the copied tensor
    seconds: float  # wall time the probe took

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the roof turns from sloped (memory) to flat (compute)."""
        return self.peak_flops / self.bandwidth

    def roof(self, intensity: float) -> float:
        """Attainable FLOP/s at this arithmetic intensity: min(peak, intensity x bandwidth)."""
        return min(self.peak_flops, intensity * self.bandwidth)

    def describe_sizes(self) -> str:
        """What the probe timed: the matmul and the copy its two figures come from."""
        return f"an n={self.matmul_n} matmul and a {fmt_bytes(self.copy_bytes)} copy"

    def describe(self) -> str:
        return (f"{self.device} · {self.dtype}: peak matmul {self.peak_flops / 1e9:,.1f} GFLOP/s, "
                f"memory bandwidth {self.bandwidth / 1e9:,.1f} GB/s, ridge {self.ridge:,.1f} FLOP/byte")


# --- spreads and tables --------------------------------------------------------------------

def spread(values: Iterable[float]) -> Spread:
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return Spread(float("nan"), float("nan"), float("nan"), 0)
    return Spread(float(np.median(a)), float(a.min()), float(a.max()), int(a.size))


def samples_frame(samples: Iterable[Sample]) -> "pd.DataFrame":
    """One row per sample: sweep, series, x, repeat, device, dtype, then one column per metric."""
    import pandas as pd

    rows = [{"sweep": s.sweep, "series": s.series, "x": s.x, "repeat": s.repeat, "device": s.device,
             "dtype": s.dtype, **dict(s.metrics)} for s in samples]
    return pd.DataFrame(rows)


def aggregate(samples: Iterable[Sample], metric: str, bin_width: float | None = None) -> "pd.DataFrame":
    """Median and min-max of ``metric`` over repeats, per (series, x): columns series, x, median,
    min, max, n (samples behind the row).

    With ``bin_width`` (a per-step curve: hundreds of contexts), each x is first summarised over
    its repeats, then the x values are grouped in bins of that width (labelled by the bin centre)
    and each column is the median over the bin: the typical median and the typical min-max
    spread over repeats. (A plain min-max over a whole bin would only report its rarest spike.)
    """
    import pandas as pd

    cols = ["series", "x", "median", "min", "max", "n"]
    rows = [(s.series, float(s.x), float(s.metrics[metric])) for s in samples if metric in s.metrics]
    if not rows:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(rows, columns=["series", "x", "v"])
    g = df.groupby(["series", "x"], sort=True)["v"]
    out = pd.DataFrame({"median": g.median(), "min": g.min(), "max": g.max(), "n": g.size()}).reset_index()
    if bin_width:
        out["x"] = np.floor(out["x"] / bin_width) * bin_width + bin_width / 2.0
        b = out.groupby(["series", "x"], sort=True)
        out = b[["median", "min", "max"]].median().join(b["n"].sum()).reset_index()
    return out[cols]


def roofline_points(samples: Iterable[Sample], bin_width: float | None = None) -> "pd.DataFrame":
    """Achieved FLOP/s (median, min, max) and the analytic intensity per x, for the roofline."""
    samples = list(samples)
    perf = aggregate(samples, "flops_per_s", bin_width)
    inten = aggregate(samples, "intensity", bin_width)
    perf["intensity"] = inten["median"].to_numpy()  # same (series, x) keys, same order
    return perf


def rolling_median(values: Sequence[float], window: int = 9) -> np.ndarray:
    """Centred running median (shrinking at the ends): a trend line robust to scheduler spikes."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0 or window <= 1:
        return a.copy()
    h = window // 2
    return np.array([np.median(a[max(0, i - h): i + h + 1]) for i in range(a.size)])


# --- fits -----------------------------------------------------------------------------------

def loglog_slope(x: Sequence[float], y: Sequence[float], large_fraction: float = 0.5,
                 min_points: int = 2) -> Fit | None:
    """Slope of log y vs log x over the largest-x points (the asymptotic regime).

    At small N fixed costs (launches, the prefill) flatten every curve, so the fit keeps the
    top ``large_fraction`` of distinct x values (at least ``min_points``). None if too few.
    """
    xa, ya = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = (xa > 0) & (ya > 0) & np.isfinite(xa) & np.isfinite(ya)
    xa, ya = xa[ok], ya[ok]
    xs = np.unique(xa)
    if xs.size < min_points:
        return None
    keep_n = max(min_points, int(np.ceil(xs.size * large_fraction)))
    cut = xs[-keep_n]
    sel = xa >= cut
    slope, intercept = np.polyfit(np.log10(xa[sel]), np.log10(ya[sel]), 1)
    return Fit(float(slope), float(intercept), float(xa[sel].min()), float(xa[sel].max()), int(sel.sum()))


def fits_by_series(agg: "pd.DataFrame", large_fraction: float = 0.5) -> dict[str, Fit]:
    """A log-log fit of the medians of each series of an ``aggregate`` table."""
    out: dict[str, Fit] = {}
    for series, g in agg.groupby("series", sort=False):
        fit = loglog_slope(g["x"].to_numpy(), g["median"].to_numpy(), large_fraction)
        if fit is not None:
            out[str(series)] = fit
    return out


def speedup_table(agg: "pd.DataFrame", slow: str = "none", fast: str = "static") -> "pd.DataFrame":
    """Per x: median total time of both modes and the speedup, with its range from the spreads.

    The range pairs the extremes (slow min / fast max .. slow max / fast min), so it bounds
    every speedup the repeats could have produced.
    """
    import pandas as pd

    a = agg[agg["series"] == slow].set_index("x")
    b = agg[agg["series"] == fast].set_index("x")
    xs = sorted(set(a.index) & set(b.index))
    rows = []
    for x in xs:
        rows.append({
            "new tokens": int(x),
            f"{MODE_LABELS.get(fast, fast)} (ms)": round(float(b.at[x, "median"]), 1),
            f"{MODE_LABELS.get(slow, slow)} (ms)": round(float(a.at[x, "median"]), 1),
            "speedup": round(float(a.at[x, "median"] / b.at[x, "median"]), 2),
            "speedup range": f"{a.at[x, 'min'] / b.at[x, 'max']:.2f}–{a.at[x, 'max'] / b.at[x, 'min']:.2f}",
            "repeats": int(min(a.at[x, "n"], b.at[x, "n"])),
        })
    return pd.DataFrame(rows)


# --- roofline -------------------------------------------------------------------------------

def bound_label(intensity: float, probe: MachineProbe) -> str:
    """The roofline model's verdict: below the ridge, bandwidth limits; above it, compute."""
    return "compute-bound" if intensity >= probe.ridge else "memory-bound"


def roof_fraction(intensity: float, achieved_flops: float, probe: MachineProbe) -> float:
    """Achieved FLOP/s as a fraction of the roof at that intensity (1.0 = on the roof)."""
    roof = probe.roof(intensity)
    return achieved_flops / roof if roof > 0 else float("nan")


def phase_verdict(phase: str, intensity: float, achieved_flops: float, probe: MachineProbe, at: str = "",
                  doubtful: bool = False) -> str:
    """One sentence: the bound, where the ridge is, and how close the measurement came to its roof.

    ``at`` says where the phase was measured ("at a 1,023-token prompt"). ``doubtful``: the page
    found its timings contradicting their expected shape (``kvviz.measure.doubts``), so the
    distance to the roof gets no cause.
    """
    label = bound_label(intensity, probe)
    frac = roof_fraction(intensity, achieved_flops, probe)
    side = "above" if label == "compute-bound" else "below"
    roof = "compute roof" if label == "compute-bound" else "bandwidth roof"
    where = f" {at}" if at else ""
    s = (f"{phase.capitalize()}{where}: **{label}**. {intensity:,.1f} FLOP/byte is {side} this machine's ridge "
         f"({probe.ridge:,.1f} FLOP/byte); measured {achieved_flops / 1e9:,.2f} GFLOP/s = {frac:.0%} of the {roof}.")
    if doubtful and (frac < 0.1 or frac > 1.05):
        s += " These timings are in doubt (see above), so the distance to the roof gets no explanation here."
    elif frac < 0.1:
        s += " So far below the roof, fixed per-step overhead (Python, kernel launches) dominates."
    elif frac > 1.05:
        s += (" Above the probed roof: the probe itself was slowed (by another process, say), so its peak is "
              "a lower bound; probe again when the machine is quiet.")
    return s


# --- the race in words ----------------------------------------------------------------------

def per_step_ratios(cached: "Run", uncached: "Run") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, measured speedup, FLOP ratio) of uncached over cached, step by step."""
    n = min(len(cached.events), len(uncached.events))
    steps = np.arange(n)
    lat_c = np.array([e.latency_ms for e in cached.events[:n]], dtype=np.float64)
    lat_u = np.array([e.latency_ms for e in uncached.events[:n]], dtype=np.float64)
    fl_c = np.array([e.flops for e in cached.events[:n]], dtype=np.float64)
    fl_u = np.array([e.flops for e in uncached.events[:n]], dtype=np.float64)
    return steps, lat_u / np.maximum(lat_c, 1e-9), fl_u / np.maximum(fl_c, 1.0)


def race_doubts(cached: "Run", uncached: "Run", busy: str | None = None) -> list[str]:
    """What in the race's own timings contradicts a steady measurement (see kvviz.measure.doubts)."""
    steps, speed, ratio = per_step_ratios(cached, uncached)
    found = [doubts.step_spread([e.latency_ms for e in cached.events[1:]], "the cached decode steps"),
             doubts.busy(busy)]
    if steps.size >= 3:
        tail = slice(max(1, steps.size - max(3, steps.size // 10)), steps.size)
        sp, fr = float(np.median(speed[tail])), float(np.median(ratio[tail]))
        if sp < 1.0 < fr:
            found.append(f"The shape is wrong: near the end a no-cache step, {fr:,.0f}× the FLOPs of a cached one, "
                         f"took less time ({sp:.2f}×).")
    return [f for f in found if f]


def race_explanation(cached: "Run", uncached: "Run", weight_bytes: int,
                     probe: MachineProbe | None = None, busy: str | None = None) -> str:
    """One paragraph, with this run's numbers, on why measured speedup != FLOP ratio.

    ``busy``: ``cpu_load.busy_during``'s clause for the race, if other work competed. When the
    race's timings contradict a steady measurement the paragraph says what it observed and gives
    no cause (a cached step slowed by another process is not "fixed overhead").
    """
    steps, speed, ratio = per_step_ratios(cached, uncached)
    if steps.size < 3:
        return "Run at least a few tokens to compare the measured speedup with the FLOP ratio."
    k = int(steps[-1])
    tail = slice(max(1, steps.size - max(3, steps.size // 10)), steps.size)  # last ~10% of steps
    sp, fr = float(np.median(speed[tail])), float(np.median(ratio[tail]))
    dec = [e.latency_ms for e in cached.events[1:]]
    dec_ms = float(np.median(dec)) if dec else float("nan")
    dec_flops = cached.events[-1].flops
    where = f"{cached.device} · {cached.dtype}"
    parts = [
        f"Near the end (step {k}) the no-cache pass does about {fr:,.0f}× the FLOPs of a cached step, "
        f"yet it takes only about {sp:,.1f}× as long on this machine ({where}). "
    ]
    found = race_doubts(cached, uncached, busy)
    if found:
        return parts[0] + doubts.verdict(found)
    if probe is not None:
        t_compute_us = dec_flops / probe.peak_flops * 1e6
        t_weights_us = weight_bytes / probe.bandwidth * 1e6
        # The weights in MiB and, beside them, MB: the bandwidth is GB/s as spec sheets give it, so the
        # division reads in one unit. Both figures are the session's probe, the roofline's on Prefill vs decode.
        parts.append(
            f"A cached decode step takes {dec_ms:.2f} ms, but its {dec_flops / 1e6:,.1f} MFLOP would need only "
            f"{t_compute_us:,.0f} µs at the measured peak of {probe.peak_flops / 1e9:,.0f} GFLOP/s, and reading all "
            f"{fmt_bytes(weight_bytes, both_units=True)} of weights at {probe.bandwidth / 1e9:,.1f} GB/s takes "
            f"{t_weights_us:,.0f} µs (peak and bandwidth: this session's probe, {probe.describe_sizes()}, the "
            "figures the roofline on Prefill vs decode uses). "
        )
    else:
        parts.append(f"A cached decode step takes {dec_ms:.2f} ms and must read all {fmt_bytes(weight_bytes)} of weights. ")
    parts.append(
        "The rest is fixed overhead: dozens of small operator calls per layer, each with Python and launch costs "
        "that do not shrink with the token count. A one-token step is a matrix-vector product limited by memory "
        "bandwidth, while the no-cache pass pushes t tokens through the same weights in one matrix multiply, which "
        "runs at far higher efficiency per FLOP. So much of the recomputation is nearly free at small t; the "
        "measured speedup climbs towards the FLOP ratio only as t grows and recomputation becomes compute-bound."
    )
    return "".join(parts)
