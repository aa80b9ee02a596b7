"""Compressed KV caches: quantized rows (int8, int4, fp8) and sliding windows with StreamingLLM sinks.

Both keep the KVCache contract: ``update`` stores the new rows and returns every K/V the new
queries attend to, ``pos`` counts every token the sequence has had (the models' positions),
and ``held`` the positions the cache still holds.

The window cache needs no change in the models' masks: while the sinks + window slots are not
full it is an ordinary cache (K length = pos + T, the usual causal mask), and once full it takes
one token per forward (``max_feed``), whose query sees every held row, so no mask at all. Except
on a layer with its own sliding window (Gemma 3's sliding layers): ``ring_positions`` names each
held row's position (in the convention below) and the model masks those outside that window.

Positions once rows are evicted (RoPE models). Attention scores under RoPE depend only on the
distance between a query's and a key's positions. Cached K is stored rotated at its original
position, the query at its own.
- ``positions="original"`` leaves them: the sinks stay ``P - j`` positions behind the query.
- ``positions="cache"`` is StreamingLLM's choice, positions within the cache: the held rows are
  numbered 0..S+W-1 in order, the query last. The window's rows are contiguous up to the query,
  so their distances are unchanged; only the S sinks move, ``E`` (= evicted count) positions
  closer. Rotating the sink keys forward by E (RoPE rotations compose) gives exactly that, and
  costs S rows per layer per step, each layer by its own RoPE base (Gemma 3: ``rope_local_theta`` on
  its sliding layers, ``rope_theta`` on the global ones).
GPT-2 adds learned positions to the input, so its cached rows carry them and cannot be moved
(``kv_spec.resolve`` refuses ``positions="cache"`` there).
"""
from __future__ import annotations

import torch

from typing import Any

from kvviz.engine.kvcache.dense import Checkpoint, KVCache, layer_windows, ring_rows
from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.engine.generation.kv_spec import KVSpec
from kvviz.engine.kvcache.slot_store import ErrorLog, FloatStore, QuantStore
from kvviz.engine.models.llama import apply_rope


def _store(spec: KVSpec, config: GPTConfig, batch: int, slots: int | list[int], device: torch.device,
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
    """``block_size`` slots written in order, stored quantized, dequantized on every read.

    Per-layer kinds (Gemma 3), as the static cache: a sliding layer keeps a ring of its window's W
    slots (position p in slot p % W; ``ring_positions`` names each row for the model's mask), a
    global layer every position. ``rings=False`` keeps every position on every layer (the model's
    sliding mask then hides the old ones): the reference the rings are tested against."""

    kind = "quantized"

    def __init__(self, config: GPTConfig, spec: KVSpec, batch: int = 1, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, rings: bool = True) -> None:
        self.spec = spec
        wins = layer_windows(config) if rings else (None,) * config.n_layer
        self.windows = tuple(None if w is None else min(w, config.block_size) for w in wins)
        rows = [config.block_size if w is None else w for w in self.windows]
        self.store = _store(spec, config, batch, rows, torch.device(device), dtype)
        super().__init__(config, batch, device, dtype)

    def _held(self, i: int) -> int:
        """Positions layer i holds: pos, or a ring's min(pos, W)."""
        w = self.windows[i]
        return self.pos if w is None else min(self.pos, w)

    def layer_bytes(self) -> list[int]:
        n = self.config.n_layer  # every layer's slot is the same size; fp8's scales are per layer
        return [self._held(i) * (self.bytes_per_token // n) + self.store.fixed_bytes // n for i in range(n)]

    @property
    def bytes_used(self) -> int:
        return sum(self.layer_bytes())

    def _moved_bytes(self) -> int:
        return sum(self._held(i) for i in range(self.config.n_layer)) * (self.bytes_per_token // self.config.n_layer)

    def ring_positions(self, window: int, T: int) -> torch.Tensor | None:
        return ring_rows(self.windows, self.config.block_size, self.pos, window, T)

    def can_truncate(self, n: int) -> bool:
        # A ring past its window has overwritten positions a shorter cache would hold.
        return 0 <= n <= self.pos and (n == self.pos or all(w is None or self.pos <= w for w in self.windows))

    def reset(self) -> None:
        self.store.clear(0, self.store.slots)
        self.pos = 0
        self.bytes_copied = 0

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.read(i, self._held(i))  # a ring's rows in slot order

    _hi = 0  # one past the highest slot any update wrote (what a restore must clear)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, w = k.shape[2], self.windows[layer_idx]
        self._hi = max(self._hi, self.pos + T)  # before the write: it may fail halfway
        self.bytes_copied += 2 * k.nbytes
        if w is not None and self.pos + T > w:
            return self._ring_update(layer_idx, w, k, v)
        self.store.write(layer_idx, self.pos, k, v)
        return self.store.read(layer_idx, self.pos + T)  # (B, nkv, pos+T, hs), dequantized

    def _ring_update(self, i: int, w: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding layer past its window, as the static cache's ring (dense.py), read dequantized."""
        start, T = self.pos, k.shape[2]
        st = self.store
        if T == 1:  # decode: overwrite the oldest row; the ring is then exactly the query's window
            st.write(i, start % w, k, v, position=start)
            return st.read(i, w)  # (B, nkv, W, hs)
        # A chunk: the ring before the write, then the chunk as a read would give it back (its
        # first queries need rows its last tokens overwrite); only its last W rows are kept.
        st.set_scale(i, k, v)  # fp8: the scale of the whole first write, as without a ring
        old_k, old_v = st.read(i, min(start, w))
        kd, vd = st.roundtrip(i, k, v)
        ks, vs = torch.cat([old_k, kd], dim=2), torch.cat([old_v, vd], dim=2)  # (B, nkv, held+T, hs)
        n = min(T, w)
        a = (start + T - n) % w  # the slot of the first kept row; the rest wrap past W to 0
        m = min(n, w - a)
        st.write(i, a, k[:, :, T - n: T - n + m], v[:, :, T - n: T - n + m], position=start + T - n)
        if n > m:
            st.write(i, 0, k[:, :, T - n + m:], v[:, :, T - n + m:], position=start + T - n + m)
        return ks, vs

    def _truncate(self, n: int) -> None:
        if not self.can_truncate(n):
            raise ValueError(f"this cache's sliding layers keep a ring of their last {max(w for w in self.windows if w)} "
                             f"positions and have overwritten the ones before {self.pos}; they cannot roll back to {n}")
        self.store.clear(n, self.pos)

    def _save(self, keep: int) -> Any:
        # A ring overwrites its oldest row on every step whatever keep says: then every slot from 0.
        return self.store.save(0 if any(self.windows) else keep, self.pos)

    def _load(self, cp: Checkpoint) -> None:
        # Rows a failed forward wrote past pos too.
        self.store.clear(cp.state["a"], max(self._hi, self.pos))
        self.store.load(cp.state)
        self._hi = cp.pos


def layer_thetas(config: GPTConfig) -> list[float]:
    """Each layer's RoPE base: Gemma 3's sliding layers (``layer_types``) rotate with
    ``rope_local_theta``, every other layer with ``rope_theta``."""
    kinds = getattr(config, "layer_types", None) or ("full",) * config.n_layer
    glob = float(getattr(config, "rope_theta"))
    return [float(getattr(config, "rope_local_theta")) if k == "sliding" else glob for k in kinds]


class WindowKVCache(_StoreCache):
    """``sinks`` slots kept forever, then a ring of ``window`` slots: exactly S + W rows once full,
    the same rows on every layer (Gemma 3's sliding layers mask those outside their own window by
    the positions ``ring_positions`` names)."""

    kind = "window"

    def __init__(self, config: GPTConfig, spec: KVSpec, batch: int = 1, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        assert spec.window is not None and spec.positions is not None, "resolve the spec first (kv_spec.resolve)"
        self.spec = spec
        self.sinks, self.window = spec.sinks, spec.window
        self.capacity = spec.sinks + spec.window
        self.store = _store(spec, config, batch, self.capacity, torch.device(device), dtype)
        super().__init__(config, batch, device, dtype)
        # Each layer's RoPE frequencies, to move its sinks (None: nothing is rotated).
        self.inv_freq: list[torch.Tensor | None] = [None] * config.n_layer
        if spec.positions == "cache" and spec.sinks:
            hs = config.head_dim
            # as rope_tables computes them, in fp64 so a rotation by E adds no error of its own
            thetas = layer_thetas(config)
            freqs = {t: 1.0 / (t ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs)) for t in set(thetas)}
            self.inv_freq = [freqs[t] for t in thetas]

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
        ks, vs = self.store.read(layer_idx, self.capacity)  # (B, nkv, S+W, hs), slot order (ring_positions)
        freqs = self.inv_freq[layer_idx]
        if freqs is not None:
            e = self.pos + 1 - self.capacity  # positions evicted once this token is in
            ks = torch.cat([self._rotate(ks[:, :, : self.sinks], e, freqs), ks[:, :, self.sinks:]], dim=2)
        return ks, vs

    def ring_positions(self, window: int, T: int) -> torch.Tensor | None:
        """The position each row ``update`` returns stands at for a T-token step at ``pos``, in the
        spec's convention (the sinks at j + E under ``positions="cache"``, where their rotated keys
        now sit; at j under "original"), or None while nothing is evicted (slot = position). The
        same rows on every layer; a sliding layer (Gemma 3) masks those outside its ``window``."""
        if self.pos + T <= self.capacity or T != 1:
            return None  # an ordinary cache; a longer step past capacity is refused by update
        S, W = self.sinks, self.window
        lo = self.pos - W + 1  # the oldest position the ring holds once this token is in
        ring = lo + (torch.arange(W) - (lo - S)) % W  # slot S + s holds the q in lo..pos with (q - S) % W == s
        shift = self.pos + 1 - self.capacity if self.spec.positions == "cache" else 0
        return torch.cat([torch.arange(S) + shift, ring])  # (S+W,)

    def _rotate(self, k: torch.Tensor, e: int, inv_freq: torch.Tensor) -> torch.Tensor:
        """Keys rotated at position p -> rotated at p + e (RoPE: R(p + e) = R(e) R(p))."""
        ang = torch.cat([inv_freq, inv_freq]) * e  # (hs,): the half-split layout
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

