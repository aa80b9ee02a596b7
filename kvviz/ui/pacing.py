"""When the live loop redraws: the live views' share of the loop's time, spent on purpose.

Pure Python (no streamlit), so the policy is tested with plain numbers. The price of the live
views is everything the loop does besides the engine's own work: capturing attention and K/V
after each step, building the chips and figures, and Streamlit sending them (on another thread
of the same process, so it slows the forwards too). The loop measures that price directly, as
its wall time minus the forwards' measured time, and draws only while it stays within ``share``
of the wall time: the app then streams at >= (1 - share) of the engine's own speed.

Within that budget:
- the first step's text is drawn at once (the prompt and the first token, as soon as they exist);
- a chart frame (four Plotly figures: 0.1-0.3 s of Python on a small machine) is drawn only when
  the budget can pay for it, judged by what the last frame cost in this process; a run too short
  to afford one shows its charts when it ends;
- the text at most every ``text_interval`` s (faster than the eye reads anyway);
- the charts at most every ``chart_interval`` s;
- both intervals ``load`` times longer with ``load`` runs live in the process, so a busy server
  sends its browsers about what one run would;
- whatever the budget says, the text at least every ``max_gap`` s, so a slow, capture-heavy
  model still shows signs of life;
- presenting (a slowed-down run, ``every_token``) draws every token: the loop waits anyway.
"""
from __future__ import annotations

from dataclasses import dataclass

SHARE = 0.2  # the live views may take a fifth of the loop's time: the app streams at >= 0.8x the engine
TEXT_INTERVAL_S = 0.05  # a tiny model makes 1,000 tokens/s; 20 redraws a second read as a stream
CHART_INTERVAL_S = 0.15
MAX_GAP_S = 0.5
# What the last draws cost, process-wide: the first live run of a process starts from these guesses.
_last_cost = {"text": 0.005, "charts": 0.1}


@dataclass
class LiveCost:
    """What the live views cost in one run (kept in the run's meta and shown after it)."""

    wall_s: float = 0.0  # the loop, first step to last
    engine_s: float = 0.0  # the forwards and sampling, as the run's events measured them
    text_draws: int = 0
    chart_draws: int = 0
    draw_s: float = 0.0  # time spent inside the draw calls on the loop's thread

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.wall_s - self.engine_s)

    @property
    def share(self) -> float:
        return self.overhead_s / self.wall_s if self.wall_s > 0 else 0.0

    def sentence(self, tokens: int) -> str:
        if self.wall_s <= 0 or tokens <= 0:
            return ""
        return (f"Live: {tokens:,} tokens in {self.wall_s:,.2f} s, of which the forwards took {self.engine_s:,.2f} s "
                f"and the live views {self.overhead_s:,.2f} s ({self.share:.0%}: text redrawn {self.text_draws:,}×, "
                f"charts {self.chart_draws:,}×), so the page streamed at {tokens / self.wall_s:,.0f} tokens/s "
                f"where the engine alone ran {tokens / max(self.engine_s, 1e-9):,.0f}.")

    def as_dict(self) -> dict[str, float]:
        return {"wall_s": round(self.wall_s, 4), "engine_s": round(self.engine_s, 4), "text_draws": self.text_draws,
                "chart_draws": self.chart_draws, "draw_s": round(self.draw_s, 4)}


class Pacer:
    """Says, after each step, whether to redraw the text, and the charts; told what each draw cost."""

    def __init__(self, t0: float, share: float = SHARE, text_interval: float = TEXT_INTERVAL_S,
                 chart_interval: float = CHART_INTERVAL_S, max_gap: float = MAX_GAP_S,
                 every_token: bool = False) -> None:
        self.t0 = t0
        self.share = share
        self.text_interval = text_interval
        self.chart_interval = chart_interval
        self.max_gap = max_gap
        self.every_token = every_token
        self.cost = LiveCost()
        self._last_text = self._last_chart = float("-inf")
        self._est_text, self._est_chart = _last_cost["text"], _last_cost["charts"]  # what a draw of each kind costs

    def _affordable(self, now: float, engine_s: float, est: float) -> bool:
        wall = now - self.t0
        return (wall - engine_s) + est <= self.share * (wall + est)

    def due(self, now: float, engine_s: float, load: int = 1) -> tuple[bool, bool]:
        """(text, charts) to draw after a step ending at ``now``, with ``engine_s`` of forwards so far
        and ``load`` live runs in the process."""
        first = self.cost.text_draws == 0
        chart_gap, text_gap = self.chart_interval * load, self.text_interval * load
        if self.every_token:
            return True, first or now - self._last_chart >= chart_gap
        if first:
            return True, False
        charts = now - self._last_chart >= chart_gap and self._affordable(now, engine_s, self._est_chart + self._est_text)
        text = charts or (now - self._last_text >= text_gap and self._affordable(now, engine_s, self._est_text))
        if not text and now - self._last_text >= self.max_gap:
            text = True
        return text, charts

    def drew(self, start: float, end: float, charts: bool) -> None:
        took = max(0.0, end - start)
        self.cost.draw_s += took
        self.cost.text_draws += 1
        self._last_text = end
        if charts:
            self.cost.chart_draws += 1
            self._last_chart = end
            self._est_chart = _last_cost["charts"] = max(0.0, took - self._est_text)
        else:
            self._est_text = _last_cost["text"] = took

    def finish(self, now: float, engine_s: float) -> LiveCost:
        self.cost.wall_s = max(0.0, now - self.t0)
        self.cost.engine_s = engine_s
        return self.cost
