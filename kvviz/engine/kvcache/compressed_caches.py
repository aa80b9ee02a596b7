"""Compressed KV caches: quantized rows (int8, int4, fp8) and sliding windows with StreamingLLM sinks.

Both keep the KVCache contract: ``update`` stores the new rows and returns every K/V the new
queries attend to, ``pos`` counts every token the sequence has had (the models' positions),
and ``held`` the positions the cache still holds.

The window cache needs no change in the models' masks: while the sinks + window slots are not
full it is an ordinary cache (K length = pos + T, the usual causal mask), and once full it takes
one token per forward (``max_feed``), whose query sees every held row, so no mask at all.

Positions once rows are evicted (RoPE models). Attention scores under RoPE depend only on the
distance between a query's and a key's positions. Cached K is stored rotated at its original
position, the query at its own.
- ``positions="original"`` leaves them: the sinks stay ``P - j`` positions behind the query.
- ``positions="cache"`` is StreamingLLM's choice, positions within the cache: the held rows are
  numbered 0..S+W-1 in order, the query last. The window's rows are contiguous up to the query,
  so their distances are unchanged; only the S sinks move, ``E`` (= evicted count) positions
  closer. Rotating the sink keys forward by E (RoPE rotations compose) gives exactly that, and
  costs S rows per layer per step.
GPT-2 adds learned positions to the input, so its cached rows carry them and cannot be moved
(``kv_spec.resolve`` refuses ``positions="cache"`` there).
"""
from __future__ import annotations

import torch

from typing import Any

from kvviz.engine.kvcache.dense import Checkpoint, KVCache
from kvviz.engine.models.config import GPTConfig
from kvviz.engine.kvcache.kv_spec import KVSpec
from kvviz.engine.kvcache.slot_store import ErrorLog, FloatStore, QuantStore
from kvviz.engine.models.llama import apply_rope


def _store(spec: KVSpec, config: GPTConfig, batch: int, slots: int, device: torch.device,
           dtype: torch.dtype) -> FloatStore | QuantStore:
    if spec.kv_dtype is None:
        return FloatStore(config, batch, slots, device, dtype)
    return QuantStore(config, batch, slots, device, dtype, spec.kv_dtype, spec.group_for(config.head_dim),
                      spec.zero_point, spec.fp8_scale == "head", spec.track_errors)


class _StoreCache(KVCache):
    """What both share: a slot store, its exact bytes, its error log."""

    store: FloatStore | QuantStore

    def _token_bytes(self) -> int:
        return self.store.slot_bytes

    @property
    def bytes_used(self) -> int:
        return self.held * self.bytes_per_token + self.store.fixed_bytes

    @property
    def bytes_allocated(self) -> int:
        return self.store.allocated

    def layer_bytes(self) -> list[int]:
        # every layer's store is the same shape: its share of a slot, and of the fp8 per-head scales
        n = self.config.n_layer
        return [self.held * (self.bytes_per_token // n) + self.store.fixed_bytes // n] * n

    @property
    def errors(self) -> ErrorLog | None:
        return self.store.errors

    def _reorder(self, index: torch.Tensor) -> None:
        self.store.reorder(index)


class QuantizedKVCache(_StoreCache):
    """``block_size`` slots written in order, stored quantized, dequantized on every read."""

    kind = "quantized"

    def __init__(self, config: GPTConfig, spec: KVSpec, batch: int = 1, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.spec = spec
        self.store = _store(spec, config, batch, config.block_size, torch.device(device), dtype)
        super().__init__(config, batch, device, dtype)

    def reset(self) -> None:
        self.store.clear(0, self.store.slots)
        self.pos = 0
        self.bytes_copied = 0

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.read(i, self.pos)

    _hi = 0  # one past the highest slot any update wrote (what a restore must clear)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._hi = max(self._hi, self.pos + k.shape[2])  # before the write: it may fail halfway
        self.store.write(layer_idx, self.pos, k, v)
        self.bytes_copied += 2 * k.nbytes
        return self.store.read(layer_idx, self.pos + k.shape[2])  # (B, nkv, pos+T, hs), dequantized

    def _truncate(self, n: int) -> None:
        self.store.clear(n, self.pos)

    def _save(self, keep: int) -> Any:
        return self.store.save(keep, self.pos)

    def _load(self, cp: Checkpoint) -> None:
        # Rows a failed forward wrote past pos too.
        self.store.clear(cp.keep, max(self._hi, self.pos))
        self.store.load(cp.state)
        self._hi = cp.pos


class WindowKVCache(_StoreCache):
    """``sinks`` slots kept forever, then a ring of ``window`` slots: exactly S + W rows once full."""

    kind = "window"

    def __init__(self, config: GPTConfig, spec: KVSpec, batch: int = 1, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        assert spec.window is not None and spec.positions is not None, "resolve the spec first (kv_spec.resolve)"
        self.spec = spec
        self.sinks, self.window = spec.sinks, spec.window
        self.capacity = spec.sinks + spec.window
        self.store = _store(spec, config, batch, self.capacity, torch.device(device), dtype)
        super().__init__(config, batch, device, dtype)
        self.inv_freq: torch.Tensor | None = None
        if spec.positions == "cache" and spec.sinks:
            theta = float(getattr(config, "rope_theta"))
            hs = config.head_dim
            # as rope_tables computes them, in fp64 so a rotation by E adds no error of its own
            self.inv_freq = 1.0 / (theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))

    @property
    def held(self) -> int:
        return min(self.pos, self.capacity)

    @property
    def evicted(self) -> int:
        return max(0, self.pos - self.capacity)

    def max_feed(self) -> int:
        room = self.capacity - self.pos
        return min(room if room > 0 else 1, self.config.block_size - self.pos)

    def slot_of(self, p: int) -> int:
        """The slot position p is (or was) written to: sinks first, then the ring."""
        return p if p < self.capacity else self.sinks + (p - self.sinks) % self.window

    def slot_positions(self) -> list[int]:
        """The original position each held slot holds, slot by slot."""
        out = list(range(self.held))
        for p in range(max(self.capacity, self.pos - self.window), self.pos):
            out[self.slot_of(p)] = p
        return out

    def reset(self) -> None:
        self.store.clear(0, self.capacity)
        self.pos = 0
        self.bytes_copied = 0

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.read(i, self.held)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[2]
        self.bytes_copied += 2 * k.nbytes
        if self.pos + T <= self.capacity:  # nothing evicted yet: an ordinary cache
            self.store.write(layer_idx, self.pos, k, v)
            return self.store.read(layer_idx, self.pos + T)
        if T != 1:
            raise ValueError(f"a full window cache takes one token per forward (got {T}); see max_feed()")
        self.store.write(layer_idx, self.slot_of(self.pos), k, v)  # overwrites the oldest window row
        ks, vs = self.store.read(layer_idx, self.capacity)  # (B, nkv, S+W, hs), ring order: no mask needs it
        if self.inv_freq is not None:
            e = self.pos + 1 - self.capacity  # positions evicted once this token is in
            ks = torch.cat([self._rotate(ks[:, :, : self.sinks], e), ks[:, :, self.sinks:]], dim=2)
        return ks, vs

    def _rotate(self, k: torch.Tensor, e: int) -> torch.Tensor:
        """Keys rotated at position p -> rotated at p + e (RoPE: R(p + e) = R(e) R(p))."""
        assert self.inv_freq is not None
        ang = torch.cat([self.inv_freq, self.inv_freq]) * e  # (hs,): the half-split layout
        cos, sin = ang.cos().to(k.dtype), ang.sin().to(k.dtype)
        return apply_rope(k, cos.to(k.device), sin.to(k.device))

    def _save(self, keep: int) -> Any:
        # The ring overwrites the oldest window row on every step once full, whatever keep says:
        # the whole store (S + W slots) is the undo data.
        return self.store.save(0, self.capacity)

    def _load(self, cp: Checkpoint) -> None:
        self.store.clear(0, self.capacity)
        self.store.load(cp.state)

    def _truncate(self, n: int) -> None:
        if self.pos > self.capacity:
            raise ValueError(f"this window cache has evicted {self.evicted} positions; it cannot roll back")
        self.store.clear(n, self.pos)

