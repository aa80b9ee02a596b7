"""kvviz.fast.heap: garbage is collected before the long-lived heap is frozen."""
from __future__ import annotations

import gc
import weakref

import kvviz.fast.heap as heap
from kvviz.fast.heap import freeze_long_lived


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freeze_collects_cycles_first_then_freezes_the_survivors() -> None:
    garbage_a, garbage_b = _Node(), _Node()
    garbage_a.other, garbage_b.other = garbage_b, garbage_a  # a reference cycle: only the GC frees it
    dead = weakref.ref(garbage_a)
    del garbage_a, garbage_b
    alive = _Node()
    try:
        frozen = freeze_long_lived()
        assert dead() is None  # collected, not frozen forever
        # Frozen objects can still die (another thread drops its last reference), which lowers the
        # count; nothing else raises it. A full suite has such threads, so the count may only shrink.
        assert frozen >= gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # survivors left the collected generations
    finally:
        gc.unfreeze()  # leave the test process's collector as it was
    assert any(o is alive for o in gc.get_objects())


def test_freeze_once_freezes_only_the_first_time(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[int] = []
    monkeypatch.setattr(heap, "_frozen_once", False)
    monkeypatch.setattr(heap, "freeze_long_lived", lambda: calls.append(1) or 1)
    assert heap.freeze_once() is True
    assert heap.freeze_once() is False and heap.freeze_once() is False
    assert calls == [1]  # the app's later model loads never freeze live sessions' streams
