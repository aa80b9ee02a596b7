"""What a run records besides timings: the request (``Capture``) and the per-forward scratch
that attention layers fill with references (``ForwardCapture``). Shared by every model family.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Capture:
    """What to record besides timings. Everything is off by default and bounded in size."""

    attention: bool | tuple[int, ...] = False  # newest query row's weights: True = all layers
    kv_norms: bool = False  # L2 norm of every new K/V head vector, all layers
    kv_layer: int | None = None  # raw new K/V values of this one layer
    logits: bool = False  # last-position logits (tests; V floats per step)

    def attention_layers(self, n_layer: int) -> tuple[int, ...]:
        if self.attention is True:
            return tuple(range(n_layer))
        if not self.attention:
            return ()
        return tuple(sorted(set(int(i) for i in self.attention if 0 <= int(i) < n_layer)))

    def ref_layers(self, n_layer: int) -> frozenset[int]:
        layers = set(self.attention_layers(n_layer))
        if self.kv_norms:
            layers.update(range(n_layer))
        if self.kv_layer is not None and 0 <= self.kv_layer < n_layer:
            layers.add(self.kv_layer)
        return frozenset(layers)


CAPTURE_ALL = Capture(attention=True, kv_norms=True, kv_layer=0)


@dataclass
class ForwardCapture:
    """Per-forward scratch that attention layers fill with *references* (no copies, no math).

    The generator turns them into attention weights and K/V snapshots after the clock stops,
    so capturing never slows the timed forward pass nor changes its result.
    """

    layers: frozenset[int]  # layers whose q/k/v references are wanted
    q_last: dict[int, torch.Tensor] = field(default_factory=dict)  # (B, nh, 1, hs)
    k: dict[int, torch.Tensor] = field(default_factory=dict)  # (B, nkv, S, hs) all keys so far
    v: dict[int, torch.Tensor] = field(default_factory=dict)  # (B, nkv, S, hs)
