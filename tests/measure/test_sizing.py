"""measure/sizing.py: the estimates that size each timing page's defaults, against hand-computed
figures; the choosers; the progress bar's time left; the example's sentence never shows "nan"."""
from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest

from kvviz.engine.generation.flops import forward_flops
from kvviz.engine.loading.loader import LoadedModel
from kvviz.measure import sizing
from kvviz.measure.sizing import (BUDGET_S, MARGIN, PICK_S, Calibration, Estimator, about, contention, pick_batch,
                                  pick_context, pick_ns, pick_race_tokens, pick_repeats)
from kvviz.measure.sweeps import prompt_lengths

CAL = Calibration(prefill_ms=64.0, decode_ms=10.0, prompt=64, weight_bytes=1_000_000, kv_bytes_per_token=1_000)


def test_estimates_scale_the_calibration_by_flops_and_bytes(random_models: dict[str, LoadedModel]) -> None:
    cfg = random_models["tiny"].config
    est = Estimator(CAL, cfg)
    # A prefill scales with its FLOPs (attention makes a long one cost more than linear) ...
    ratio = forward_flops(cfg, 256, 0) / forward_flops(cfg, 64, 0)
    assert ratio > 4 and est.prefill_ms(256) == pytest.approx(64.0 * ratio)
    # A short one costs a decode step (the weights streamed once) plus its share of the rest: on the
    # straight line from (1 row, 10 ms) to (64 rows, 64 ms).
    assert est.prefill_ms(16) == pytest.approx(10.0 + (64.0 - 10.0) * 15 / 63)
    assert est.prefill_ms(1) == pytest.approx(10.0) and est.prefill_ms(64) == pytest.approx(64.0)
    assert est.prefill_ms(8, batch=4) == pytest.approx(est.prefill_ms(32))
    # A decode step grows with the cache's share of the bytes read, counted KV_WEIGHT times.
    assert est.decode_ms(64) == 10.0
    assert est.decode_ms(1064) == pytest.approx(10.0 * (1 + sizing.KV_WEIGHT * 1_000 * 1_000 / 1_000_000))
    assert est.decode_ms(64, batch=3) == pytest.approx(10.0 + 2 * 1.0)  # each extra row: a prefill token
    # Without a cache every step is a prefill of the whole sequence.
    assert est.run_ms(64, 3, "none") == pytest.approx(sum(est.prefill_ms(64 + t) for t in range(3)))
    assert est.run_ms(64, 3) == pytest.approx(est.prefill_ms(64) + est.decode_ms(65) + est.decode_ms(66))
    # A race's progress by estimated time: static then concat then none.
    total = sum(est.run_ms(10, 8, m) for m in ("static", "concat", "none"))
    assert est.race_fraction(10, 8, "concat", 4) == pytest.approx((est.run_ms(10, 8) + est.run_ms(10, 4, "concat")) / total)
    assert est.race_fraction(10, 8, "none", 8) == pytest.approx(1.0)
    lengths = prompt_lengths(128)
    want = sum(est.prefill_ms(n) for n in lengths) + est.prefill_ms(16) + sum(est.decode_ms(t) for t in range(17, 128))
    assert est.prefill_decode_s(128, 2) == pytest.approx(MARGIN * 2 * want / 1000)


def test_choosers_fit_the_budget(random_models: dict[str, LoadedModel]) -> None:
    est = Estimator(CAL, random_models["tiny"].config)
    options = [64, 128, 256, 512]
    ctx, repeats = pick_context(est, options, budget_s=est.prefill_decode_s(256, 3) * 1.01)
    assert (ctx, repeats) == (256, 3)
    ctx, repeats = pick_context(est, options, budget_s=est.prefill_decode_s(512, 2) * 1.01)
    assert (ctx, repeats) == (512, 2)
    assert pick_context(est, options, budget_s=0.0) == (64, 1)
    ns = [8, 16, 32, 64, 128]
    got, reps = pick_ns(est, 10, ns, budget_s=est.total_time_sweep_s(10, ns[:4], 2) * 1.01)
    assert est.total_time_sweep_s(10, got, reps) <= est.total_time_sweep_s(10, ns[:4], 2) * 1.01
    assert len(got) >= 4 and got == ns[: len(got)]
    # Too slow for four points even once: the Ns that fit once, at least two.
    slow, reps = pick_ns(est, 10, ns, budget_s=est.total_time_sweep_s(10, ns[:2], 1) * 1.01)
    assert (slow, reps) == (ns[:2], 1)
    sizes, reps = pick_batch(est, [1, 2, 4], 8, 8, budget_s=est.batch_s([1, 2, 4], 8, 8, 2) * 1.01)
    assert (sizes, reps) == ([1, 2, 4], 2)


def test_estimates_hold_at_the_load_now(random_models: dict[str, LoadedModel]) -> None:
    """A page calibrated on a quiet machine promised "about 55 s" and took 77 s at load 8: every
    estimate is scaled by the contention now (runnable threads per core) over the calibration's."""
    cfg = random_models["tiny"].config
    # Load 8 on 2 cores: each runnable thread gets a quarter of a core. A load under the core count
    # (or none known) is a free core per thread.
    assert contention(8.0, 2) == 4.0 and contention(1.5, 2) == 1.0 and contention(None, 2) == 1.0
    quiet, busy = Estimator(CAL, cfg), Estimator(CAL, cfg, contention(8.0, 2), 8.0)
    assert busy.slowdown == 4.0 and quiet.slowdown == 1.0
    assert busy.prefill_decode_s(128, 2) == pytest.approx(4 * quiet.prefill_decode_s(128, 2))
    assert busy.race_s(10, 8) == pytest.approx(4 * quiet.race_s(10, 8))
    assert busy.spec_s(10, 8, 1) == pytest.approx(4 * quiet.spec_s(10, 8, 1))
    # A race's progress is a share of its own time: the same on a busy machine.
    assert busy.race_fraction(10, 8, "concat", 4) == pytest.approx(quiet.race_fraction(10, 8, "concat", 4))
    # Calibrated at load 4 (contention 2): now at load 8 it is twice as slow; quieter than then, the
    # estimate keeps the calibration's (never below it: an underestimate costs a wait).
    cal_busy = dataclasses.replace(CAL, contention=2.0)
    assert Estimator(cal_busy, cfg, 4.0, 8.0).slowdown == 2.0 and Estimator(cal_busy, cfg, 1.0, 0.5).slowdown == 1.0
    # The page says so.
    assert quiet.here(42.0) == "about 40 s here"
    assert busy.here(42.0) == ("about 40 s here, scaled ×4.0 because the machine is busier now (load average 8.0) "
                               "than when this page timed the model: the model gets a smaller share of the cores")
    # And picks less work, within the same budget.
    options = [64, 128, 256, 512]
    assert pick_context(busy, options, 30.0) < pick_context(quiet, options, 30.0)
    ns = [8, 16, 32, 64, 128]
    assert sum(pick_ns(busy, 10, ns, 5.0)[0]) * pick_ns(busy, 10, ns, 5.0)[1] \
        < sum(pick_ns(quiet, 10, ns, 5.0)[0]) * pick_ns(quiet, 10, ns, 5.0)[1]


def test_the_race_and_the_example_shrink_to_fit(random_models: dict[str, LoadedModel]) -> None:
    est = Estimator(CAL, random_models["tiny"].config)
    # The race: the sidebar's N when it fits, else the most tokens that do (never under 16).
    assert pick_race_tokens(est, 10, 64, budget_s=est.race_s(10, 64)) == 64
    n = pick_race_tokens(est, 10, 64, budget_s=est.race_s(10, 40) * 1.001)
    assert n == 40 and est.race_s(10, 41) > est.race_s(10, 40) * 1.001
    assert pick_race_tokens(est, 10, 64, budget_s=0.0) == 16 and pick_race_tokens(est, 10, 8, budget_s=0.0) == 8
    # The example: 3 repeats if they fit, else 2, else 1.
    assert pick_repeats(lambda r: 10.0 * r, budget_s=30.0) == 3
    assert pick_repeats(lambda r: 10.0 * r, budget_s=25.0) == 2
    assert pick_repeats(lambda r: 10.0 * r, budget_s=5.0) == 1


def test_defaults_leave_room_under_the_minute() -> None:
    # Measured at load 8 on 2 cores, a lesson took up to 1.25x its estimate; defaults are picked to an
    # estimate that leaves that room under the minute the pages promise.
    assert PICK_S * 1.25 <= BUDGET_S == 60.0


def test_calibrate_times_the_model(random_models: dict[str, LoadedModel]) -> None:
    m = random_models["tiny"]
    cal = sizing.calibrate(m)
    assert cal.prompt == 64 and cal.prefill_ms > 0 and cal.decode_ms > 0
    assert cal.kv_bytes_per_token == 2 * 4 * 4 * 64 * 4  # K and V, 4 layers, 4 heads of 64, fp32


def test_about_and_time_left() -> None:
    from kvviz.ui.common.sweep_driver import time_left

    assert [about(x) for x in (3.2, 42.0, 61.0, 600.0)] == ["about 3 s", "about 40 s", "about 60 s", "about 10 min"]
    assert time_left(10.0, 0.25) == " · about 30 s left"
    assert time_left(0.0, 0.0) == "" and time_left(5.0, 1.0) == ""


def test_example_sentence_never_formats_nan(random_models: dict[str, LoadedModel]) -> None:
    from kvviz.ui.pages.prefill.prefill import _example_sentence

    def df(short: float, long: float) -> pd.DataFrame:
        return pd.DataFrame({"series": ["short question", "long document"], "median": [short, long], "x": [10, 500]})

    text = _example_sentence(df(5.0, 200.0), df(math.nan, 30.0), random_models["tiny"])
    assert "nan" not in text.lower() and "—" in text and "no decode step" in text
    ok = _example_sentence(df(5.0, 200.0), df(30.0, 31.0), random_models["tiny"])
    assert "each new token took 30.00 vs 31.00 ms (+3%)" in ok
