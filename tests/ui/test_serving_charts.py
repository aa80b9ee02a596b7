"""The serving page's figures and numbers from hand-made records: a five-step run of three
requests, worked out by hand below, so every value a chart carries is checked against arithmetic
done here, not against the code under test.

The run (block size 4, a pool of 8 blocks, budget 8 tokens, at most 2 running):
- step 0: A (6-token prompt, 3 new) prefills all 6, B (5-token prompt, 2 new) its first 2.
- step 1: A decodes; B prefills its last 3 (its first token); C (3-token prompt, 2 new) arrives
  and waits (two running).
- step 2: the pool is full: B, the most recently admitted, is preempted (5 computed tokens lost);
  A decodes its third token and finishes. B and C wait, B first.
- step 3: B recomputes 6 tokens, 4 found in the prefix cache (2 fed) and finishes; C prefills 3.
- step 4: C decodes and finishes.
The prefix counters are the charts' inputs, counted the old way (B's re-admission in them): the engine
now counts a re-admission apart, as vLLM 0.33 does (test_serving_scheduler.py holds that by hand).
"""
from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest

from kvviz.charts import serving as sc
from kvviz.charts import serving_compare as scmp
from kvviz.charts import serving_data as sd
from kvviz.engine.serving.records import RequestRecord, Scheduled, StepRecord

IDS = ("A", "B", "C")
BS = 4


def _step(step: int, scheduled: tuple[Scheduled, ...], running: tuple[str, ...], waiting: tuple[str, ...],
          finished: tuple[str, ...], preempted: tuple[str, ...], owners: tuple[tuple[str, ...], ...],
          states: tuple[str, ...], used: int, cached: int, tokens: int, queries: int, hits: int) -> StepRecord:
    return StepRecord(step=step, t_ms=10.0 * (step + 1), forward_ms=5.0 if scheduled else 0.0, scheduled=scheduled,
                      budget=8, running=running, waiting=waiting, finished=finished, preempted=preempted,
                      blocks_total=8, blocks_used=used, blocks_cached=cached, blocks_free=8 - used - cached,
                      tokens_in_blocks=tokens, block_owner=owners, block_state=states,
                      prefix_query_tokens=queries, prefix_hit_tokens=hits)


E: tuple[str, ...] = ()
STEPS = [
    _step(0, (Scheduled("A", "prefill", 0, 6), Scheduled("B", "prefill", 0, 2)), ("A", "B"), E, E, E,
          (("A",), ("A",), ("B",), E, E, E, E, E), ("used",) * 3 + ("free",) * 5, 3, 0, 8, 11, 0),
    _step(1, (Scheduled("A", "decode", 6, 1), Scheduled("B", "prefill", 2, 3)), ("A", "B"), ("C",), E, E,
          (("A",), ("A",), ("B",), ("B",), E, E, E, E), ("used",) * 4 + ("free",) * 4, 4, 0, 12, 11, 0),
    _step(2, (Scheduled("A", "decode", 7, 1),), E, ("B", "C"), ("A",), ("B",),
          (E,) * 8, ("cached", "cached", "cached") + ("free",) * 5, 0, 3, 0, 11, 0),
    _step(3, (Scheduled("B", "prefill", 4, 2, prefix_hit_tokens=4), Scheduled("C", "prefill", 0, 3)), ("C",), E,
          ("B",), E, (E, E, E, E, ("C",), E, E, E), ("cached",) * 3 + ("free", "used") + ("free",) * 3,
          1, 3, 3, 20, 4),
    _step(4, (Scheduled("C", "decode", 3, 1),), E, E, ("C",), E, (E,) * 8,
          ("cached",) * 3 + ("free",) * 5, 0, 3, 0, 20, 4),
]
REQUESTS = {
    "A": RequestRecord("A", 6, 3, 0, output_ids=[11, 12, 13], state="finished", admitted_step=0, first_token_step=0,
                       finished_step=2, arrival_ms=0.0, first_token_ms=10.0, finished_ms=30.0,
                       token_ms=[10.0, 20.0, 30.0], finish_reason="length"),
    "B": RequestRecord("B", 5, 2, 0, output_ids=[21, 22], state="finished", admitted_step=0, first_token_step=1,
                       finished_step=3, arrival_ms=0.0, first_token_ms=20.0, finished_ms=40.0, token_ms=[20.0, 40.0],
                       preemptions=1, lost_tokens=5, prefix_hit_tokens=4, finish_reason="length"),
    "C": RequestRecord("C", 3, 2, 1, output_ids=[31, 32], state="finished", admitted_step=3, first_token_step=3,
                       finished_step=4, arrival_ms=10.0, first_token_ms=40.0, finished_ms=50.0, token_ms=[40.0, 50.0],
                       finish_reason="length"),
}
N = math.nan


def _same(a: np.ndarray, b: list[list[float]]) -> bool:
    return np.array_equal(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), equal_nan=True)


def test_request_states_by_hand() -> None:
    W, P, D, R = sd.WAITING, sd.PREFILL, sd.DECODE, sd.PREEMPTED
    z = sd.request_states(STEPS, IDS)
    assert z.dtype == np.float32
    assert _same(z, [[P, D, D, N, N],   # A: finished at step 2
                     [P, P, R, P, N],   # B: preempted at 2, recomputed at 3
                     [N, W, W, P, D]])  # C: arrived at 1


def test_a_running_request_left_out_of_a_step_is_idle_running() -> None:
    s = _step(0, (Scheduled("A", "decode", 3, 1),), ("A", "B"), E, E, E, (E,) * 8, ("free",) * 8, 0, 0, 0, 0, 0)
    assert _same(sd.request_states([s], ("A", "B")), [[sd.DECODE], [sd.IDLE_RUNNING]])


def test_series_by_hand() -> None:
    s = sd.series(STEPS, BS)
    assert s["prefill"].tolist() == [8, 3, 0, 5, 0]
    assert s["decode"].tolist() == [0, 1, 1, 0, 1]
    assert s["running"].tolist() == [2, 2, 0, 1, 0] and s["waiting"].tolist() == [0, 1, 2, 0, 0]
    # by blocks: used / 8; by tokens: written / 32 slots; waste: used * 4 - written
    assert s["usage_blocks_pct"].tolist() == [37.5, 50.0, 0.0, 12.5, 0.0]
    assert s["usage_tokens_pct"].tolist() == [25.0, 37.5, 0.0, 9.375, 0.0]
    assert s["waste_tokens"].tolist() == [4, 4, 0, 1, 0]
    assert s["hit_rate_pct"].tolist() == [0.0, 0.0, 0.0, 20.0, 20.0]
    assert np.isnan(sd.series([_step(0, (), E, E, E, E, (E,) * 8, ("free",) * 8, 0, 0, 0, 0, 0)], BS)["hit_rate_pct"][0])


def test_percentiles_are_numpys_linear_ones() -> None:
    # [10, 20, 30]: p90 sits 0.8 of the way from 20 to 30 (rank 0.9 * 2 = 1.8), p99 at rank 1.98.
    assert sd.percentiles([10.0, None, 30.0, 20.0]) == pytest.approx((20.0, 28.0, 29.8))
    assert sd.percentiles([None, None]) == (None, None, None)


def test_summary_by_hand() -> None:
    s = sd.summarize(STEPS, REQUESTS)
    assert (s.requests, s.finished, s.output_tokens) == (3, 3, 7)
    assert s.duration_ms == 50.0 and s.throughput_tok_s == pytest.approx(140.0)  # 7 tokens in 0.05 s
    assert s.ttft_ms == pytest.approx((20.0, 28.0, 29.8))  # 10, 20, 30
    assert s.tpot_ms == pytest.approx((10.0, 18.0, 19.8))  # 10, 20, 10
    assert s.e2e_ms == pytest.approx((40.0, 40.0, 40.0))  # 30, 40, 40
    assert (s.preemptions, s.lost_tokens, s.prefix_query_tokens, s.prefix_hit_tokens) == (1, 5, 20, 4)
    # running during a step = running after it + those that finished in it: 2, 2, 1, 2, 1
    assert (s.peak_running, s.peak_blocks_used, s.steps) == (2, 4, 5)


def test_timeline_figure_carries_the_states() -> None:
    fig = sc.timeline(STEPS, IDS, upto=2)
    heat = fig.data[0]
    assert _same(heat.z, sd.request_states(STEPS, IDS).tolist()) and list(heat.y) == list(IDS)
    assert heat.customdata[1][2] == "preempted (waiting to recompute)"
    done = next(t for t in fig.data if t.name == "finished")
    assert done.x.tolist() == [2, 3, 4] and list(done.y) == ["A", "B", "C"]
    assert [t.name for t in fig.data[1:6]] == list(sc.LEGEND_NAMES)
    assert fig.layout.shapes[0].x0 == 2
    fig.to_json()


def test_pool_grid_colours_each_block_by_owner() -> None:
    shared = _step(0, (), ("A", "B"), E, E, E, (("A",), ("A", "B"), ("B",), E, E, E, E, E),
                   ("used", "shared", "used", "cached", "free", "free", "free", "free"), 3, 1, 9, 0, 0)
    fig = sc.pool_grid(shared, IDS, BS)
    z = fig.data[0].z
    assert z.shape == (1, 16)  # 8 blocks, 16 a row
    # codes: 0 free, 1 cached, 2 shared, 3 + the owner's place in IDS
    assert _same(z[0, :8], [3, 2, 4, 1, 0, 0, 0, 0]) and np.isnan(z[0, 8:]).all()
    assert fig.data[0].customdata[0][1] == "block 1: shared by A, B"
    assert "3 used, 1 cached, 4 free" in fig.layout.title.subtitle.text
    big = _step(0, (), E, E, E, E, (E,) * 512, ("free",) * 512, 0, 0, 0, 0, 0)
    assert sc.pool_grid(big, IDS, BS).data[0].z.shape == (16, 32)  # 512 blocks: 32 a row


def test_step_composition_queues_usage_and_hits() -> None:
    comp = sc.step_composition(STEPS)
    assert [t.y.tolist() for t in comp.data] == [[8, 3, 0, 5, 0], [0, 1, 1, 0, 1], [8] * 5]
    q = sc.queues(STEPS)
    assert q.data[0].y.tolist() == [2, 2, 0, 1, 0] and q.data[1].y.tolist() == [0, 1, 2, 0, 0]
    assert q.data[2].x.tolist() == [2] and q.data[2].y.tolist() == [1]  # the one preemption
    kv = sc.kv_usage(STEPS, BS)
    assert kv.data[0].y.tolist() == [25.0, 37.5, 0.0, 9.375, 0.0]
    assert kv.data[1].y.tolist() == [37.5, 50.0, 0.0, 12.5, 0.0] and kv.data[1].customdata.tolist() == [4, 4, 0, 1, 0]
    hits = sc.prefix_hit_rate(STEPS)
    assert hits.data[0].y.tolist() == [0, 0, 0, 20, 20]
    assert hits.layout.title.subtitle.text == "4 of 20 prompt tokens found cached"
    for fig in (comp, q, kv, hits):
        assert all(t.y.dtype == np.float32 for t in fig.data)
        fig.to_json()


def test_latency_percentiles_figure() -> None:
    fig = sc.latency_percentiles(REQUESTS)
    assert list(fig.data[0].x) == ["TTFT", "TPOT", "end to end"]
    assert fig.data[0].y.tolist() == pytest.approx([20.0, 10.0, 40.0])  # p50s
    assert fig.data[1].y.tolist() == pytest.approx([28.0, 18.0, 40.0])  # p90s
    assert fig.data[2].y.tolist() == pytest.approx([29.8, 19.8, 40.0])  # p99s


def test_policy_comparison() -> None:
    cont = sd.summarize(STEPS, REQUESTS)
    slow = sd.RunSummary(**{**cont.__dict__, "throughput_tok_s": 35.0, "ttft_ms": (40.0, None, 90.0)})
    fig = scmp.policy_comparison({"sequential": slow, "continuous": cont})
    tp = [t for t in fig.data if t.xaxis == "x"]
    assert [t.y.tolist() for t in tp] == [[35.0], [140.0]] and [t.text[0] for t in tp] == ["35.0", "140.0"]
    ttft = [t for t in fig.data if t.xaxis == "x2"]
    assert list(ttft[0].x) == ["p50", "p90", "p99"]
    assert ttft[0].y[0] == 40.0 and np.isnan(ttft[0].y[1]) and ttft[0].y[2] == 90.0  # a gap, never 0
    assert ttft[1].y.tolist() == pytest.approx([20.0, 28.0, 29.8])
    tpot = [t for t in fig.data if t.xaxis == "x3"]
    assert tpot[1].y.tolist() == pytest.approx([10.0, 18.0, 19.8])
    assert [t.name for t in ttft] == ["one at a time", "continuous batching"]


def test_exports() -> None:
    rows = list(csv.DictReader(io.StringIO(sd.requests_csv(REQUESTS))))
    assert [r["id"] for r in rows] == ["A", "B", "C"]
    assert rows[1]["TTFT ms"] == "20.0" and rows[1]["preemptions"] == "1" and rows[1]["prefix hit tokens"] == "4"
    assert rows[2]["TTFT ms"] == "30.0" and rows[2]["E2E ms"] == "40.0" and rows[0]["output tokens"] == "3"
    lines = [json.loads(x) for x in sd.events_jsonl(STEPS, REQUESTS).splitlines()]
    assert [x["event"] for x in lines] == ["step"] * 5 + ["request"] * 3
    assert lines[3]["scheduled"][0] == {"request_id": "B", "kind": "prefill", "start": 4, "num_tokens": 2,
                                        "prefix_hit_tokens": 4}
    assert lines[6]["request_id"] == "B" and lines[6]["lost_tokens"] == 5 and lines[6]["tpot_ms"] == 20.0


def test_the_paragraph_names_readmissions_counted_apart() -> None:
    """vLLM 0.33 counts a re-admission after a preemption outside prefix_cache_queries/hits; the page's
    paragraph gives those tokens separately, and says nothing of them when there were none."""
    from dataclasses import replace

    from kvviz.engine.serving.engine import ServeResult
    from kvviz.ui.pages.serving.serving_views import paragraph

    steps = STEPS[:-1] + [replace(STEPS[-1], preempted_query_tokens=6, preempted_hit_tokens=4)]
    reqs = list(REQUESTS.values())
    text = paragraph(sd.summarize(steps, REQUESTS), ServeResult({}, reqs, steps, [], None, {}, 0), BS, 8)
    assert "4 of 20 prompt tokens (20.0%)" in text
    assert "the 6 tokens of re-admissions after a preemption, 4 of them found cached, are counted apart" in text
    plain = paragraph(sd.summarize(STEPS, REQUESTS), ServeResult({}, reqs, STEPS, [], None, {}, 0), BS, 8)
    assert "re-admissions" not in plain and "last token). **Preemption**" in plain


def test_the_paragraph_counts_the_blocks_a_window_gave_back() -> None:
    from dataclasses import replace

    from kvviz.engine.serving.engine import ServeResult
    from kvviz.ui.pages.serving.serving_views import paragraph

    steps = STEPS[:-1] + [replace(STEPS[-1], window_freed_blocks=12)]
    text = paragraph(sd.summarize(steps, REQUESTS), ServeResult({}, list(REQUESTS.values()), steps, [], None, {}, 0),
                     BS, 8)
    assert "at most 4 of 8 blocks; its sliding-window layers gave back 12 blocks before their requests ended" in text
    assert "gave back" not in paragraph(sd.summarize(STEPS, REQUESTS),
                                        ServeResult({}, list(REQUESTS.values()), STEPS, [], None, {}, 0), BS, 8)
