"""Every perf chart: a title naming where it was measured, axis labels with units, a fixed height,
float32 data, min-max spread where there were repeats, and log axes where the story needs them."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest

from kvviz.charts import perf as pc
from kvviz.engine.api import generate
from kvviz.measure.stats import MachineProbe, Sample, aggregate, fits_by_series, roofline_points
from kvviz import CacheSpec

PROBE = MachineProbe(device="cpu (test)", dtype="fp32", peak_flops=50e9, bandwidth=10e9, matmul_n=64,
                     copy_bytes=2**20, seconds=0.1)


@pytest.fixture(scope="module")
def runs(small_model):  # type: ignore[no-untyped-def]
    return {mode: generate(small_model, prompt=[1, 2, 3, 4], max_new_tokens=12,
                           cache=CacheSpec(use_cache=mode != "none", kind="static" if mode == "none" else mode)) for mode in ("static", "concat", "none")}


def _check(fig: go.Figure, *, height: int | None = None) -> None:
    lay = fig.layout
    assert lay.title.text and lay.title.subtitle.text  # what, and where it was measured
    assert lay.height == (height or lay.height) and lay.height >= 300
    for ax in [a for a in (lay.xaxis, lay.yaxis)]:
        assert ax.title.text or any(a.title.text for a in (lay.xaxis, lay.yaxis))
    for tr in fig.data:
        for name in ("x", "y"):
            v = getattr(tr, name, None)
            if isinstance(v, np.ndarray) and v.dtype.kind == "f":
                assert v.dtype == np.float32, (tr.name, name)
    fig.to_json()  # serializable as the browser gets it


def _sweep_samples() -> list[Sample]:
    out = []
    for rep in range(3):
        for n in (32, 64, 128):
            out.append(Sample("total_time", "static", n, rep, {"total_ms": n * (1 + rep / 10)}, "cpu", "fp32"))
            out.append(Sample("total_time", "none", n, rep, {"total_ms": n * n / 16 * (1 + rep / 10)}, "cpu", "fp32"))
    return out


@pytest.mark.parametrize("builder", [pc.race_latency, pc.race_cumulative, pc.race_tokens, pc.race_flops,
                                     pc.race_speedup, pc.cache_bytes, pc.cache_copied])
def test_race_charts(runs, builder) -> None:  # type: ignore[no-untyped-def]
    fig = builder(runs)
    _check(fig, height=pc.HEIGHT)
    assert "test · cpu · fp32" in fig.layout.title.subtitle.text
    assert len(fig.data) >= 2


def test_race_chart_contents(runs) -> None:  # type: ignore[no-untyped-def]
    tokens = pc.race_tokens(runs)
    by_name = {t.name: t for t in tokens.data}
    assert list(by_name["no cache"].y[:3]) == [4, 5, 6] and list(by_name["KV cache (static)"].y[:3]) == [4, 1, 1]
    speed = pc.race_speedup(runs)
    assert speed.layout.yaxis.type == "log"
    ratio = next(t for t in speed.data if t.name and t.name.startswith("theoretical"))
    assert ratio.y[0] == pytest.approx(1.0) and ratio.y[-1] > 2  # same prefill, then recomputation costs more
    copied = pc.cache_copied(runs)
    assert any("O(T²)" in t.name for t in copied.data) and any("O(T)" in t.name for t in copied.data)
    flops = pc.race_flops(runs)
    bars = [t for t in flops.data if t.type == "bar"]
    assert {b.x[0] for b in bars} == {"static", "concat", "none"}


def test_race_charts_accept_partial_and_missing_modes(runs) -> None:  # type: ignore[no-untyped-def]
    part = {"static": runs["static"], "none": runs["none"].upto(3)}
    for builder in (pc.race_latency, pc.race_speedup, pc.cache_bytes, pc.cache_copied):
        builder(part).to_json()
    assert len(pc.race_speedup({"static": runs["static"]}).data) == 0


def test_sweep_time_linear_and_loglog() -> None:
    agg = aggregate(_sweep_samples(), "total_ms")
    fits = fits_by_series(agg)
    lin = pc.sweep_time(agg, fits, False, "tiny · cpu · fp32")
    log = pc.sweep_time(agg, fits, True, "tiny · cpu · fp32")
    _check(lin)
    _check(log)
    assert log.layout.xaxis.type == "log" and log.layout.yaxis.type == "log" and lin.layout.xaxis.type != "log"
    names = [t.name for t in log.data if t.name]
    assert any("slope 1.00" in n for n in names) and any("slope 2.00" in n for n in names)
    err = lin.data[0].error_y
    assert err.array is not None and err.arrayminus is not None  # min-max spread


def test_prefill_charts() -> None:
    ttft = [Sample("ttft", "prefill", n, r, {"ttft_ms": n / 10 + r, "flops_per_s": 1e9 * n / 64, "intensity": n / 4},
                   "cpu", "fp32") for r in range(2) for n in (16, 64, 256)]
    dec = [Sample("decode", "decode", c, 0, {"latency_ms": 1 + c / 1000, "flops_per_s": 2e8, "intensity": 0.5},
                  "cpu", "fp32") for c in range(17, 200)]
    _check(pc.ttft_chart(aggregate(ttft, "ttft_ms"), "tiny · cpu · fp32"))
    d = pc.decode_chart(aggregate(dec, "latency_ms", 32), "tiny · cpu · fp32")
    _check(d)
    assert d.data[0].fill == "toself"  # the min-max band
    roof = pc.roofline(PROBE, {"prefill": roofline_points(ttft), "decode": roofline_points(dec, 64)})
    _check(roof)
    assert roof.layout.xaxis.type == "log" and "GFLOP/s" in roof.layout.title.subtitle.text
    roof_line = roof.data[0]
    assert max(roof_line.y) == pytest.approx(50.0)  # flat at the peak, in GFLOP/s
    ex = [Sample("short_long", s, x, r, {"ttft_ms": x / 10, "tpot_ms": 1.0}, "cpu", "fp32")
          for r in range(2) for s, x in (("short question", 8), ("long document", 60))]
    sl = pc.short_long_chart(aggregate(ex, "ttft_ms"), aggregate(ex, "tpot_ms"), "tiny · cpu · fp32")
    _check(sl)
    assert sl.data[0].x[0].startswith("short question")  # the short prompt comes first


def test_batch_charts() -> None:
    samples = [Sample("batch", s, b, r, {"tpot_ms": 1 + b / 8, "tokens_per_s": b * 1000 / (1 + b / 8),
                                         "kv_bytes_allocated": b * 2**20, "kv_bytes_used": b * 2**17}, "cpu", "fp32")
               for s in ("same prompt", "different prompts") for r in range(2) for b in (1, 2, 4)]
    t = pc.batch_tradeoff(aggregate(samples, "tpot_ms"), aggregate(samples, "tokens_per_s"), "tiny · cpu · fp32")
    _check(t)
    assert {tr.name for tr in t.data} == {"same prompt", "different prompts"}
    assert list(t.data[0].text) == ["B=1", "B=2", "B=4"]
    kv = pc.batch_kv(aggregate(samples, "kv_bytes_allocated"), aggregate(samples, "kv_bytes_used"), "tiny")
    _check(kv)
    assert list(kv.data[0].y) == pytest.approx([1.0, 2.0, 4.0])  # MiB, linear in B
