"""What the accelerators (``gpt2.py``, ``llama.py``) share, whatever the model family.

- ``PlanCache``: one plan per intra-op thread count, built on first use under a lock. The C
  row ops and the column splits cut the work by the thread count, so a plan is made for one;
  the app's sessions share one model from several threads, hence the lock.
- ``split_qkv``: one new row's q, k and v as views of the fused projection's output.

The attention mask both take is the readable models' own (``kvviz.engine.models.attention``). This
module imports no model code (floor 1).
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

import torch

P = TypeVar("P")


class PlanCache(Generic[P]):
    """Plans keyed by ``torch.get_num_threads()``, each built once by ``build(threads)``."""

    def __init__(self, build: Callable[[int], P]) -> None:
        self._build = build
        self._plans: dict[int, P] = {}
        self.lock = threading.Lock()  # held while building; rebuild() takes it too

    def get(self) -> P:
        threads = torch.get_num_threads()
        plan = self._plans.get(threads)
        if plan is None:
            with self.lock:
                plan = self._plans.get(threads)
                if plan is None:
                    plan = self._plans[threads] = self._build(threads)
        return plan

    def clear(self) -> None:
        """Drop every plan (the caller holds ``lock`` when it must refresh state with it)."""
        self._plans.clear()


def opt(t: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter as a plain tensor (a view, no copy), or None."""
    return None if t is None else t.detach()


def split_qkv(qkv: torch.Tensor, B: int, nh: int, nkv: int, hs: int) -> tuple[torch.Tensor, ...]:
    """One new row per batch element: q (B, nh, 1, hs), k and v (B, nkv, 1, hs), views of qkv
    (B, 1, (nh + 2 nkv) hs) or any contiguous tensor of those values. T = 1 needs no permute."""
    if nkv == nh:
        return qkv.view(B, 3, nh, 1, hs).unbind(1)
    # Every head is hs wide, so the heads of q, k and v are one (B, nh + 2 nkv, 1, hs) view, split
    # along the heads: two ops where splitting the columns and viewing each part took five.
    return qkv.view(B, nh + 2 * nkv, 1, hs).split([nh, nkv, nkv], dim=1)
