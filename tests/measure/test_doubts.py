"""Timing pages that contradict their expected shape say so and give no cause (kvviz.measure.doubts)."""
from __future__ import annotations

import numpy as np
import pytest

from kvviz.engine.generation.events import Run, StepEvent
from kvviz.measure import doubts
from kvviz.measure.cpu_load import CpuReading, busy_during
from kvviz.measure.stats import MachineProbe, phase_verdict, race_doubts, race_explanation

PROBE = MachineProbe("cpu", "fp32", peak_flops=100e9, bandwidth=25e9, matmul_n=1024, copy_bytes=2**28, seconds=1.0)


def run_of(latencies: list[float], flops: list[float]) -> Run:
    events = tuple(StepEvent(step=i, phase="prefill" if i == 0 else "decode", token_id=1, token_text="a",
                             position=8 + i, input_len=8 if i == 0 else 1, cache_len=8 + i, cache_bytes_used=0,
                             cache_bytes_allocated=0, latency_ms=lat, flops=fl,
                             token_bytes=b"a", cache_bytes_copied=0, elapsed_ms=lat)
                   for i, (lat, fl) in enumerate(zip(latencies, flops)))
    return Run(model="m", device="cpu", dtype="fp32", use_cache=True, cache_kind="static", sampling="greedy",
               prompt_ids=tuple(range(8)), prompt_text="", max_new_tokens=len(events), events=events)


def test_steady_race_keeps_its_explanation() -> None:
    n = 40
    cached = run_of([5.0] + [1.0 + 0.05 * (i % 3) for i in range(n - 1)], [8e6] + [1e6] * (n - 1))
    none = run_of([5.0] + [1.0 + 0.1 * i for i in range(n - 1)], [8e6] + [1e6 * (9 + i) for i in range(n - 1)])
    assert race_doubts(cached, none) == []
    text = race_explanation(cached, none, 10_000_000, PROBE)
    assert "fixed overhead" in text and "contradict" not in text


def test_noisy_or_busy_race_says_so_and_blames_nothing() -> None:
    rng = np.random.default_rng(0)
    n = 40
    lat = [5.0] + list(rng.choice([1.0, 2.0, 81.7], size=n - 1))  # a contended machine: steps 80x apart
    cached = run_of(lat, [8e6] + [1e6] * (n - 1))
    none = run_of([5.0] + [1.0 + 0.1 * i for i in range(n - 1)], [8e6] + [1e6 * (9 + i) for i in range(n - 1)])
    text = race_explanation(cached, none, 10_000_000, PROBE, busy="other processes kept 1.7 cores busy")
    assert "contradict" in text and "spread is too wide" in text and "1.7 cores busy" in text
    assert "fixed overhead" not in text and "memory bandwidth" not in text


def test_a_cached_slope_of_1_78_is_called_out() -> None:
    assert doubts.slope("cached (static)", 1.05, 1.0, 64, 256) is None
    s = doubts.slope("cached (static)", 1.78, 1.0, 64, 256)
    assert s is not None and "1.78" in s and "far from the 1" in s


def test_spreads_shapes_and_busy() -> None:
    assert doubts.step_spread([1.0] * 10, "steps") is None
    assert "spread is too wide" in (doubts.step_spread([1, 1, 1, 1, 5, 5, 5, 5, 9, 9] * 2, "steps") or "")
    assert doubts.step_spread([1, 9] * 5, "steps") is None  # 10 steps say nothing yet
    assert doubts.repeat_spread([1.0, 2.0, 3.0], [1.1, 2.2, 3.3]) is None
    assert "2.0×" in (doubts.repeat_spread([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) or "")
    assert doubts.rises([16, 32, 64, 128], [1.0, 1.8, 3.9, 8.0], "TTFT") is None
    assert "falls" in (doubts.rises([16, 32, 64, 128], [5.0, 1.8, 3.9, 2.0], "TTFT") or "")
    assert doubts.verdict([None, None]) == ""
    assert doubts.busy(None) is None and "Another process" in (doubts.busy("x") or "")


def test_busy_during_counts_only_beyond_the_free_cores() -> None:
    a = CpuReading(0.0, 0, 0)
    # 2 cores, 1 model thread: the browser may use the other core freely.
    assert busy_during(a, CpuReading(2.0, 200, 0), cores=2, threads=1, ticks_per_s=100) is None  # 1.0 core
    clause = busy_during(a, CpuReading(2.0, 360, 0), cores=2, threads=1, ticks_per_s=100)  # 1.8 cores
    assert clause is not None and "1.8 cores busy" in clause
    assert busy_during(a, CpuReading(0.5, 360, 0), cores=2, threads=1, ticks_per_s=100) is None  # too short


@pytest.mark.parametrize("doubtful", [False, True])
def test_phase_verdict_gives_no_cause_when_in_doubt(doubtful: bool) -> None:
    s = phase_verdict("decode", 0.5, 0.05e9, PROBE, doubtful=doubtful)
    assert ("fixed per-step overhead" in s) is not doubtful
    assert ("in doubt" in s) is doubtful
