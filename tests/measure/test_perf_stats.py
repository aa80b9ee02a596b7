"""Pure analysis: spreads, aggregation, log-log fits, roofline labels and the race paragraph."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvviz.engine.api import generate
from kvviz.measure.stats import (
    MachineProbe, Sample, aggregate, bound_label, fits_by_series, loglog_slope, phase_verdict, race_explanation,
    roof_fraction, roofline_points, samples_frame, speedup_table, spread,
)
from kvviz import CacheSpec

PROBE = MachineProbe(device="cpu (test)", dtype="fp32", peak_flops=100e9, bandwidth=20e9, matmul_n=64,
                     copy_bytes=2**20, seconds=0.1)


def _s(series: str, x: float, rep: int, **m: float) -> Sample:
    return Sample("t", series, x, rep, m, device="cpu", dtype="fp32")


def test_spread_median_min_max() -> None:
    s = spread([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.lo, s.hi, s.n) == (2.5, 1.0, 10.0, 4)
    assert math.isnan(spread([]).median)


def test_aggregate_per_series_and_x() -> None:
    samples = [_s("a", 1, r, ms=v) for r, v in enumerate([1.0, 3.0, 2.0])] + [_s("b", 1, 0, ms=5.0)]
    df = aggregate(samples, "ms")
    a = df[df.series == "a"].iloc[0]
    assert (a["median"], a["min"], a["max"], a["n"]) == (2.0, 1.0, 3.0, 3)
    assert list(df.columns) == ["series", "x", "median", "min", "max", "n"]
    assert aggregate(samples, "missing").empty


def test_aggregate_bins_contexts() -> None:
    samples = [_s("d", x, 0, ms=float(x)) for x in range(0, 20)]
    df = aggregate(samples, "ms", bin_width=10)
    assert list(df["x"]) == [5.0, 15.0]  # labelled by the bin centre
    assert list(df["median"]) == [4.5, 14.5]
    assert list(df["n"]) == [10, 10]


def test_loglog_slope_recovers_power_laws_on_the_large_points() -> None:
    x = np.array([32, 64, 128, 256, 512], dtype=float)
    quad = 5.0 + 1e-3 * x**2  # a constant overhead bends the small-N end only
    fit = loglog_slope(x, quad)
    assert fit is not None and fit.x_min == 128 and fit.n_points == 3  # top half: 128, 256, 512
    assert 1.8 < fit.slope <= 2.0
    assert loglog_slope(x, 3 * x).slope == pytest.approx(1.0)
    assert loglog_slope([1.0], [1.0]) is None
    assert loglog_slope(x, 3 * x).predict([1000.0])[0] == pytest.approx(3000.0)


def test_fits_and_speedup_table_from_an_aggregate() -> None:
    samples = []
    for rep, noise in enumerate((0.9, 1.0, 1.1)):
        for n in (32, 64, 128, 256):
            samples.append(_s("static", n, rep, total_ms=n * noise))
            samples.append(_s("none", n, rep, total_ms=n * n / 32 * noise))
    agg = aggregate(samples, "total_ms")
    fits = fits_by_series(agg)
    assert fits["static"].slope == pytest.approx(1.0) and fits["none"].slope == pytest.approx(2.0)
    table = speedup_table(agg)
    assert list(table["new tokens"]) == [32, 64, 128, 256]
    assert list(table["speedup"]) == pytest.approx([1.0, 2.0, 4.0, 8.0])
    assert table["speedup range"].iloc[3] == f"{256 * 8 * 0.9 / (256 * 1.1):.2f}–{256 * 8 * 1.1 / (256 * 0.9):.2f}"


def test_roofline_labels() -> None:
    assert PROBE.ridge == pytest.approx(5.0)
    assert PROBE.roof(1.0) == pytest.approx(20e9) and PROBE.roof(100.0) == pytest.approx(100e9)
    assert bound_label(0.5, PROBE) == "memory-bound" and bound_label(50.0, PROBE) == "compute-bound"
    assert roof_fraction(1.0, 10e9, PROBE) == pytest.approx(0.5)
    text = phase_verdict("decode", 0.5, 0.5e9, PROBE)
    assert "memory-bound" in text and "below" in text and "overhead" in text  # 5% of its roof
    assert "compute-bound" in phase_verdict("prefill", 50.0, 80e9, PROBE)


def test_roofline_points_pair_intensity_and_throughput() -> None:
    samples = [_s("prefill", 16, r, flops_per_s=1e9 * (r + 1), intensity=8.0) for r in range(3)]
    df = roofline_points(samples)
    assert df.iloc[0]["intensity"] == 8.0 and df.iloc[0]["median"] == 2e9 and df.iloc[0]["max"] == 3e9


def test_samples_frame_has_metrics_and_tags() -> None:
    df = samples_frame([_s("a", 1, 0, ms=1.0, flops=2.0)])
    assert {"sweep", "series", "x", "repeat", "device", "dtype", "ms", "flops"} <= set(df.columns)


def test_race_explanation_quotes_this_runs_numbers(small_model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import kvviz.measure.stats as stats

    # 12 real steps of a tiny model: on a loaded machine a no-cache step may finish first, and the
    # explanation then rightly gives way to the doubts (tests/measure/test_doubts.py holds that).
    monkeypatch.setattr(stats, "race_doubts", lambda *args, **kwargs: [])
    cached = generate(small_model, prompt=[1, 2, 3], max_new_tokens=12)
    uncached = generate(small_model, prompt=[1, 2, 3], max_new_tokens=12, cache=CacheSpec(use_cache=False))
    text = race_explanation(cached, uncached, weight_bytes=1_000_000, probe=PROBE)
    assert "step 11" in text and "cpu" in text and "GFLOP/s" in text and "bandwidth" in text
    assert "few tokens" in race_explanation(cached.upto(1), uncached.upto(1), 1_000_000)


def test_binned_spread_is_the_typical_spread_over_repeats() -> None:
    # Two repeats per context; one rare spike must not become the whole bin's max.
    samples = [_s("d", x, r, ms=1.0 + r) for x in range(10) for r in range(2)]
    samples.append(_s("d", 3, 2, ms=50.0))
    df = aggregate(samples, "ms", bin_width=10)
    row = df.iloc[0]
    assert (row["x"], row["min"], row["max"], row["n"]) == (5.0, 1.0, 2.0, 21)
