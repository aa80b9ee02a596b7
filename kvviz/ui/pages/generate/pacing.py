"""When the live loop redraws: the live views' share of the time, spent on purpose.

Pure Python (no streamlit), so the policy is tested with plain numbers. The live views have two
prices, and the policy pays both (measured on the project's 2-core machine, SmolLM2, 200 tokens,
Chromium on the same machine; docs/benchmarks.md):

- **The server's**: everything the loop does besides the engine's own work: capturing attention
  and K/V after each step, building the chips and figures, and Streamlit sending them. The loop
  measures it directly, as its wall time minus the forwards' measured time, and draws only while
  it stays within ``share`` of the wall time. A twentieth (a tenth until issue 42 asked for 0.9x):
  alternated with a tenth on SmolLM2 (200 tokens, 1 model thread, Chromium on the same 2 cores),
  the text moved 6-12 times a run instead of 23-28, Chromium's main thread was busy 1.6-2.1 s
  instead of 2.4-3.2 s, and the app's forwards ran at 0.90-0.96x the engine alone instead of
  0.85-0.89x: what the browser draws slows the engine beside it (docs/benchmarks.md).
- **The browser's**, which the server cannot see: a chart frame (four Plotly figures, each
  plotted twice by Streamlit) kept Chromium's main thread busy 0.6-1.0 s, in long tasks of
  150-480 ms, until the charts were laid out once (12a47cd); about 0.5 s since. A text redraw
  takes it about 30 ms. Seven chart frames in a 4.4 s run left the page 2.5 s behind the engine
  (the done marker shown 7.0 s after the click, the loop over at 4.4 s); with text alone it kept up. So charts are redrawn at most once a second,
  and not in the last ``tail`` seconds a run is expected to take (its end draws them anyway).

Within that:
- the first step's text is drawn at once (the prompt and the first token, as soon as they exist);
- the text at most every ``text_interval`` s (ten times a second reads as a stream), the numbers
  with it at most every ``numbers_interval`` s;
- a chart frame only when the share can pay for it, judged by what the last frame cost in this
  process; a run too short to afford one shows its charts when it ends;
- every interval ``load`` times longer with ``load`` runs live in the process, so a busy server
  sends its browsers about what one run would;
- whatever the share says, the text at least every ``max_gap`` s, so a slow, capture-heavy
  model still shows signs of life; stretched, up to ``MAX_GAP_CAP_S``, where the browser's own
  price shows (below), so that even these draws stay within the share; none of these forced
  redraws when the run should end within ``tail`` (its final redraw follows as soon: on one core
  a forced redraw 0.2 s before the end slowed the last 20 steps from about 10 ms to 13.7-15);
- presenting (a slowed-down run, ``every_token``) draws every token's text and numbers, and the
  charts every ``PRESENT_CHART_INTERVAL_S``: the loop waits anyway, and the browser must keep up.

**The browser's price, where the server can feel it.** Where the browser has no core of its own (a
1-core machine, or a busy one), its drawing takes the engine's core: on one core of the project's
machine the 3-5 steps after each text redraw took 15-25 ms longer than the 11-12 ms of the others,
about 75 ms a redraw, 15% of a run redrawn twice a second. The pacer measures that: the steps
beginning more than ``SETTLE_S`` after a draw are quiet, the mean of the last ``QUIET_STEPS`` of them
is the undisturbed step time, and what the steps between one draw and the next took beyond it is that
draw's price in engine time (``LiveCost.browser_s``). Its running estimate joins the server's in
every decision; with a core to spare it is near zero and changes nothing. Text redrawn faster than
``SETTLE_S`` leaves no quiet step, so every ``PROBE_S`` one redraw waits for three. Until a price is
measured (a process's first live run), a machine whose model threads leave no core spare starts
from ``NO_SPARE_CORE_PRICE_S`` instead of nothing: the first run redrew 5 times where later ones
redrew 2-3, and was the slowest of its three in 3 of 3 benchmarks on one core (docs/benchmarks.md).
The last draw of a run is priced too, where three quiet steps followed it (a 200-token run on one
core has only that one), so the next run spaces its text by it.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

SHARE = 0.05  # the server's price: a twentieth of the loop's time (issue 42: the page at >= 0.9x the engine)
TEXT_INTERVAL_S = 0.1  # a tiny model makes 1,000 tokens/s; ten redraws a second read as a stream
# The numbers (six metric tiles and the formula, several deltas) cost the browser as much as the text:
# about 31 ms of Chromium's main thread each on the project's machine, most of it Streamlit
# re-rendering the whole page per delta (docs/benchmarks.md, 2026-11-29). Once a second is enough.
NUMBERS_INTERVAL_S = 1.0
CHART_INTERVAL_S = 1.0  # the browser's price: a chart frame keeps Chromium busy about 0.5 s on a small machine
PRESENT_CHART_INTERVAL_S = 0.5
TAIL_S = 0.6  # no chart frame when the run should end sooner: the finished run's redraw draws them
MAX_GAP_S = 0.5
MAX_GAP_CAP_S = 2.0  # the longest the text waits, however dear the browser's drawing is
SETTLE_S = 0.25  # a step beginning this soon after a draw may be paying for it: not a quiet step
QUIET_STEPS = 9  # the undisturbed step time: the mean of this many recent quiet steps (a median would
# count every step's ordinary hiccups, a right-skewed few tenths of a ms, as the browser's)
PROBE_S = 2.0  # with no quiet step for this long (text redrawn faster than SETTLE_S), the next text waits for some
# What the last draws cost, process-wide: the first live run of a process starts from these guesses.
FIRST_GUESSES = {"text": 0.005, "charts": 0.1}
_last_cost = dict(FIRST_GUESSES)
PRICES_KEPT = 3
# A text redraw's price in engine time before any is measured, where no core is spare for the browser:
# measured on one core (SmolLM2, the forced redraw with its numbers), a median of 80 ms over 93 runs
# (20-210; AMD EPYC with AVX-512, 2026-11-29) and 75 ms (AMD EPYC, AVX2). A text redraw alone took
# 30-40 ms of Chromium's main thread.
NO_SPARE_CORE_PRICE_S = 0.08


def no_prices() -> dict[str, deque[float]]:
    """An empty record of the browser's prices: the last ``PRICES_KEPT`` of each kind of draw."""
    return {"text": deque(maxlen=PRICES_KEPT), "charts": deque(maxlen=PRICES_KEPT)}


# The browser's price in engine time of the last few text redraws and chart frames, process-wide: the
# estimate is their median (none measured: 0), so one step's ordinary hiccup does not stretch the gaps.
_prices = no_prices()


def _price(kind: str, unmeasured: float = 0.0) -> float:
    """A draw's price in engine time ("text" or "charts"), as recently measured (``unmeasured`` until
    one is)."""
    return statistics.median(_prices[kind]) if _prices[kind] else unmeasured


@dataclass
class LiveCost:
    """What the live views cost in one run (kept in the run's meta and shown after it)."""

    wall_s: float = 0.0  # the loop, first step to last
    engine_s: float = 0.0  # the forwards and sampling, as the run's events measured them
    text_draws: int = 0
    chart_draws: int = 0
    draw_s: float = 0.0  # time spent inside the draw calls on the loop's thread
    browser_s: float = 0.0  # the engine's steps slower after the draws than before them (the browser's price)
    waited_s: float = 0.0  # before the loop, the core left to the browser (threads.wait_for_core; no core spare)

    @property
    def overhead_s(self) -> float:
        """The loop's time outside the forwards: capture, events and the draws on the server."""
        return max(0.0, self.wall_s - self.engine_s)

    @property
    def share(self) -> float:
        return self.overhead_s / self.wall_s if self.wall_s > 0 else 0.0

    def sentence(self, tokens: int) -> str:
        if self.wall_s <= 0 or tokens <= 0:
            return ""
        return (f"Live: {tokens:,} tokens in {self.wall_s:,.2f} s, of which the forwards took {self.engine_s:,.2f} s "
                f"and the live views {self.overhead_s:,.2f} s ({self.share:.0%}: text redrawn {self.text_draws:,}×, "
                f"charts {self.chart_draws:,}×): {tokens / self.wall_s:,.0f} end-to-end tokens/s on the page "
                f"(every token over the wall clock, prefill and views included) where the engine alone ran "
                f"{tokens / max(self.engine_s, 1e-9):,.0f} (the decode tokens/s above counts decode steps only)."
                + (f" The browser's drawing slowed the forwards by about {self.browser_s:,.2f} s (measured as the "
                   "steps after each redraw against the undisturbed ones)." if self.browser_s >= 0.01 else "")
                + (f" Before the prefill the engine left its only core to the browser for {self.waited_s:,.2f} s, "
                   "while it drew the page (not counted above)." if self.waited_s >= 0.01 else ""))

    def as_dict(self) -> dict[str, float]:
        return {"wall_s": round(self.wall_s, 4), "engine_s": round(self.engine_s, 4), "text_draws": self.text_draws,
                "chart_draws": self.chart_draws, "draw_s": round(self.draw_s, 4), "browser_s": round(self.browser_s, 4),
                "waited_s": round(self.waited_s, 4)}


@dataclass(frozen=True)
class Due:
    """What to redraw after a step: the text always when anything is drawn."""

    text: bool
    numbers: bool
    charts: bool


class Pacer:
    """Says, after each step, what to redraw (``Due``); told what each draw cost."""

    def __init__(self, t0: float, share: float = SHARE, text_interval: float = TEXT_INTERVAL_S,
                 chart_interval: float = CHART_INTERVAL_S, max_gap: float = MAX_GAP_S,
                 every_token: bool = False, numbers_interval: float = NUMBERS_INTERVAL_S,
                 tail: float = TAIL_S, spare_cores: int | None = None, waited_s: float = 0.0) -> None:
        self.t0 = t0
        self.share = share
        self.text_interval = text_interval
        self.numbers_interval = numbers_interval
        self.chart_interval = PRESENT_CHART_INTERVAL_S if every_token else chart_interval
        self.tail = tail
        self.max_gap = max_gap
        self.every_token = every_token
        # The price assumed until one is measured: the browser draws on the engine's cores where none is
        # spare (``spare_cores`` 0: cores this process may use minus the model's threads; None: unknown).
        self._unmeasured = NO_SPARE_CORE_PRICE_S if spare_cores is not None and spare_cores <= 0 else 0.0
        self.cost = LiveCost(waited_s=waited_s)
        self._steps = 0
        self._last_text = self._last_numbers = self._last_chart = float("-inf")
        self._est_text, self._est_chart = _last_cost["text"], _last_cost["charts"]  # what a draw of each kind costs
        self._engine_prev = 0.0
        self._quiet: deque[tuple[float, float]] = deque(maxlen=QUIET_STEPS)  # recent undisturbed steps: (end, s)
        self._quiet_since_draw = 0
        self._quiet_sum = 0.0  # of the step times in _quiet (a running sum: due() runs after every step)
        self._pending: float | None = None  # the steps since the last draw, beyond the quiet time (None: unmeasured)
        self._pending_chart = False  # the last draw was a chart frame

    @property
    def _est_browser(self) -> float:
        """A text redraw's price in engine time, as recently measured (the first guess until then)."""
        return _price("text", self._unmeasured)

    def _affordable(self, now: float, engine_s: float, est: float) -> bool:
        """Would one more draw costing ``est`` on the server (and the browser's measured price) keep
        the views within the share?"""
        wall = now - self.t0
        spent = (wall - engine_s) + self.cost.browser_s + max(0.0, self._pending or 0.0)
        return spent + est <= self.share * (wall + est)

    def max_gap_now(self) -> float:
        """The longest the text waits: ``max_gap``, or longer where a redraw (server and browser) costs
        more than a share of that gap, so the views' signs of life stay within the share too."""
        if self.every_token:
            return self.max_gap
        stretched = (self._est_text + self._est_browser) / self.share
        return min(max(self.max_gap, stretched), max(self.max_gap, MAX_GAP_CAP_S))

    def _observe(self, now: float, step_s: float) -> None:
        """Note one decode step's forward time: a quiet step, or part of the last draw's price."""
        if self._pending is not None and len(self._quiet) >= 3:
            self._pending += step_s - self._quiet_sum / len(self._quiet)
        if now - step_s - self._last_text > SETTLE_S:  # began after the last draw had settled
            if len(self._quiet) == self._quiet.maxlen:
                self._quiet_sum -= self._quiet[0][1]
            self._quiet.append((now, step_s))
            self._quiet_sum += step_s
            self._quiet_since_draw += 1

    def _measuring(self, now: float) -> bool:
        """Three quiet steps in the last PROBE_S, or since the last draw: the browser's price can be told."""
        return self._quiet_since_draw >= 3 or (len(self._quiet) >= 3 and now - self._quiet[-3][0] < PROBE_S)

    def _settle(self, estimate: bool = True) -> None:
        """The interval since the last draw is over: its price joins the run's and (unless the run
        cut it short) the estimate."""
        if self._pending is None:
            return
        price = max(0.0, self._pending)
        self.cost.browser_s += price
        self._pending = None
        if not estimate:
            return
        _prices["charts" if self._pending_chart else "text"].append(price)

    def due(self, now: float, engine_s: float, load: int = 1, steps_left: int | None = None) -> Due:
        """What to draw after a step ending at ``now``, with ``engine_s`` of forwards so far, ``load``
        live runs in the process and at most ``steps_left`` steps to come (None: unknown)."""
        self._steps += 1
        step_s, self._engine_prev = engine_s - self._engine_prev, engine_s
        if self._steps > 1:  # the first step is the prefill, no measure of a decode step
            self._observe(now, step_s)
        first = self.cost.text_draws == 0
        chart_gap, text_gap = self.chart_interval * load, self.text_interval * load
        numbers = now - self._last_numbers >= self.numbers_interval * load
        if self.every_token:
            charts = first or now - self._last_chart >= chart_gap
            return Due(True, True, charts)
        if first:
            return Due(True, True, False)
        # The run's expected rest, at its pace so far: a chart frame the browser is still drawing
        # when the run ends only delays the finished run's own, complete one.
        ending = steps_left is not None and steps_left * (now - self.t0) / self._steps < self.tail
        charts = (not ending and now - self._last_chart >= chart_gap and self._affordable(
            now, engine_s, self._est_chart + _price("charts", self._unmeasured) + self._est_text))
        # Draws so close that no step is undisturbed leave nothing to measure the browser's price by:
        # every PROBE_S, the text waits for three quiet steps.
        text = charts or (now - self._last_text >= text_gap and self._measuring(now)
                          and self._affordable(now, engine_s, self._est_text + self._est_browser))
        # The longest wait forces a redraw the share cannot pay for, except where the run should end
        # within ``tail``: its final redraw comes as soon, and one just before it pays the browser twice.
        if not text and now - self._last_text >= self.max_gap_now() and not ending:
            text = True
        return Due(text, text and (numbers or charts), charts)

    def drew(self, start: float, end: float, charts: bool, numbers: bool = False) -> None:
        self._settle()
        self._pending = 0.0 if len(self._quiet) >= 3 else None  # measured from the next step on
        self._quiet_since_draw = 0
        self._pending_chart = charts
        took = max(0.0, end - start)
        self.cost.draw_s += took
        self.cost.text_draws += 1
        self._last_text = end
        if numbers or charts:
            self._last_numbers = end
        if charts:
            self.cost.chart_draws += 1
            self._last_chart = end
            self._est_chart = _last_cost["charts"] = max(0.0, took - self._est_text)
        elif not numbers:  # a text-only draw: what the next one will cost
            self._est_text = _last_cost["text"] = took

    def finish(self, now: float, engine_s: float) -> LiveCost:
        # The last draw's price is whole once three quiet steps followed it: it joins the estimate. A
        # run ending sooner cut it short (an underestimate). Before 2026-11-29 it never joined, so on
        # one core, where a 2 s run redraws only once after its first token, no price was ever learnt
        # and every run kept the first guess.
        self._settle(estimate=self._quiet_since_draw >= 3)
        self.cost.wall_s = max(0.0, now - self.t0)
        self.cost.engine_s = engine_s
        return self.cost
