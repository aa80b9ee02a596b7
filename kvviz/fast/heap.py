"""Keep Python's cyclic garbage collector off the long-lived heap while tokens are generated.

Once torch (and transformers, Streamlit) are imported and a model is loaded, the process holds a
great many objects that the cyclic collector tracks and that live until exit. Every full
collection walks all of them, a pause longer than many decode steps of a small model, and
generation sets one off every few thousand tokens, inside some step's timed forward.
``gc.freeze()`` moves what exists now into a permanent generation that collections skip;
objects created later are collected as usual. ``docs/performance.md`` has the measurements.

Frozen objects are never collected by the cyclic collector, so only what truly lives until exit
may be frozen. The CLI and the bench are short-lived and freeze after loading their models. The
app is a long-lived server whose sessions hold generation streams (reference cycles, each with a
KV cache) between reruns: it freezes once per process, at its first model load, before any
session has a stream; models loaded later are simply collected as usual.

The engine itself never touches the collector.
"""
from __future__ import annotations

import gc
import threading

_once = threading.Lock()
_frozen_once = False


def freeze_long_lived() -> int:
    """Collect the garbage there is now, then freeze the survivors; returns how many were frozen."""
    gc.collect()  # garbage is freed, not frozen
    gc.freeze()
    return gc.get_freeze_count()


def freeze_once() -> bool:
    """``freeze_long_lived()`` the first time it is called in this process; True if it froze."""
    global _frozen_once
    with _once:
        if _frozen_once:
            return False
        freeze_long_lived()
        _frozen_once = True
        return True
