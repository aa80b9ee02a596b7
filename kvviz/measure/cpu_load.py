"""How busy *other* processes keep the CPU: what a timing page should warn about.

The load average counts this process too, so right after a sweep a page would blame "other
work" for its own measuring. On Linux, the CPU time of all processes (/proc/stat) minus this
process's own (/proc/self/stat), between two readings, gives the cores that other work kept
busy. Steal time counts as theirs: on a VM it is the hypervisor running other machines'
processes on our cores. In a container /proc/stat and os.cpu_count() both describe the host, so the share is the
host's; a CPU quota is not taken into account. Elsewhere the load average is the best there is.
Pure Python, no torch.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MIN_INTERVAL_S = 1.0  # shorter intervals are mostly tick-rounding noise
BUSY_SHARE = 0.5  # warn when other processes keep at least this share of the cores busy
LOADAVG_SHARE = 0.75  # without /proc: warn above this load average per core (it counts us too)


@dataclass(frozen=True)
class CpuReading:
    wall_s: float  # time.monotonic() when read
    busy_ticks: int  # all CPUs' non-idle time since boot, in clock ticks
    self_ticks: int  # this process's user + system time, in clock ticks


def parse_proc_stat(text: str) -> int:
    """Non-idle ticks from /proc/stat's first ("cpu") line: user nice system idle iowait irq
    softirq steal ... (idle and iowait are not busy; guest time is already inside user)."""
    fields = [int(x) for x in text.splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


def parse_self_stat(text: str) -> int:
    """utime + stime (fields 14 and 15) of /proc/self/stat; the name in parentheses may hold spaces."""
    rest = text[text.rindex(")") + 2:].split()  # fields from 3 (state) on
    return int(rest[11]) + int(rest[12])


def read_cpu() -> CpuReading | None:
    """Now's reading, or None where /proc is not there (macOS, Windows)."""
    try:
        busy = parse_proc_stat(Path("/proc/stat").read_text())
        mine = parse_self_stat(Path("/proc/self/stat").read_text())
    except (OSError, ValueError, IndexError):
        return None
    return CpuReading(time.monotonic(), busy, mine)


def others_busy_cores(a: CpuReading, b: CpuReading, ticks_per_s: float) -> float:
    """Cores that processes other than this one kept busy, on average, from reading a to b."""
    wall_ticks = (b.wall_s - a.wall_s) * ticks_per_s
    if wall_ticks <= 0:
        return 0.0
    others = (b.busy_ticks - a.busy_ticks) - (b.self_ticks - a.self_ticks)
    return max(0.0, others / wall_ticks)


class BusyMonitor:
    """Keeps the previous reading, so every call measures others' load since the last one without
    sleeping. Thread-safe: each browser session renders in its own thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: CpuReading | None = None
        self._others: float | None = None  # the most recent measurement, in cores

    def others(self, reading: CpuReading | None = None) -> float | None:
        """Cores other processes kept busy lately, or None until two readings are far enough apart."""
        now = reading if reading is not None else read_cpu()
        if now is None:
            return None
        with self._lock:
            if self._last is None:
                self._last = now
            elif now.wall_s - self._last.wall_s >= MIN_INTERVAL_S:
                self._others = others_busy_cores(self._last, now, os.sysconf("SC_CLK_TCK"))
                self._last = now
            return self._others


MONITOR = BusyMonitor()


def load_average() -> float | None:
    """The 1-minute load average: the threads running or waiting for a core, this process's among
    them (the busy cores above stop at the core count, however many wait). None where there is none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy_warning(cores: int | None = None, monitor: BusyMonitor = MONITOR,
                 free_cores: float | None = None, short: bool = False) -> str | None:
    """A sentence when other work competes for the CPU (timings are then noisier), else None.

    ``free_cores``: cores the model's threads leave to other work (the browser among it); other
    processes compete only beyond those, so the bar is half a core above them. Without it the bar
    is ``BUSY_SHARE`` of the cores. ``short``: the fact alone, without the advice.
    """
    cores = cores or os.cpu_count() or 1
    reading = read_cpu()
    if reading is not None:
        others = monitor.others(reading)
        bar = BUSY_SHARE * cores if free_cores is None else free_cores + 0.5
        if others is None or others < bar:  # None: no second reading yet
            return None
        what = f"other processes kept {others:.1f} cores busy"
        if free_cores is not None:
            what += f", more than the {free_cores:g} the model's threads leave free"
    else:  # no /proc: the load average, which counts this process too, with a higher bar
        try:
            load = os.getloadavg()[0]
        except OSError:
            return None
        if load <= LOADAVG_SHARE * cores:
            return None
        what = f"load average {load:.1f}"
    head = f"The CPU is busy ({what} on {cores} cores): other work is competing, so generation is slower " \
           "and timings are noisier than usual."
    if short:  # a line beside the Generate page's buttons
        return f"CPU busy: other processes used {others:.1f} of {cores} cores; generation is slower than usual." \
            if reading is not None else f"CPU busy: {what} on {cores} cores; generation is slower than usual."
    return head + (" Medians over repeats help; the spread shows the noise. Fewer threads for the model also "
                   "help (the sidebar's CPU threads, or KVVIZ_THREADS=1 at start).")


def busy_during(start: CpuReading | None, end: CpuReading | None, cores: int, threads: int,
                ticks_per_s: float | None = None) -> str | None:
    """A clause when other processes competed with a measurement between two readings, else None.

    The measurement's ``threads`` need that many of the ``cores``; other processes (the browser
    drawing the page among them) compete once they keep more than the rest busy, by half a core.
    """
    if start is None or end is None or end.wall_s - start.wall_s < MIN_INTERVAL_S:
        return None
    others = others_busy_cores(start, end, ticks_per_s or os.sysconf("SC_CLK_TCK"))
    free = max(0, cores - threads)
    if others < free + 0.5:
        return None
    return (f"other processes (the browser drawing this page among them) kept {others:.1f} cores busy while it "
            f"measured, on a {cores}-core machine whose model threads needed {threads}")
