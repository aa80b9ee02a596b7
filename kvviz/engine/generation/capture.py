"""What a run records besides timings: the request (``Capture``) and the per-forward scratch
that attention layers fill with references (``ForwardCapture``). Shared by every model family.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
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
    so capturing never changes the forward's result and barely slows it. The one exception is
    the whole-step C call (fast/rowstep.py): it writes out the attention weights and new K/V
    norms it has computed anyway (about 1% of its time on SmolLM2), which saves ``record`` 30 small
    matmuls per token (0.84 ms of a 16 ms step at 1 thread, docs/benchmarks.md).
    """

    layers: frozenset[int]  # layers whose q/k/v references are wanted
    # What the consumer will record (``record`` reads them): a forward that computes either anyway
    # may hand it over ready in ``probs`` / ``new_norms`` (the whole-step C call does), and then
    # fills only the references ``record`` still reads (``kv_layer``'s K/V). A consumer that reads
    # the references itself asks for neither.
    want_attn: bool = False
    want_norms: bool = False
    kv_layer: int | None = None  # the layer whose raw new K/V ``record`` copies (Capture.kv_layer)
    q_last: dict[int, torch.Tensor] = field(default_factory=dict)  # (B, nh, 1, hs)
    k: dict[int, torch.Tensor] = field(default_factory=dict)  # (B, nkv, S, hs) all keys so far
    v: dict[int, torch.Tensor] = field(default_factory=dict)  # (B, nkv, S, hs)
    probs: torch.Tensor | None = None  # (n_layer, nh, S): the one new query row's weights, batch row 0
    # A sliding layer past its window: the newest query sees keys from this position on only.
    key_from: dict[int, int] = field(default_factory=dict)
    new_norms: torch.Tensor | None = None  # (n_layer, 2, nkv): L2 norms of the one new K and V column


@dataclass(frozen=True)
class Recorded:
    """The arrays a step's captures became (batch row 0, CPU float16), or None where not asked."""

    attn: np.ndarray | None = None  # (n_cap_layers, n_head, S): the newest query row over all keys
    attn_layers: tuple[int, ...] = ()
    kv_norms: np.ndarray | None = None  # (n_layer, 2, n_kv_head, T_new)
    kv_layer: int | None = None
    kv_values: np.ndarray | None = None  # (2, n_kv_head, T_new, head_dim)


def record(capture: Capture, fc: ForwardCapture | None, cfg: Any, kv_start: int, t: int) -> Recorded:
    """Turn a forward's references into small arrays, after the clock has stopped.

    kv_start..t are the K/V columns new at this step. cfg gives n_layer, n_head, kv_heads, head_dim.
    """
    if fc is None:
        return Recorded()
    attn = kv_norms = kv_values = None
    layers = capture.attention_layers(cfg.n_layer)
    # Few, batched ops: this runs after every step of a live run, beside a forward of a millisecond.
    if layers and fc.probs is not None:  # the forward computed them already (one new query row)
        w = fc.probs if len(layers) == fc.probs.shape[0] else fc.probs[list(layers)]  # (n_cap, nh, S)
        attn = w.to(torch.float16).numpy()
    elif layers:
        # the model's own scale: Gemma's query_pre_attn_scalar ** -0.5 (equal to 1 / sqrt(head_dim)
        # for every Gemma 3 checkpoint, not for every config), else 1 / sqrt(head_dim)
        pre = getattr(cfg, "query_pre_attn_scalar", None)
        scale = pre ** -0.5 if pre else 1.0 / math.sqrt(cfg.head_dim)
        group = cfg.n_head // cfg.kv_heads  # query heads per K/V head (GQA: they share its keys)
        scores = []
        for layer in layers:
            k = fc.k[layer][0]  # (nkv, S, hs), read in place: no copy of the keys
            q = fc.q_last[layer][0, :, -1].view(cfg.kv_heads, group, -1)  # (nkv, group, hs)
            s = q.float() @ k.float().transpose(-1, -2)  # (nkv, group, S)
            if layer in fc.key_from:  # a sliding layer: keys before its window get no weight
                s[..., : fc.key_from[layer]] = float("-inf")
            scores.append(s)
        # The newest query is the last position, so no causal mask is needed: it sees all S keys
        # (a sliding layer: those of its window).
        w = torch.softmax(torch.stack(scores) * scale, dim=-1)  # (n_cap, nkv, group, S)
        attn = w.flatten(1, 2).to(torch.float16).cpu().numpy()  # (n_cap, nh, S)
    if capture.kv_norms and fc.new_norms is not None and t - kv_start == 1:
        kv_norms = fc.new_norms.unsqueeze(-1).to(torch.float16).numpy()  # (L, 2, nkv, 1)
    elif capture.kv_norms:
        new = torch.stack([torch.stack([fc.k[layer][0, :, kv_start:t], fc.v[layer][0, :, kv_start:t]])
                           for layer in range(cfg.n_layer)])  # (L, 2, nkv, Tn, hs): only the new columns
        kv_norms = new.float().norm(dim=-1).to(torch.float16).cpu().numpy()  # (L, 2, nkv, Tn)
    kl = capture.kv_layer
    if kl is not None and kl in fc.k:
        kv_values = torch.stack([fc.k[kl][0, :, kv_start:t], fc.v[kl][0, :, kv_start:t]]).to(
            torch.float16).cpu().numpy()  # (2, nkv, Tn, hs)
    return Recorded(attn, tuple(layers) if attn is not None else (), kv_norms,
                    kl if kv_values is not None else None, kv_values)
