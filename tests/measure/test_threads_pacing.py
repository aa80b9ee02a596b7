"""The app's thread rule (kvviz.measure.threads) and the live loop's pacing (kvviz.ui.pages.generate.pacing): plain values."""
from __future__ import annotations

import pytest

from kvviz.measure import threads
from kvviz.measure.threads import MAX_RULE_THREADS, choose
from kvviz.ui.pages.generate import pacing
from kvviz.ui.pages.generate.pacing import MAX_GAP_CAP_S, LiveCost, Pacer


@pytest.fixture(autouse=True)
def fresh_estimates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from the process's first guesses (a Pacer learns what draws cost, process-wide)."""
    monkeypatch.setattr(pacing, "_last_cost", dict(pacing.FIRST_GUESSES))
    monkeypatch.setattr(pacing, "_prices", pacing.no_prices())


@pytest.mark.parametrize("cores, torch_default, want", [
    (1, 1, 1), (2, 2, 1), (4, 4, 3), (8, 4, 4), (16, 16, 8), (64, 32, MAX_RULE_THREADS),
])
def test_rule_leaves_a_core_for_the_browser(cores: int, torch_default: int, want: int) -> None:
    c = choose(cores, torch_default, {})
    assert (c.threads, c.source) == (want, "rule")
    assert f"{cores} CPU core" in c.describe() and f"{want} thread" in c.describe()
    assert c.spare_cores == cores - want  # one core: none spare (the live run lets the browser draw first)


def test_overrides_and_bad_values() -> None:
    assert choose(2, 2, {"KVVIZ_THREADS": "2"}).threads == 2
    assert choose(2, 2, {"KVVIZ_THREADS": "4"}).spare_cores == 0  # more threads than cores: none spare, not -2
    assert choose(2, 2, {"KVVIZ_THREADS": " 3 "}).source == "KVVIZ_THREADS"
    omp = choose(4, 4, {"OMP_NUM_THREADS": "4"})  # torch already obeys it: keep its count
    assert (omp.threads, omp.source) == (4, "OMP_NUM_THREADS") and "set by OMP_NUM_THREADS" in omp.describe()
    for bad in ("0", "-1", "two", ""):
        c = choose(2, 2, {"KVVIZ_THREADS": bad})
        assert (c.threads, c.source) == (1, "rule") and "was ignored" in c.describe()


def simulate(p: Pacer, steps: int, step_s: float, text_s: float, numbers_s: float, chart_s: float,
             after_draw: tuple[float, int] = (0.0, 0)) -> tuple[float, list[tuple[float, str]]]:
    """Run ``steps`` engine steps of ``step_s`` through the pacer with draws of the given costs;
    the end time and every draw (when, what). ``after_draw`` (extra s, steps): a browser drawing on
    the engine's core makes that many steps after each draw that much slower."""
    t, engine, drawn, slowed = 0.0, 0.0, [], 0
    for step in range(steps):
        took_step = step_s + (after_draw[0] if slowed > 0 else 0.0)
        slowed -= 1
        t += took_step
        engine += took_step
        due = p.due(t, engine, steps_left=steps - step - 1)
        if due.text:
            took = text_s + (numbers_s if due.numbers else 0.0) + (chart_s if due.charts else 0.0)
            p.drew(t, t + took, due.charts, due.numbers)
            drawn.append((t, "charts" if due.charts else "numbers" if due.numbers else "text"))
            t += took
            slowed = after_draw[1]
    p.finish(t, engine)
    return t, drawn


def test_pacer_keeps_the_views_within_their_share() -> None:
    """SmolLM2 in the app (16 ms a token, 600 tokens) with draws costing 3 ms (text), 2 ms more
    (numbers) and 100 ms more (charts): at most a twentieth of the time goes to the views, the text
    moves about ten times a second, the numbers about once, the charts once a second at most and
    never in the run's last 0.6 s, and the first step's text is drawn at once without charts.
    (A 200-token run, 3.2 s, cannot pay for a 100 ms chart frame out of a twentieth: its charts
    come with the finished run's redraw.)"""
    p = Pacer(0.0)
    end, drawn = simulate(p, 600, 0.016, 0.003, 0.002, 0.100)
    assert drawn[0] == (0.016, "numbers")  # the prompt and the first token at once; charts when paid for
    assert p.cost.share <= 0.05 + 1e-9, p.cost
    assert 20 <= p.cost.text_draws <= 1.1 * end / 0.1, p.cost  # ~10 a second, fewer where charts took the share
    charts = [t for t, what in drawn if what == "charts"]
    assert 1 <= len(charts) <= end / 1.0
    assert all(b - a >= 1.0 for a, b in zip(charts, charts[1:]))  # what a small machine's browser can draw
    assert charts[-1] <= end - 0.6  # the finished run's redraw draws the last frame
    numbers = [t for t, what in drawn if what == "numbers"]  # (a chart frame redraws them too)
    assert len(numbers) >= 4 and all(b - a >= 1.0 for a, b in zip(numbers, numbers[1:]))
    assert "the engine alone ran 62" in p.cost.sentence(600)
    short = Pacer(0.0)
    simulate(short, 200, 0.016, 0.003, 0.002, 0.100)
    assert short.cost.chart_draws == 0 and short.cost.share <= 0.05 + 1e-9 and short.cost.text_draws >= 20


def test_a_fast_engine_streams_its_text_and_affords_charts() -> None:
    """A tiny model (1 ms a token, 5,000 tokens): text ten times a second, and charts where a text
    redraw leaves room in the twentieth (2 ms a redraw: 2% of the time); where the text alone takes
    it (5 ms, 10 a second), the charts wait for the finished run."""
    p = Pacer(0.0)
    end, drawn = simulate(p, 5000, 0.001, 0.002, 0.0, 0.040)
    assert p.cost.share <= 0.05 + 1e-9
    assert p.cost.text_draws >= 40 and p.cost.chart_draws >= 1
    assert "the engine alone ran 1,000" in p.cost.sentence(5000)
    full = Pacer(0.0)
    simulate(full, 5000, 0.001, 0.005, 0.0, 0.040)
    assert full.cost.share <= 0.05 + 1e-9 and full.cost.text_draws >= 40 and full.cost.chart_draws == 0


def test_pacer_draws_every_token_when_presenting_and_never_goes_quiet() -> None:
    p = Pacer(0.0, every_token=True)
    dues = [p.due(0.2 * i, 0.0) for i in range(1, 20)]
    assert all(d.text and d.numbers for d in dues)  # the loop waits for each token anyway
    for i, d in enumerate(dues, start=1):
        if d.charts:
            p.drew(0.2 * i, 0.2 * i, True, True)
    p2 = Pacer(0.0, every_token=True)
    charts = []
    for i in range(1, 20):
        d = p2.due(0.2 * i, 0.0)
        if d.charts:
            charts.append(0.2 * i)
            p2.drew(0.2 * i, 0.2 * i, True, True)
    assert charts[0] == 0.2 and all(b - a >= 0.5 - 1e-9 for a, b in zip(charts, charts[1:]))  # the browser keeps up
    slow = Pacer(0.0)  # everything is overhead (a capture-heavy model): still a redraw every max_gap
    slow.drew(0.0, 0.01, True)
    assert not slow.due(0.1, 0.0).text and slow.due(0.6, 0.0).text


def test_live_cost_round_trips_through_run_meta() -> None:
    c = LiveCost(wall_s=2.0, engine_s=1.6, text_draws=40, chart_draws=9, draw_s=0.3)
    assert LiveCost(**c.as_dict()) == c
    assert c.share == pytest.approx(0.2)
    assert "charts 9×" in c.sentence(200) and "100 end-to-end tokens/s" in c.sentence(200)


def test_the_browsers_price_is_measured_and_stretches_the_redraws() -> None:
    """One core shared with the browser (measured: the 3-5 steps after a redraw 15-25 ms slower than
    the 11-12 ms of the others): 4 steps 20 ms slower after each draw, an 80 ms price. The pacer
    measures it from the step times alone, counts it in the run's cost, and spaces the text so that
    the views (server and browser) keep to a twentieth: (5 ms + 80 ms) / 0.05 = 1.7 s apart."""
    p = Pacer(0.0)
    end, drawn = simulate(p, 600, 0.012, 0.005, 0.002, 0.100, after_draw=(0.020, 4))
    measured = len(drawn) - 1  # the first draw comes before any quiet step to compare with
    # (the last draw's slowed steps may run past the end of the run)
    assert 0.080 * (measured - 1) - 1e-9 <= p.cost.browser_s <= 0.080 * measured + 1e-9, p.cost
    assert Pacer(0.0)._est_browser == pytest.approx(0.080, rel=0.05)  # the next run starts from it
    later = [t for t, _ in drawn[2:]]  # from the first measured price on
    assert len(later) >= 4 and all(1.6 <= b - a <= 1.85 for a, b in zip(later, later[1:])), drawn
    assert (p.cost.overhead_s + p.cost.browser_s) / end <= 0.065, p.cost  # the first two draws before the price was known
    assert "slowed the forwards by about" in p.cost.sentence(600)
    # The same machine with a core to spare: no price, the text every max_gap as before.
    pacing._prices["text"].clear()
    free = Pacer(0.0)
    _, drawn_free = simulate(free, 400, 0.012, 0.005, 0.002, 0.100)
    assert free.cost.browser_s == 0.0 and free._est_browser == 0.0
    gaps = [b - a for (a, _), (b, _) in zip(drawn_free[2:], drawn_free[3:])]
    assert gaps and all(b <= 0.5 + 0.012 + 0.01 for b in gaps), gaps
    assert "slowed the forwards" not in free.cost.sentence(400)


def test_a_dear_browser_waits_at_most_the_cap() -> None:
    """A browser whose redraw costs the engine 0.2 s (a twentieth would space them 4.1 s apart):
    the text still moves every MAX_GAP_CAP_S."""
    p = Pacer(0.0)
    _, drawn = simulate(p, 800, 0.012, 0.005, 0.0, 0.100, after_draw=(0.050, 4))
    assert p.max_gap_now() == MAX_GAP_CAP_S
    later = [t for t, _ in drawn[2:]]
    assert len(later) >= 3 and all(MAX_GAP_CAP_S <= b - a <= MAX_GAP_CAP_S + 0.3 for a, b in zip(later, later[1:])), drawn


def test_one_hiccup_does_not_stretch_the_gaps() -> None:
    """The price is the median of the last three measured: one interval slowed by something else
    (a 60 ms hiccup) leaves the text every max_gap; a price paid twice running counts."""
    p = Pacer(0.0)
    pacing._prices["text"].extend([0.0, 0.0])
    pacing._prices["text"].append(0.060)
    assert p._est_browser == 0.0 and p.max_gap_now() == pytest.approx(0.5)
    pacing._prices["text"].append(0.060)
    assert p._est_browser == pytest.approx(0.060) and p.max_gap_now() == pytest.approx((0.005 + 0.060) / 0.05)


def test_no_spare_core_starts_from_a_guessed_price() -> None:
    """A process's first live run, before any price is measured: with a core to spare the text moves
    every max_gap; where the model's threads take every core, the browser's drawing will slow the
    engine, so the first run already spaces its text as if a redraw cost NO_SPARE_CORE_PRICE_S:
    (5 ms + 80 ms) / 0.05 = 1.7 s apart, not 0.5 s (measured: the first run on one core redrew 5
    times in 2 s, the next ones 2-3). Once measured, the measured price rules."""
    free = Pacer(0.0, spare_cores=1)
    assert free._est_browser == 0.0 and free.max_gap_now() == pytest.approx(0.5)
    busy = Pacer(0.0, spare_cores=0)
    assert busy._est_browser == pacing.NO_SPARE_CORE_PRICE_S == 0.08
    assert busy.max_gap_now() == pytest.approx((0.005 + 0.08) / 0.05)
    # 300 steps of 10 ms with a browser that costs nothing measurable: drawn at the first step, then
    # at most every 1.7 s until the first price is measured.
    _, drawn = simulate(busy, 300, 0.010, 0.005, 0.002, 0.100)
    _, drawn_free = simulate(Pacer(0.0, spare_cores=1), 300, 0.010, 0.005, 0.002, 0.100)
    assert len(drawn) < len(drawn_free), (drawn, drawn_free)
    assert drawn[1][0] - drawn[0][0] >= 1.7 - 0.011, drawn
    # measured now (a free browser: 0), the next run on the same machine follows the measurement
    assert Pacer(0.0, spare_cores=0)._est_browser == 0.0
    assert Pacer(0.0, spare_cores=None)._est_browser == 0.0


def test_the_last_draw_is_priced_once_it_settled() -> None:
    """On one core a 200-token run redraws once after its first token (the first draw comes before any
    quiet step to compare with), so the run's last draw is its only measured one: its price, 4 steps
    22.5 ms slower (90 ms), joins the estimate once three quiet steps followed it, and the next run
    spaces its text by it. A run that ends two steps after its last draw cut the price short: it is
    counted in the run's cost but not learnt."""
    p = Pacer(0.0, spare_cores=0)
    _, drawn = simulate(p, 300, 0.010, 0.005, 0.0, 0.100, after_draw=(0.0225, 4))
    assert len(drawn) == 2 and p.cost.browser_s == pytest.approx(0.090), (drawn, p.cost)
    assert Pacer(0.0, spare_cores=0)._est_browser == pytest.approx(0.090)  # learnt, not the 80 ms guess
    assert Pacer(0.0).max_gap_now() == pytest.approx((0.005 + 0.090) / 0.05)
    pacing._prices["text"].clear()
    cut = Pacer(0.0, spare_cores=0)
    t, engine = 0.0, 0.0
    for step in range(175):  # the forced redraw 1.7 s after the first, then the run ends 2 slowed steps later
        took = 0.010 + (0.025 if cut.cost.text_draws == 2 else 0.0)
        t, engine = t + took, engine + took
        due = cut.due(t, engine)
        if due.text:
            cut.drew(t, t + 0.005, due.charts, due.numbers)
            t += 0.005
            if cut.cost.text_draws == 2:
                break
    for _ in range(2):
        t, engine = t + 0.035, engine + 0.035
        assert not cut.due(t, engine).text
    cut.finish(t, engine)
    assert cut.cost.text_draws == 2 and cut.cost.browser_s == pytest.approx(0.050), cut.cost
    assert not pacing._prices["text"] and Pacer(0.0, spare_cores=0)._est_browser == pacing.NO_SPARE_CORE_PRICE_S


def test_no_forced_redraw_just_before_the_end() -> None:
    """A dear browser (a redraw measured at 0.2 s of engine time: the text forced every MAX_GAP_CAP_S).
    In a 2.5 s run the forced redraw would fall 2.0 s in, 0.5 s before the end, whose final redraw
    shows the same a moment later: it is skipped (TAIL_S 0.6). In a 4 s run it is drawn at 2.0 s."""
    pacing._prices["text"].extend([0.2, 0.2, 0.2])
    short = Pacer(0.0)
    _, drawn = simulate(short, 250, 0.010, 0.005, 0.0, 0.100)
    assert short.max_gap_now() == MAX_GAP_CAP_S and len(drawn) == 1, drawn  # the first token's only
    long = Pacer(0.0)
    _, drawn = simulate(long, 400, 0.010, 0.005, 0.0, 0.100)
    assert len(drawn) >= 2 and 2.0 <= drawn[1][0] - drawn[0][0] <= 2.0 + 0.011, drawn


class SharedCore:
    """A fake clock for ``wait_for_core``: each reading moves time on by 1 ms, and this thread runs
    half of it while the browser draws (until ``busy_until``; with ``frame`` (period, drawn), only the
    first ``drawn`` s of every ``period``: a browser drawing frame by frame, idle between), all of it
    after; a sleep runs none."""

    def __init__(self, busy_until: float, frame: tuple[float, float] | None = None) -> None:
        self.t, self.ran, self.busy_until, self.frame = 0.0, 0.0, busy_until, frame

    def drawing(self) -> bool:
        if self.t > self.busy_until:
            return False
        return self.frame is None or self.t % self.frame[0] < self.frame[1]

    def clock(self) -> float:
        self.t += 0.001
        self.ran += 0.0005 if self.drawing() else 0.001
        return self.t

    def cpu(self) -> float:
        return self.ran

    def sleep(self, s: float) -> None:
        self.t += s


LOOKS_S = threads.FREE_LOOKS * (threads.PROBE_S + 0.002) + (threads.FREE_LOOKS - 1) * threads.REST_S  # a free core's looks


@pytest.mark.parametrize("busy_until, frame, low, high", [
    (0.0, None, threads.REST_S, threads.REST_S + LOOKS_S + 0.005),  # a free core: one rest, the looks in a row
    (0.1, None, 0.1, 0.1 + threads.REST_S + LOOKS_S + 0.01),  # the browser draws for 0.1 s: the wait ends soon after it
    # frame by frame for 0.3 s, 20 ms of every 50 ms: one look in an idle moment does not end the wait
    (0.3, (0.05, 0.02), 0.3, 0.3 + threads.REST_S + LOOKS_S + 0.01),
    (9.0, None, threads.WAIT_LIMIT_S, threads.WAIT_LIMIT_S + threads.REST_S + 0.02),  # it never stops: the limit
])
def test_wait_for_core_waits_while_the_browser_draws(busy_until: float, frame: tuple[float, float] | None,
                                                     low: float, high: float) -> None:
    core = SharedCore(busy_until, frame)
    waited = threads.wait_for_core(clock=core.clock, cpu=core.cpu, sleep=core.sleep)
    assert low <= waited <= high, waited


def test_the_wait_is_said_under_the_run() -> None:
    cost = Pacer(0.0, spare_cores=0, waited_s=0.21).finish(2.0, 1.8)
    assert cost.as_dict()["waited_s"] == 0.21
    assert "left its only core to the browser for 0.21 s" in cost.sentence(200)
    assert "left its only core" not in Pacer(0.0).finish(2.0, 1.8).sentence(200)
    assert LiveCost(**{k: v for k, v in cost.as_dict().items() if k != "waited_s"}).waited_s == 0.0  # older runs
