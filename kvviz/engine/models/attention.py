"""What each new query may see: the one attention mask every model family and the accelerator share.

Causal attention over T new tokens placed after ``start`` cached ones:
- one token (a decode step) sees everything cached, so it needs no mask;
- a plain prefill (nothing cached) is SDPA's own causal path;
- a chunked prefill needs an explicit mask: query i, at position input_pos[i], sees keys 0..input_pos[i].

A sliding window of W (Mistral's every layer, Gemma 3's sliding ones) also hides every key more
than W - 1 positions behind its query (key j is seen by query i when i - W < j <= i, as
transformers' and llama.cpp's masks do). While all keys lie within the window the plain rules above
hold, so short runs take SDPA's fast paths. A cache that keeps only the window (a static or
quantized ring, a paged layer that let blocks go, a run-time ``WindowKVCache`` once full) hands
back rows that are not positions 0..start+T-1; ``KVCache.ring_positions`` names the position of
each, and ``ring_mask`` masks over them. ``window_mask`` picks between the two for a forward;
``keys_by_position`` lays a ring's rows back out at their positions for the attention capture.
"""
from __future__ import annotations

from typing import Protocol

import torch


class HeldRows(Protocol):
    """What the window masks read of a cache (engine/kvcache/dense.py's ``KVCache``, which sits
    above this module): its position and the positions a windowed layer's rows hold."""

    pos: int

    def ring_positions(self, window: int, T: int) -> torch.Tensor | None: ...


def attention_mask(T: int, start: int, input_pos: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """(mask (T, start + T) or None, is_causal) for ``F.scaled_dot_product_attention`` over keys at
    positions 0..start+T-1, every one of them visible to the queries after it."""
    if T == 1:
        return None, False
    if start == 0:
        return None, True
    keys = torch.arange(start + T, device=input_pos.device)
    return keys[None, :] <= input_pos[:, None], False  # (T, S)


def sliding_mask(T: int, start: int, input_pos: torch.Tensor, window: int) -> tuple[torch.Tensor | None, bool]:
    """A sliding layer's mask over a cache holding every position 0..start+T-1: query at p sees
    keys p - window + 1 .. p. Until the last query is past the window it is the causal mask."""
    if start + T <= window:
        return attention_mask(T, start, input_pos)
    keys = torch.arange(start + T, device=input_pos.device)
    p = input_pos[:, None]
    return (keys[None, :] <= p) & (keys[None, :] > p - window), False  # (T, S)


def ring_mask(keys: torch.Tensor, input_pos: torch.Tensor, window: int) -> tuple[torch.Tensor | None, bool]:
    """A sliding layer's mask over a ring cache's rows, ``keys`` (S,) naming the position each holds:
    query at p sees the rows holding p - window + 1 .. p (``window_mask`` skips it when every row does)."""
    p = input_pos[:, None]
    return (keys[None, :] <= p) & (keys[None, :] > p - window), False  # (T, S)


def window_mask(T: int, start: int, input_pos: torch.Tensor, window: int,
                cache: HeldRows | None) -> tuple[torch.Tensor | None, bool]:
    """A sliding layer's mask for this forward: over the rows a windowed cache holds (``ring_mask``)
    when it has let positions go, else over every position (``sliding_mask``).

    One query (at ``start``) whose rows all lie within its window needs no mask: a full ring is
    exactly its window, a paged sliding layer's held blocks run contiguously up to the query, and a
    run-time window cache (``WindowKVCache``) of S + W <= window rows renumbered as StreamingLLM
    does. Its sinks at their original positions may lie further back: then the mask hides them."""
    ring = cache.ring_positions(window, T) if cache is not None else None
    if ring is None:
        return sliding_mask(T, start, input_pos, window)
    # ring is built on the CPU (the caches' arange), so min() costs no device sync
    if T == 1 and ring.numel() <= window and int(ring.min()) > start - window:
        return None, False
    return ring_mask(ring.to(input_pos.device), input_pos, window)


def keys_by_position(k: torch.Tensor, v: torch.Tensor, cache: HeldRows | None, window: int,
                     T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a sliding layer's ``cache.update`` returned, k and v (B, nkv, R, hs), as rows at their
    positions (B, nkv, pos+T, hs), the rows a ring let go as zeros (the capture's window hides them)."""
    S = (cache.pos if cache is not None else 0) + T  # positions so far, this step's included
    if cache is None or k.shape[2] == S:
        return k, v  # every position, in order
    keys = cache.ring_positions(window, T)
    assert keys is not None
    keys = keys.to(k.device)
    B, nkv, _, hs = k.shape
    kk = k.new_zeros((B, nkv, S, hs)).index_copy_(2, keys, k)  # (B, nkv, S, hs), evicted rows 0
    vv = v.new_zeros((B, nkv, S, hs)).index_copy_(2, keys, v)
    return kk, vv
