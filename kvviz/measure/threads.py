"""How many intra-op threads the app's forward passes run on, chosen on purpose.

torch starts with one OpenMP thread per physical core. Those threads spin while they wait for
each other, so when anything else wants a core (the browser drawing the live charts, on a
presenter's laptop the same machine) they collapse: issue 19 saw `make run` on a 2-core machine
an order of magnitude slower at torch's 2 threads than at 1. docs/benchmarks.md says how the
app's speed is measured against the engine's, before and after this rule.

The rule: leave one core for the browser, and never more than ``MAX_RULE_THREADS`` (a decode
step of the models kvviz shows streams a few MB of weights; beyond a handful of threads it
gains little and the spinning costs more). So ``max(1, min(torch's default, cores - 1, 8))``.
``KVVIZ_THREADS=N`` overrides the rule; so does an explicit ``OMP_NUM_THREADS`` (torch already
obeys it). The choice is process-wide, like torch's own setting: every session shares it.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

ENV = "KVVIZ_THREADS"
MAX_RULE_THREADS = 8


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # intra-op threads for the forwards
    cores: int  # cores this process may run on
    source: str  # "rule", "KVVIZ_THREADS", "OMP_NUM_THREADS" or "sidebar"
    note: str = ""  # why an override was ignored, if one was

    @property
    def spare_cores(self) -> int:
        """Cores the model's threads leave to the browser and the page (0: they share the engine's)."""
        return max(0, self.cores - self.threads)

    def describe(self) -> str:
        """One line for the sidebar: cores, threads, and why."""
        t = f"{self.threads} thread{'s' if self.threads != 1 else ''} for the model"
        if self.source == "rule":
            left = self.spare_cores
            why = (f"leaving {left} core{'s' if left != 1 else ''} for the browser and the page" if left > 0
                   else "the only core")
            how = f"{why}; set {ENV}=N to change"
        elif self.source == "sidebar":
            how = "set here, for every session of this server"
        else:
            how = f"set by {self.source}"
        s = f"{self.cores} CPU core{'s' if self.cores != 1 else ''} · {t} ({how})"
        return s + (f". {self.note}" if self.note else "")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _positive_int(text: str) -> int | None:
    try:
        n = int(text.strip())
    except ValueError:
        return None
    return n if n >= 1 else None


def choose(cores: int, torch_default: int, env: Mapping[str, str]) -> ThreadChoice:
    """The thread count for these cores, torch's own default and these environment variables."""
    note = ""
    raw = env.get(ENV)
    if raw is not None:
        n = _positive_int(raw)
        if n is not None:
            return ThreadChoice(n, cores, ENV)
        note = f"{ENV}={raw!r} was ignored: it must be a whole number of at least 1."
    if env.get("OMP_NUM_THREADS") and _positive_int(env["OMP_NUM_THREADS"]) is not None:
        return ThreadChoice(max(1, torch_default), cores, "OMP_NUM_THREADS", note)
    n = max(1, min(torch_default, cores - 1, MAX_RULE_THREADS))
    return ThreadChoice(n, cores, "rule", note)


_lock = threading.Lock()
_current: ThreadChoice | None = None


def ensure() -> ThreadChoice:
    """Apply the choice once per process (later calls return it); call before the first forward."""
    global _current
    with _lock:
        if _current is None:
            import torch

            _current = choose(usable_cores(), torch.get_num_threads(), os.environ)
            torch.set_num_threads(_current.threads)
        return _current


def set_threads(n: int) -> ThreadChoice:
    """Override the choice for the whole process (the sidebar's control)."""
    global _current
    import torch

    ensure()
    with _lock:
        n = max(1, int(n))
        torch.set_num_threads(n)
        _current = ThreadChoice(n, usable_cores(), "sidebar")
        return _current


# Where the model's threads leave no core spare, the browser draws the page on the engine's core. After
# a Generate click it redraws the whole page (Streamlit's rerun): drawn beside the prefill, the two
# slowed each other, on one core the prefill took 370-540 ms instead of 170-190 and the first 20
# decode steps 12-18 ms instead of about 9. Letting the browser finish first shows the first token about
# as soon (0.61 s after the click, median of 12, against 0.62 before any wait), the TTFT tile reads the
# prefill alone and the decode runs undisturbed (docs/benchmarks.md, 2026-11-29).
WAIT_LIMIT_S = 0.8  # never longer: a browser that keeps drawing must not hold the run back
PROBE_S = 0.005  # each look: spin this long and see how much of it this thread ran
REST_S = 0.02  # between looks, the core is left to the browser
FAIR_SHARE = 0.8  # this thread had the core to itself: nothing else was waiting for it
# Free looks in a row that end the wait. One was not enough: the browser draws in frames and may
# idle between them, and a single look there ended the wait in 3 of 9 runs with the rerun still
# being drawn (the prefill then took 340-377 ms instead of 165-180); with three (about 75 ms of a
# free core) it took 164-215 ms in 12 of 12, after waits of 0.27-0.44 s (2026-11-29).
FREE_LOOKS = 3


def wait_for_core(limit_s: float = WAIT_LIMIT_S, clock: Callable[[], float] = time.perf_counter,
                  cpu: Callable[[], float] = time.thread_time, sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait until this thread has its core to itself (it ran at least ``FAIR_SHARE`` of a short spin,
    ``FREE_LOOKS`` looks in a row), at most ``limit_s``; the seconds waited. Called only where no core
    is spare (``ThreadChoice``). The first look comes after a rest: the page's last deltas are still on
    their way to the browser, which has not begun to draw them (a look at once found the core free and
    the prefill shared it)."""
    t0 = clock()
    free = 0
    sleep(REST_S)
    while clock() - t0 < limit_s:
        w0, c0 = clock(), cpu()
        while clock() - w0 < PROBE_S:
            pass  # a busy spin: the scheduler shares the core with whatever else is runnable
        free = free + 1 if (cpu() - c0) / max(clock() - w0, 1e-9) >= FAIR_SHARE else 0
        if free >= FREE_LOOKS:
            break
        sleep(REST_S)
    return clock() - t0
