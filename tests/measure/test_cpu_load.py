"""kvviz.measure.cpu_load: other processes' CPU use from /proc, so a timing page never blames its own load."""
from __future__ import annotations

import os

import pytest

import kvviz.measure.cpu_load as cl
from kvviz.measure.cpu_load import BusyMonitor, CpuReading, busy_warning, others_busy_cores, parse_proc_stat, parse_self_stat

PROC_STAT = "cpu  100 5 30 900 7 2 3 4 0 0\ncpu0 50 2 15 450 3 1 1 2 0 0\nintr 12345\n"
# pid (comm with spaces and a ')') state ppid ... utime=14th field, stime=15th field
SELF_STAT = "4242 (py thon) x) S 1 4242 4242 0 -1 4194560 900 0 0 0 321 79 0 0 20 0 3 0 100 0 0\n"


def test_parsers_pick_the_busy_ticks_by_hand() -> None:
    assert parse_proc_stat(PROC_STAT) == 100 + 5 + 30 + 2 + 3 + 4  # idle (900) and iowait (7) are not busy
    assert parse_self_stat(SELF_STAT) == 321 + 79


def test_others_are_all_busy_time_minus_ours() -> None:
    a = CpuReading(10.0, busy_ticks=1_000, self_ticks=400)
    b = CpuReading(12.0, busy_ticks=1_300, self_ticks=550)  # 2 s at 100 ticks/s = 200 wall ticks
    assert others_busy_cores(a, b, 100) == pytest.approx((300 - 150) / 200)  # 0.75 cores
    assert others_busy_cores(a, CpuReading(12.0, 1_100, 550), 100) == 0.0  # never negative
    assert others_busy_cores(a, a, 100) == 0.0


def test_monitor_needs_two_readings_a_second_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sysconf", lambda name: 100)
    m = BusyMonitor()
    assert m.others(CpuReading(0.0, 0, 0)) is None  # one reading: nothing to compare yet
    assert m.others(CpuReading(0.5, 90, 0)) is None  # too soon: tick rounding would dominate
    assert m.others(CpuReading(2.0, 300, 100)) == pytest.approx((300 - 100) / 200)  # 1 core
    assert m.others(CpuReading(2.4, 999, 0)) == pytest.approx(1.0)  # too soon: the last value stands


def test_our_own_load_never_warns_but_others_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sysconf", lambda name: 100)
    readings = iter([CpuReading(0.0, 0, 0), CpuReading(2.0, 400, 400),  # we kept both cores busy
                     CpuReading(4.0, 800, 400)])  # then others did
    monkeypatch.setattr(cl, "read_cpu", lambda: next(readings))
    m = BusyMonitor()
    assert busy_warning(2, m) is None
    assert busy_warning(2, m) is None  # 2 cores busy, all ours: no warning
    msg = busy_warning(2, m)
    assert msg is not None and "other processes kept 2.0 cores busy on 2 cores" in msg


def test_without_proc_the_load_average_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cl, "read_cpu", lambda: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.4, 1.0, 1.0))
    assert busy_warning(2, BusyMonitor()) is None  # 1.4 <= 0.75 * 2
    monkeypatch.setattr(os, "getloadavg", lambda: (1.6, 1.0, 1.0))
    assert "load average 1.6 on 2 cores" in (busy_warning(2, BusyMonitor()) or "")


def test_real_readings_on_this_machine() -> None:
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc on this system")
    a = cl.read_cpu()
    assert a is not None and a.busy_ticks > 0 and a.self_ticks >= 0
    sum(i * i for i in range(200_000))  # burn a little CPU in this process
    b = cl.read_cpu()
    assert b is not None and b.self_ticks >= a.self_ticks and b.busy_ticks >= a.busy_ticks
