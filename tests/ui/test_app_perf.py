"""AppTest over the race, prefill/decode and batching pages on random:tiny with small N.

Each script renders the real sidebar and then the page, exactly as app.py does for it (AppTest
cannot switch to a function page). The machine probe is pre-seeded with fixed numbers: the real
probe allocates hundreds of MB, which a unit test has no business doing (test_measure covers it).
"""
from __future__ import annotations

import json
import re
from typing import Callable, Iterator

import pytest
from streamlit.testing.v1 import AppTest

from kvviz.measure.stats import MachineProbe, Sample
from kvviz.ui.common.plain_text import unescape  # errors are shown through md_plain

PROBE = MachineProbe(device="cpu (test)", dtype="fp32", peak_flops=50e9, bandwidth=10e9, matmul_n=64,
                     copy_bytes=2**20, seconds=0.1)


def _race() -> None:
    import streamlit as st

    from kvviz.ui.pages.race import race
    from kvviz.ui.sidebar import render_sidebar

    st.session_state["settings"] = render_sidebar()
    race.page()


def _prefill() -> None:
    import streamlit as st

    from kvviz.ui.pages.prefill import prefill
    from kvviz.ui.sidebar import render_sidebar

    st.session_state["settings"] = render_sidebar()
    prefill.page()


def _batching() -> None:
    import streamlit as st

    from kvviz.ui.pages.batching import batching
    from kvviz.ui.sidebar import render_sidebar

    st.session_state["settings"] = render_sidebar()
    batching.page()


@pytest.fixture(autouse=True)
def tiny_default(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVVIZ_DEFAULT_MODEL", "random:tiny")
    monkeypatch.setenv("KVVIZ_MODELS_DIR", str(tmp_path))


def fresh(script: Callable[[], None], max_new_tokens: int | None = 8) -> AppTest:
    at = AppTest.from_function(script, default_timeout=120)
    at.session_state["pd_probes"] = {("cpu", "fp32"): PROBE}
    at.run()
    if max_new_tokens is not None:
        at.number_input(key="max_new_tokens").set_value(max_new_tokens).run()
    return at


def figures(at: AppTest) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def titles(at: AppTest) -> list[str]:
    return [f["layout"]["title"]["text"] for f in figures(at)]


def no_problems(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


# --- race ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def raced() -> Iterator[AppTest]:
    import os

    from kvviz.measure import measuring

    os.environ.setdefault("KVVIZ_DEFAULT_MODEL", "random:tiny")
    from kvviz.measure import stats

    # The machine running the tests may be busy; these tests are about a steady machine's pages
    # (test_doubts.py covers what a busy one says). Nor may the race's own timings decide what
    # the page says: 8 tiny steps on a loaded or faster machine can have a no-cache step finish
    # first, and the page then rightly gives no explanation (test_doubts.py holds that branch).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measuring.BusyWindow, "clause", lambda self: None)
        mp.setattr(stats, "race_doubts", lambda *args, **kwargs: [])
        at = fresh(_race)
        yield at.button(key="race_start").click().run()


def test_race_page_loads_with_instructions() -> None:
    at = fresh(_race, None)
    no_problems(at)
    assert at.title[0].value == "Cache vs no cache"
    assert any("Start the race" in i.value for i in at.info)


def test_race_shows_identical_output_and_every_chart(raced: AppTest) -> None:
    no_problems(raced)
    assert any("Identical output" in s.value and "8 tokens" in s.value for s in raced.success)
    t = titles(raced)
    for expected in ("Per-step latency", "Cumulative generation time", "Tokens processed per step", "Analytic FLOPs",
                     "Speedup of the KV cache (static)", "KV cache bytes: allocated vs used",
                     "Bytes written by the cache"):
        assert any(x.startswith(expected) for x in t), expected
    assert all("random:tiny · cpu · fp32" in f["layout"]["title"]["subtitle"]["text"] for f in figures(raced))
    labels = {m.label for m in raced.metric}
    assert {"KV cache (static): total", "no cache: total", "Speedup (static vs none)", "Concat: bytes copied"} <= labels
    # One unit system: the cache's bytes as Generate writes them (kvviz.units.fmt_bytes, binary), never "MB".
    from kvviz.units import fmt_bytes
    from unit_names import decimal_without_binary

    byte_metrics = {m.label: m.value for m in raced.metric if m.label.startswith(("Static:", "Concat:"))}
    assert len(byte_metrics) == 4 and all(re.fullmatch(r"[\d,.]+ (B|KiB|MiB|GiB)", v) for v in byte_metrics.values())
    runs = raced.session_state["race_runs::random:tiny::cpu::fp32"].runs
    assert byte_metrics["Static: allocated"] == fmt_bytes(runs["static"].events[-1].cache_bytes_allocated)
    assert byte_metrics["Concat: bytes copied"] == fmt_bytes(runs["concat"].events[-1].cache_bytes_copied)
    shown = [m.value for m in raced.markdown] + [c.value for c in raced.caption] + list(byte_metrics.values())
    assert not [t for t in shown if decimal_without_binary(t)]
    # The explanation quotes the probe's numbers: PROBE's fixed 50e9 FLOP/s and 10e9 B/s, not a speed
    # this machine measured.
    assert any("50 GFLOP/s" in m.value and "10.0 GB/s" in m.value for m in raced.markdown)
    # All three outputs are shown as plain text (st.code), never as HTML.
    assert len(raced.code) >= 3 and len({c.value for c in raced.code[:3]}) == 1


def test_race_sweep_then_table_and_slopes(raced: AppTest) -> None:
    at = raced
    at.multiselect(key="race_sweep_ns").set_value([32])
    at.number_input(key="race_sweep_repeats").set_value(1)
    at.button(key="race_sweep").click().run()
    no_problems(at)
    t = titles(at)
    assert any(x.startswith("Total time vs new tokens N (log-log") for x in t)
    assert sum(x.startswith("Total time vs new tokens N") for x in t) == 2
    table = at.dataframe[0].value
    assert list(table["new tokens"]) == [32] and table["repeats"].iloc[0] == 1
    assert {s.series for s in at.session_state["race_sweep::random:tiny::cpu::fp32"]} == {"static", "none"}


def test_a_slow_race_runs_the_tokens_that_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36: the Gemma 3 race took 85 s at load 8. Where the sidebar's N would take over a minute
    here, the race runs the most tokens that fit (at least 16) and says so; a box races all of them."""
    from kvviz.measure.sizing import Calibration, Estimator
    from kvviz.ui.pages.race import race

    slow = Calibration(prefill_ms=6400.0, decode_ms=1000.0, prompt=64, weight_bytes=10**6, kv_bytes_per_token=10**3)
    monkeypatch.setattr(race, "estimator", lambda model, fast=True: Estimator(slow, model.config))
    at = fresh(_race, 64)
    no_problems(at)
    caps = " ".join(c.value for c in at.caption)
    assert ("16 new tokens per mode, EOS ignored so every run generates 16 tokens (of the sidebar's 64: what "
            "finishes in about a minute here)") in caps, caps
    at.button(key="race_start").click().run()
    no_problems(at)
    assert {len(r.events) for r in at.session_state["race_runs::random:tiny::cpu::fp32"].runs.values()} == {16}
    at.checkbox(key="race_all_n").check().run()
    caps = " ".join(c.value for c in at.caption)
    assert "64 new tokens per mode, EOS ignored" in caps, caps


def test_race_rejects_bad_input_with_a_message() -> None:
    at = fresh(_race)
    at.text_area(key="prompt").set_value("").run()
    at.button(key="race_start").click().run()
    assert not at.exception and any("empty" in unescape(e.value) for e in at.error)
    at = fresh(_race)
    at.text_area(key="prompt").set_value("x" * 1020).run()
    at.number_input(key="max_new_tokens").set_value(8).run()
    at.button(key="race_start").click().run()
    assert not at.exception and any("exceeds the model's context" in unescape(e.value) for e in at.error)


def test_a_stopped_sweep_keeps_its_points() -> None:
    at = fresh(_race, None)
    # What a Stop click leaves behind: the status still says running, two samples stored.
    at.session_state["race_sweep_status"] = "running"
    at.session_state["race_sweep::random:tiny::cpu::fp32"] = [
        Sample("total_time", m, 32, 0, {"total_ms": v}, "cpu", "fp32") for m, v in (("static", 10.0), ("none", 30.0))]
    at.run()
    no_problems(at)
    assert any("stopped after 2 runs" in w.value for w in at.warning)
    assert sum(x.startswith("Total time vs new tokens N") for x in titles(at)) == 2


# --- prefill vs decode ----------------------------------------------------------------------------

def test_prefill_page_measures_and_labels_the_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvviz.ui.pages.prefill import prefill

    # About a steady machine's page: the machine running the tests may be busy, and a page that
    # doubts its timings gives no verdict (the test below).
    monkeypatch.setattr(prefill, "sweep_doubts", lambda ttft, decode, busy: [])
    at = fresh(_prefill, None)
    no_problems(at)
    at.select_slider(key="pd_max_context").set_value(64)
    at.number_input(key="pd_repeats").set_value(1)
    at.button(key="pd_run").click().run()
    no_problems(at)
    t = titles(at)
    assert "Time to first token vs prompt length" in t and "Per-token decode latency vs context length" in t
    assert any(x.startswith("Roofline of this machine") for x in t)
    verdicts = " ".join(m.value for m in at.markdown)
    assert "Prefill at a 63-token prompt: **" in verdicts and "-token context: **memory-bound**" in verdicts
    # The caption says what was measured: EOS ignored, the decode run reached the 64-token context.
    caps = " ".join(c.value for c in at.caption)
    assert "decode steps at contexts of 17–63 tokens (EOS ignored" in caps  # promised before the run ...
    assert "decode steps at contexts of 17–63 tokens (1 run)" in caps  # ... and measured
    roof = next(f for f in figures(at) if f["layout"]["title"]["text"].startswith("Roofline"))
    assert {d.get("name") for d in roof["data"]} >= {"prefill (measured)", "decode (measured)"}

    # "Probe again" measures anew (here a stand-in probe: the real one allocates hundreds of MB).
    import dataclasses

    import kvviz.ui.common.session_probes as common

    quiet = dataclasses.replace(PROBE, peak_flops=80e9)
    monkeypatch.setattr(common, "probe_machine", lambda device, dtype: quiet)
    at.button(key="pd_reprobe").click().run()
    no_problems(at)
    assert any("peak matmul 80.0 GFLOP/s" in c.value for c in at.caption)

    at.number_input(key="pd_example_tokens").set_value(8)
    at.button(key="pd_example").click().run()
    no_problems(at)
    assert "Short question vs long pasted document" in titles(at)
    assert any("time to first token grew" in m.value for m in at.markdown)


def test_a_prefill_page_in_doubt_gives_no_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36: the amber box said "these timings contradict what they should show", and right below
    it the page still printed a confident "Verdict, from the measurements". One or the other."""
    from kvviz.ui.pages.prefill import prefill

    doubt = "The spread is too wide: repeats of the same prompt length differ by 2.0×."
    monkeypatch.setattr(prefill, "sweep_doubts", lambda ttft, decode, busy: [doubt])
    at = fresh(_prefill, None)
    at.select_slider(key="pd_max_context").set_value(64)
    at.number_input(key="pd_repeats").set_value(1)
    at.button(key="pd_run").click().run()
    no_problems(at)
    assert any(doubt in w.value and "does not explain them" in w.value for w in at.warning)
    text = " ".join(m.value for m in at.markdown)
    assert "Verdict" not in text and "-token prompt: **" not in text and "-token context: **" not in text, text
    assert "**No verdict from these measurements**" in text
    assert any(x.startswith("Roofline of this machine") for x in titles(at))  # the points are still shown


def test_a_race_sweep_in_doubt_gives_no_cause() -> None:
    """The sweep's slopes stay (they are measured); its "expect about 1 ... fixed costs" does not,
    beside a box saying the slope contradicts what it should be."""
    at = fresh(_race, None)
    at.session_state["race_sweep::random:tiny::cpu::fp32"] = [  # a cached time growing as N squared
        Sample("total_time", m, n, 0, {"total_ms": k * n * n}, "cpu", "fp32")
        for n in (32, 64, 128, 256) for m, k in (("static", 0.01), ("none", 0.03))]
    at.run()
    no_problems(at)
    assert any("The cached (static) slope is 2.00" in w.value for w in at.warning)
    text = " ".join(m.value for m in at.markdown)
    assert "Fitted log-log slopes" in text and "Expect" not in text and "fixed costs" not in text


# --- batching -------------------------------------------------------------------------------------

def test_batching_page_same_and_different_prompts() -> None:
    at = fresh(_batching, None)
    no_problems(at)
    at.number_input(key="batch_prompt_len").set_value(4)
    at.number_input(key="batch_new_tokens").set_value(4)
    at.number_input(key="batch_repeats").set_value(1)
    at.button(key="batch_run").click().run()
    no_problems(at)
    at.radio(key="batch_prompts").set_value("different")
    at.button(key="batch_run").click().run()
    no_problems(at)
    t = titles(at)
    assert any(x.startswith("Batching: throughput vs per-request latency") for x in t)
    assert "KV cache bytes vs batch size" in t
    table = at.dataframe[0].value
    assert set(table["prompts"]) == {"same prompt", "different prompts"}
    assert sorted(set(table["batch size"])) == [1, 2, 4, 8, 16]
    diff = table[table["prompts"] == "different prompts"]
    # Distinct prompts, distinct continuations (an untrained model may still map two prompts that
    # end alike to the same tokens, so only "more than one" is certain).
    assert list(diff["distinct outputs"])[:2] == [1, 2] and all(d > 1 for d in list(diff["distinct outputs"])[1:])
    same = table[table["prompts"] == "same prompt"]
    assert set(same["distinct outputs"]) == {1}


def test_the_race_runs_the_tokens_its_caption_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate that shortens the race moves as runs calibrate it, and the Start click reruns the
    page: the race must still run the N the caption said (a browser test once saw "90 new tokens per
    mode" race 89). Changed inputs (here the sidebar's N) pick again."""
    from kvviz.measure import measuring, stats
    from kvviz.ui.pages.race import race

    fits = [12]  # what the estimate says now; the test moves it as a calibration would
    monkeypatch.setattr(race, "pick_race_tokens", lambda est, prompt, asked: min(fits[0], asked))
    monkeypatch.setattr(measuring.BusyWindow, "clause", lambda self: None)
    monkeypatch.setattr(stats, "race_doubts", lambda *args, **kwargs: [])
    at = fresh(_race, max_new_tokens=40)
    assert any(c.value.startswith("12 new tokens per mode") for c in at.caption), [c.value for c in at.caption]
    fits[0] = 11
    at.button(key="race_start").click().run()
    no_problems(at)
    runs = at.session_state["race_runs::random:tiny::cpu::fp32"].runs
    assert {len(r.events) for r in runs.values()} == {12}
    at.number_input(key="max_new_tokens").set_value(30).run()
    assert any(c.value.startswith("11 new tokens per mode") for c in at.caption), [c.value for c in at.caption]
