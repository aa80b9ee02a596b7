"""KV caches: a preallocated static cache and a grow-by-``torch.cat`` concat cache.

Both share one small API (nanochat's engine): ``pos``, ``advance(n)``, ``reset()``,
``layer(i)`` and ``update(layer_idx, k, v)``, plus the two moves decoding strategies make:
``truncate(n)`` (speculative decoding's rollback, an edited chat message) and ``reorder(index)``
(beam search picks each row's parent). Attention layers only call ``update``; the
generator alone moves ``pos`` forward, so a layer can never silently advance the cache.

A step is planned, run, then committed: ``plan_step(ids)`` before the forward (the paged cache
claims the step's blocks there, not inside a layer), the forward's ``update`` calls, then
``advance(T)``; ``abort_step()`` drops a plan whose forward raised. A chat turn is a transaction
over many steps: ``checkpoint(keep)`` before it, ``restore(cp)`` undoes everything since (the
accelerator's direct writes included, since they land in the same buffers), ``commit(cp)``
forgets the undo data.

Byte accounting is exact (it is what the app and the memory calculator compare against):
``bytes_allocated`` is the storage the tensors hold; ``bytes_used`` is what the ``pos``
filled positions occupy, ``layer_bytes()`` the same per layer.

Per-layer kinds (Gemma 3's hybrid attention; Mistral, whose every layer slides): ``layer_windows(config)``
gives each layer's window, None for a global layer. The static cache keeps a ring of W rows for a sliding layer (position p
in slot p % W) and every position for a global one; ``ring_positions`` tells the model which
position each returned K row holds, so it can mask a chunk that crosses the window.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.units import kv_bytes_per_token


@dataclass(frozen=True)
class Checkpoint:
    """What ``KVCache.restore`` needs: the position, the batch, and the kind's own undo data."""

    pos: int
    keep: int  # nothing below this position is written before the restore
    batch: int
    bytes_copied: int
    state: Any


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's window (a sliding layer keeps its last W positions) or None (a global layer keeps
    every one): per-layer kinds (``layer_types``, Gemma 3) give a window to their sliding layers;
    one ``sliding_window`` without them (Mistral) is every layer's window."""
    kinds = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if kinds is None:
        return (None if window is None else int(window),) * config.n_layer
    w = int(window)
    return tuple(w if k == "sliding" else None for k in kinds)


def ring_rows(windows: tuple[int | None, ...], context: int, start: int, window: int, T: int) -> torch.Tensor | None:
    """The position each K row of a ring of ``window`` holds for a T-token step at ``start`` (the
    static and quantized caches' sliding layers), or None while slot = position."""
    w = min(window, context)
    if w not in windows or start + T <= w:
        return None  # no ring of this window, or nothing overwritten yet: slot = position
    if T == 1:  # written in place: slot s holds the position in start-W+1..start that is s mod W
        lo = start - w + 1
        return lo + (torch.arange(w) - lo) % w
    held = min(start, w)
    lo = max(0, start - w)
    old = lo + (torch.arange(held) - lo) % w if start > w else torch.arange(held)
    return torch.cat([old, torch.arange(start, start + T)])  # the ring's rows, then the chunk's


class KVCache(ABC):
    kind: str = ""
    copies_on_reorder = True  # reorder copies every filled position (the paged cache shares instead)
    # A ragged cache (the serving scheduler's, engine/serving/ragged_cache.py) holds many requests, each at
    # its own position: the models then skip their own mask and let ``cache.attend`` attend per request.
    ragged = False

    def __init__(self, config: GPTConfig, batch: int, device: torch.device | str, dtype: torch.dtype) -> None:
        self.config = config
        self.batch = batch
        self.device = torch.device(device)
        self.dtype = dtype
        self.pos = 0  # tokens committed so far; only the generator moves it
        self.bytes_copied = 0  # cumulative bytes this cache wrote or copied (O(T) vs O(T^2))
        # Fixed for the cache's life; read on every step's event, so computed once.
        self.bytes_per_token = self._token_bytes()

    def _token_bytes(self) -> int:
        """Bytes one position occupies (every layer, K and V, every row); a quantized store overrides it."""
        return int(kv_bytes_per_token(self.config.n_layer, self.config.kv_heads, self.config.head_dim,
                                      self.dtype.itemsize, self.batch))

    @property
    def held(self) -> int:
        """Positions the cache holds now: ``pos``, except for a window that has evicted some."""
        return self.pos

    def max_feed(self) -> int:
        """The most tokens the next forward may write at once. A window cache that is full takes one
        at a time: each token sees a different set of kept positions, which one K tensor cannot give."""
        return self.config.block_size - self.pos

    def advance(self, n: int) -> None:
        if self.pos + n > self.config.block_size:
            raise ValueError(f"cache overflow: {self.pos} + {n} > block_size {self.config.block_size}")
        self.pos += n

    @property
    def bytes_used(self) -> int:
        return self.pos * self.bytes_per_token

    def layer_bytes(self) -> list[int]:
        """Bytes each layer's held positions occupy (K and V, every row); sums to ``bytes_used``
        for the dense kinds. Here every layer holds ``held`` positions of equal size."""
        per = self.bytes_per_token // self.config.n_layer
        return [self.held * per] * self.config.n_layer

    def can_truncate(self, n: int) -> bool:
        """Whether ``truncate(n)`` can give back positions n-W..n-1 of every layer (a ring cannot once
        it has overwritten them)."""
        return 0 <= n <= self.pos

    def ring_positions(self, window: int, T: int) -> torch.Tensor | None:
        """The position each K row of a sliding layer's ``update`` holds for a T-token step at ``pos``,
        or None when those rows are positions 0..pos+T-1 in order (the model's usual masks apply)."""
        return None

    @property
    @abstractmethod
    def bytes_allocated(self) -> int: ...

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The filled part of layer i: K and V, each (B, nkv, pos, hs)."""

    @abstractmethod
    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nkv, T, hs) at positions pos..pos+T; return all K, V up to pos+T."""

    def plan_step(self, idx: torch.Tensor, *, hash_ids: bool = True) -> None:
        """Before a forward: the ids (B, T) of the positions it writes. The paged cache claims
        the step's blocks here (copy-on-write first) and keeps the ids for its prefix hashes
        (unless ``hash_ids`` is False). The dense kinds need no plan: every slot a step can write
        exists from the start (static, quantized, window) or is made by the write (concat), and
        nothing is hashed. ``advance`` commits the step, ``abort_step`` drops it."""

    def abort_step(self) -> None:
        """Drop the planned step (its forward raised): ``pos`` never moved, and the rows the forward
        wrote past it are never read; the paged cache gives back the blocks the plan claimed."""

    # ------------------------------------------------------------------ transactions
    def checkpoint(self, keep: int) -> Checkpoint:
        """Undo data for everything from now until ``restore``, given that until then nothing below
        position ``keep`` is written or truncated away (a chat turn: keep = the prefix it reuses).
        A static or quantized cache copies positions keep..pos, a window its slots, a concat cache
        only its tensor references (it never writes in place), a paged cache its bookkeeping (and
        journals each live block before the first write into it)."""
        if not 0 <= keep <= self.pos:
            raise ValueError(f"cannot checkpoint a cache of {self.pos} positions from {keep}")
        self.abort_step()
        return Checkpoint(self.pos, keep, self.batch, self.bytes_copied, self._save(keep))

    def restore(self, cp: Checkpoint) -> None:
        """Put the cache back exactly as it was at ``checkpoint`` (positions, contents, tables,
        ref counts): a turn interrupted anywhere, even inside a layer's forward, leaves no trace."""
        if cp.batch != self.batch:
            raise ValueError("a checkpoint cannot undo a reorder to another batch size")
        self._load(cp)
        self.pos, self.bytes_copied = cp.pos, cp.bytes_copied

    def commit(self, cp: Checkpoint) -> None:
        """The transaction ended well: forget the undo data (the paged pool stops journaling)."""

    def _save(self, keep: int) -> Any:
        raise NotImplementedError(f"a {self.kind} cache cannot checkpoint")

    def _load(self, cp: Checkpoint) -> None:
        raise NotImplementedError(f"a {self.kind} cache cannot restore")

    def truncate(self, n: int) -> None:
        """Forget every position from n on: the cache then equals one that only ever held 0..n."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"cannot truncate a cache of {self.pos} positions to {n}")
        self._truncate(n)
        self.pos = n

    def reorder(self, index: torch.Tensor) -> int:
        """Row r becomes old row index[r] (beam search's parents); len(index) may differ from the
        batch (one prompt row fanned out to k beams). Returns the bytes this moved."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.device).reshape(-1)
        if index.numel() == 0 or int(index.min()) < 0 or int(index.max()) >= self.batch:
            raise ValueError(f"reorder index must pick rows in 0..{self.batch - 1}")
        self._reorder(index)
        self.batch = int(index.numel())
        self.bytes_per_token = self._token_bytes()
        # every filled position of every new row is copied, unless the cache shares by reference
        moved = self._moved_bytes() if self.copies_on_reorder else 0
        self.bytes_copied += moved
        return moved

    def _moved_bytes(self) -> int:
        """What a reorder copies: every held position of every new row."""
        return self.held * self.bytes_per_token

    @abstractmethod
    def _truncate(self, n: int) -> None: ...

    @abstractmethod
    def _reorder(self, index: torch.Tensor) -> None: ...


class StaticKVCache(KVCache):
    """Preallocated (B, nkv, block_size, hs) K and V per layer, written in place (gpt-fast)."""

    kind = "static"

    def __init__(self, config: GPTConfig, batch: int = 1, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, batch, device, dtype)
        # A sliding layer's ring: W rows (never more than the context); a global layer: every position.
        self.windows = tuple(None if w is None else min(w, config.block_size) for w in layer_windows(config))
        rows = [config.block_size if w is None else w for w in self.windows]
        # empty, not zeros: reads never go past pos, and zero-filling touches every page of the
        # buffer up front (3.2 ms per run for tiny's 8 MB on CPU) where a run of N tokens
        # touches only the pages its positions land on.
        self.k = [torch.empty((batch, config.kv_heads, r, config.head_dim), device=self.device, dtype=dtype)
                  for r in rows]
        self.v = [torch.empty((batch, config.kv_heads, r, config.head_dim), device=self.device, dtype=dtype)
                  for r in rows]
        # one position of one layer: K and V, every row and head
        self._row_bytes = 2 * batch * config.kv_heads * config.head_dim * dtype.itemsize
        self._allocated = sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)  # never changes
        self._hi = 0  # one past the highest position any update wrote (what a restore must clear)

    @property
    def bytes_allocated(self) -> int:
        return self._allocated

    def reset(self) -> None:
        # Nothing to clear: reads stop at pos, and the next tokens overwrite the old ones.
        self.pos = 0
        self.bytes_copied = 0

    def _filled(self, i: int) -> int:
        """Rows of layer i that hold a position: pos, or the ring's min(pos, W)."""
        w = self.windows[i]
        return self.pos if w is None else min(self.pos, w)

    @property
    def bytes_used(self) -> int:
        return sum(self.layer_bytes())

    def layer_bytes(self) -> list[int]:
        return [self._filled(i) * self._row_bytes for i in range(self.config.n_layer)]

    def _moved_bytes(self) -> int:
        return self.bytes_used  # a ring moves only the rows it holds

    def can_truncate(self, n: int) -> bool:
        # A ring past its window has overwritten positions pos-W-.. that a shorter cache would hold.
        return 0 <= n <= self.pos and (n == self.pos or all(w is None or self.pos <= w for w in self.windows))

    def ring_positions(self, window: int, T: int) -> torch.Tensor | None:
        return ring_rows(self.windows, self.config.block_size, self.pos, window, T)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._filled(i)  # a ring's rows in slot order (ring_positions(W, 1) names them once full)
        return self.k[i][:, :, :n], self.v[i][:, :, :n]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, T = self.pos, k.shape[2]
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        w = self.windows[layer_idx]
        if w is not None and start + T > w:
            return self._ring_update(kc, vc, start, w, k, v)
        # Copies into the preallocated buffer: no allocation per step. narrow + copy_ rather
        # than slice assignment: two dispatcher calls instead of Python's indexing machinery.
        if start + T > self._hi:  # before the copies: one may fail halfway
            self._hi = start + T
        kc.narrow(2, start, T).copy_(k)
        vc.narrow(2, start, T).copy_(v)
        self.bytes_copied += 2 * k.nbytes
        return kc.narrow(2, 0, start + T), vc.narrow(2, 0, start + T)  # views (B, nkv, pos+T, hs)

    # ------------------------------------------------------------------ a writer in C
    def step_buffers(self, T: int = 1) -> tuple[torch.Tensor, ...] | None:
        """K0, V0, K1, V1, ...: every layer's whole buffer (B, nkv, rows, hs), for a writer that
        stores the next T positions' K/V itself (the accelerator's one-call decode step in C,
        fast/rowstep.py) at the slots ``step_slots`` names, and reads rows 0..pos+T-1 back. A ring
        layer's buffer has its window's rows and serves while those positions fit in it (slots
        are then positions); None once one would wrap: only ``update`` writes a ring past it."""
        if any(w is not None and self.pos + T > w for w in self.windows):
            return None
        return tuple(t for pair in zip(self.k, self.v) for t in pair)

    def step_slots(self, T: int) -> int:
        """A direct writer's ``update``: positions pos..pos+T-1 of every layer go to slots
        pos..pos+T-1 of ``step_buffers``, which the caller writes. Counted here exactly as ``update``
        counts them (K and V of every layer: ``bytes_copied``) and noted for a restore before the
        write, as ``update`` does; returns the first slot."""
        start = self.pos
        if start + T > self.config.block_size:
            raise ValueError(f"cache overflow: {start} + {T} > block_size {self.config.block_size}")
        if start + T > self._hi:
            self._hi = start + T
        self.bytes_copied += T * self._row_bytes * self.config.n_layer
        return start

    def _ring_update(self, kc: torch.Tensor, vc: torch.Tensor, start: int, w: int, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding layer past its window: position p goes to slot p % W."""
        T = k.shape[2]
        self._hi = max(self._hi, w)
        self.bytes_copied += 2 * k.nbytes
        if T == 1:  # decode: overwrite the oldest row; the ring is then exactly the query's window
            kc.narrow(2, start % w, 1).copy_(k)
            vc.narrow(2, start % w, 1).copy_(v)
            return kc, vc  # (B, nkv, W, hs)
        # A chunk: its first queries need ring rows its last tokens would overwrite, so the keys
        # are the ring before the write, then the chunk (ring_positions names them), and only the
        # chunk's last W rows are kept.
        held = min(start, w)
        ks = torch.cat([kc[:, :, :held], k], dim=2)  # (B, nkv, held+T, hs)
        vs = torch.cat([vc[:, :, :held], v], dim=2)
        n = min(T, w)
        slots = torch.arange(start + T - n, start + T, device=kc.device) % w
        kc.index_copy_(2, slots, k[:, :, T - n:])
        vc.index_copy_(2, slots, v[:, :, T - n:])
        return ks, vs

    def _save(self, keep: int) -> Any:
        # (B, nkv, pos-keep, hs) per global layer: what a truncation to keep and the writes after it
        # lose; a ring overwrites its oldest row on every step whatever keep says, so all of it.
        return [t[:, :, keep: self.pos].clone() if w is None else t.clone()
                for t, w in zip((*self.k, *self.v), self.windows * 2)]

    def _load(self, cp: Checkpoint) -> None:
        # Every write was noted in _hi first: update's, and the C step's through step_slots.
        hi = min(max(self._hi, self.pos), self.config.block_size)
        for t, old, w in zip((*self.k, *self.v), cp.state, self.windows * 2):
            if w is not None:
                t.copy_(old)
                continue
            t[:, :, cp.keep: hi].zero_()  # as a cache that never saw the turn (truncate's convention)
            t[:, :, cp.keep: cp.pos].copy_(old)
        self._hi = cp.pos

    def _truncate(self, n: int) -> None:
        if not self.can_truncate(n):
            raise ValueError(f"this cache's sliding layers keep a ring of their last {max(w for w in self.windows if w)} "
                             f"positions and have overwritten the ones before {self.pos}; they cannot roll back to {n}")
        # Zero the forgotten positions: nothing reads past pos, but a rolled-back cache should
        # hold exactly what a cache that never saw them holds, so a test can compare the buffers.
        hi = min(max(self._hi, self.pos), self.config.block_size)
        for t in (*self.k, *self.v):
            t[:, :, n: min(hi, t.shape[2])].zero_()
        self._hi = n

    def _reorder(self, index: torch.Tensor) -> None:
        # Only the filled positions move. The same batch reorders in place (index_select copies
        # first, so a row may feed several); a new batch size needs new buffers, left empty past
        # pos for the reason __init__ gives.
        same = index.numel() == self.batch
        for buf in (self.k, self.v):
            for i, old in enumerate(buf):
                n = self._filled(i)
                picked = old[:, :, :n].index_select(0, index)  # (B', nkv, filled, hs)
                new = old if same else torch.empty((index.numel(), *old.shape[1:]), device=self.device,
                                                   dtype=self.dtype)
                new[:, :, :n] = picked
                buf[i] = new
        self._allocated = sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)
        self._row_bytes = 2 * index.numel() * self.config.kv_heads * self.config.head_dim * self.dtype.itemsize


class ConcatKVCache(KVCache):
    """Grows by ``torch.cat`` every step, like the seed code and transformers' DynamicLayer.

    Kept on purpose: every step allocates a new tensor and copies the whole history, so total
    bytes copied grow as O(T^2). The app and the benchmark show that cost.
    """

    kind = "concat"

    def __init__(self, config: GPTConfig, batch: int = 1, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, batch, device, dtype)
        self.reset()

    def reset(self) -> None:
        empty = (self.batch, self.config.kv_heads, 0, self.config.head_dim)
        self.k = [torch.empty(empty, device=self.device, dtype=self.dtype) for _ in range(self.config.n_layer)]
        self.v = [torch.empty(empty, device=self.device, dtype=self.dtype) for _ in range(self.config.n_layer)]
        self.pos = 0
        self.bytes_copied = 0

    @property
    def bytes_allocated(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i][:, :, : self.pos], self.v[i][:, :, : self.pos]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The layer may be written twice before advance() only in misuse; slice to pos first.
        old_k = self.k[layer_idx][:, :, : self.pos]
        old_v = self.v[layer_idx][:, :, : self.pos]
        nk = torch.cat([old_k, k], dim=2)  # (B, nkv, pos+T, hs): a fresh allocation + full copy
        nv = torch.cat([old_v, v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = nk, nv
        self.bytes_copied += nk.nbytes + nv.nbytes
        return nk, nv

    def _truncate(self, n: int) -> None:
        self.k = [t[:, :, :n] for t in self.k]  # views; the next update's cat copies them anyway
        self.v = [t[:, :, :n] for t in self.v]

    def _save(self, keep: int) -> Any:
        # Nothing here is written in place (update cats, truncate slices, reorder selects): the
        # tensors of now are the checkpoint.
        return list(self.k), list(self.v)

    def _load(self, cp: Checkpoint) -> None:
        self.k, self.v = list(cp.state[0]), list(cp.state[1])

    def _reorder(self, index: torch.Tensor) -> None:
        self.k = [t[:, :, : self.pos].index_select(0, index) for t in self.k]  # (B', nkv, pos, hs)
        self.v = [t[:, :, : self.pos].index_select(0, index) for t in self.v]


CACHE_KINDS: dict[str, type[KVCache]] = {"static": StaticKVCache, "concat": ConcatKVCache}
