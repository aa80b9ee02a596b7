"""The app's thread rule (kvviz.measure.threads) and the live loop's pacing (kvviz.ui.pacing): plain values."""
from __future__ import annotations

import pytest

from kvviz.measure.threads import MAX_RULE_THREADS, choose
from kvviz.ui.pacing import LiveCost, Pacer


@pytest.mark.parametrize("cores, torch_default, want", [
    (1, 1, 1), (2, 2, 1), (4, 4, 3), (8, 4, 4), (16, 16, 8), (64, 32, MAX_RULE_THREADS),
])
def test_rule_leaves_a_core_for_the_browser(cores: int, torch_default: int, want: int) -> None:
    c = choose(cores, torch_default, {})
    assert (c.threads, c.source) == (want, "rule")
    assert f"{cores} CPU core" in c.describe() and f"{want} thread" in c.describe()


def test_overrides_and_bad_values() -> None:
    assert choose(2, 2, {"KVVIZ_THREADS": "2"}).threads == 2
    assert choose(2, 2, {"KVVIZ_THREADS": " 3 "}).source == "KVVIZ_THREADS"
    omp = choose(4, 4, {"OMP_NUM_THREADS": "4"})  # torch already obeys it: keep its count
    assert (omp.threads, omp.source) == (4, "OMP_NUM_THREADS") and "set by OMP_NUM_THREADS" in omp.describe()
    for bad in ("0", "-1", "two", ""):
        c = choose(2, 2, {"KVVIZ_THREADS": bad})
        assert (c.threads, c.source) == (1, "rule") and "was ignored" in c.describe()


def test_pacer_keeps_the_views_within_their_share() -> None:
    """A fast engine (1 ms a token) and draws that cost 5 ms (text) and 40 ms (charts): the draws
    must stay near a fifth of the wall time, the text must still move, the first step is drawn."""
    t, engine = 0.0, 0.0
    p = Pacer(0.0)
    for step in range(2000):
        t += 0.001
        engine += 0.001
        text, charts = p.due(t, engine)
        if step == 0:
            assert text and not charts  # the first token's text at once; charts when the budget pays
        if text:
            took = 0.005 + (0.040 if charts else 0.0)
            p.drew(t, t + took, charts)
            t += took
    cost = p.finish(t, engine)
    assert cost.share <= 0.22, cost
    assert cost.text_draws > 20 and cost.chart_draws > 3
    assert "the engine alone ran 1,000" in cost.sentence(2000)


def test_pacer_draws_every_token_when_presenting_and_never_goes_quiet() -> None:
    p = Pacer(0.0, every_token=True)
    assert all(p.due(0.1 * i, 0.0)[0] for i in range(1, 20))
    slow = Pacer(0.0)  # everything is overhead (a capture-heavy model): still a redraw every max_gap
    slow.drew(0.0, 0.01, True)
    assert not slow.due(0.1, 0.0)[0] and slow.due(0.6, 0.0)[0]


def test_live_cost_round_trips_through_run_meta() -> None:
    c = LiveCost(wall_s=2.0, engine_s=1.6, text_draws=40, chart_draws=9, draw_s=0.3)
    assert LiveCost(**c.as_dict()) == c
    assert c.share == pytest.approx(0.2)
    assert "charts 9×" in c.sentence(200) and "100 tokens/s" in c.sentence(200)
