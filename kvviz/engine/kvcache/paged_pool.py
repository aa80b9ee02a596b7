"""The paged cache's physical pool, and how a hybrid model's layers share it (vLLM's hybrid allocator).

A model whose layers are all of one kind (every layer sees every position) has one *group* of
layers: a block holds ``block_size`` positions of every layer, one block table per sequence.

A model with per-layer kinds (Gemma 3: sliding-window layers between global ones) splits its
layers into groups of one kind and equal size (the smallest kind's layer count, as vLLM's
``HybridKVCacheCoordinator`` does), e.g. Gemma 3 270M: 3 global + 15 sliding layers -> one global
group and five sliding groups of 3 layers. Every group has its own block table per sequence, and
all of them draw blocks from one pool whose block holds ``block_size`` positions of one group's
layers: layer i reads tensor ``slot_of[i]`` at its group's block ids. So a block that a sliding
group lets go (its positions slid out of the window) serves any group next: the memory the window
saves is really free, not reserved per kind. A kind whose count is not a multiple of the group
size gets a last, shorter group; its blocks leave the missing layers' tensors idle (vLLM pads the
same way), which ``block_bytes`` counts and ``layer_bytes`` does not.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from dataclasses import dataclass

import torch

from kvviz.engine.kvcache.block_pool import BlockPool
from kvviz.engine.kvcache.dense import layer_windows
from kvviz.engine.models.gpt2_config import GPTConfig


@dataclass(frozen=True)
class LayerGroups:
    """Which layers share a block table: each group's window (None: global) and layers."""

    windows: tuple[int | None, ...]  # per group: None (sees every position) or its sliding window
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, in order
    size: int  # layers a block holds: the largest group
    group_of: tuple[int, ...]  # per layer: its group
    slot_of: tuple[int, ...]  # per layer: its index in its group = the pool tensor it reads

    @property
    def count(self) -> int:
        return len(self.layers)

    @property
    def hybrid(self) -> bool:
        return any(w is not None for w in self.windows)


def layer_groups(windows: Sequence[int | None]) -> LayerGroups:
    """Split layers (each with its window, None for a global layer) into equal groups of one kind.
    Global groups come first, so group 0 is global whenever the model has a global layer."""
    by_kind: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_kind.setdefault(w, []).append(i)
    size = min(len(ls) for ls in by_kind.values())
    order = sorted(by_kind, key=lambda w: (w is not None, by_kind[w][0]))
    gw: list[int | None] = []
    gl: list[tuple[int, ...]] = []
    for w in order:
        ls = by_kind[w]
        for a in range(0, len(ls), size):
            gw.append(w)
            gl.append(tuple(ls[a:a + size]))
    group_of = [0] * len(windows)
    slot_of = [0] * len(windows)
    for g, ls in enumerate(gl):
        for s, i in enumerate(ls):
            group_of[i], slot_of[i] = g, s
    return LayerGroups(tuple(gw), tuple(gl), size, tuple(group_of), tuple(slot_of))


def config_groups(config: GPTConfig) -> LayerGroups:
    """A model's layer groups: its layers' windows (dense.layer_windows), clipped to its context."""
    return layer_groups([None if w is None else min(w, config.block_size) for w in layer_windows(config)])


def first_needed_block(pos: int, window: int | None, block_size: int) -> int:
    """The first block a layer of this window still needs once ``pos`` positions are in: the next
    query (at pos) sees keys pos - window + 1 .. pos, so blocks wholly below that are never read
    again (vLLM's ``SlidingWindowManager.remove_skipped_blocks``). 0 for a global layer."""
    if window is None:
        return 0
    return max(0, pos - window + 1) // block_size


def blocks_held(pos: int, window: int | None, block_size: int) -> int:
    """Blocks one sequence's table of this window holds after ``pos`` positions."""
    return blocks_for(pos, block_size) - first_needed_block(pos, window, block_size)


class PagedPool:
    """The physical blocks plus their bookkeeping; caches may share one pool.

    Per group slot s, one K and one V tensor of shape (num_blocks, nkv, block_size, hs): block b of
    group g's table holds layer ``layers[g][s]``'s rows in tensor s at index b."""

    def __init__(self, config: GPTConfig, num_blocks: int, block_size: int = 16,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.blocks = BlockPool(num_blocks, block_size)
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.groups = config_groups(config)
        shape = (num_blocks, config.kv_heads, block_size, config.head_dim)
        # empty, not zeros (as the static cache): a slot is read only after it was written.
        self.k = [torch.empty(shape, device=self.device, dtype=dtype) for _ in range(self.groups.size)]
        self.v = [torch.empty(shape, device=self.device, dtype=dtype) for _ in range(self.groups.size)]
        self.layer_block_bytes = 2 * config.kv_heads * config.head_dim * dtype.itemsize * block_size  # K+V, one layer
        self.block_bytes = self.layer_block_bytes * self.groups.size  # one block: one group's layers
        self.slot_bytes = self.block_bytes // block_size  # one token of one group
        self.bytes_allocated = sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def blocks_for_sequence(self, tokens: int) -> int:
        """The most blocks one sequence of ``tokens`` claims at once: every group's table covers
        them all while a prefill writes them (a sliding group lets its old blocks go only after)."""
        return self.groups.count * -(-tokens // self.block_size)

    def copy_block(self, src: int, dst: int) -> None:
        for t in (*self.k, *self.v):
            t[dst].copy_(t[src])  # (nkv, bs, hs) of every layer of the block's group

    # A transaction's journal: the blocks live (in a table or cached) when it began, and a copy of
    # each one taken before its first write since; restoring writes the copies back.
    journal: dict[int, list[torch.Tensor]] | None = None
    _live: frozenset[int] = frozenset()

    def begin_journal(self) -> None:
        bp = self.blocks
        self.journal = {}
        self._live = frozenset(b for b in range(bp.num_blocks) if bp.ref_count[b] > 0 or b in bp.lru)

    def before_write(self, b: int) -> None:
        """Block b is about to be written: journal it first if a transaction needs its contents."""
        if self.journal is not None and b in self._live and b not in self.journal:
            self.journal[b] = [t[b].clone() for t in (*self.k, *self.v)]  # (nkv, bs, hs) each

    def end_journal(self, restore: bool) -> None:
        if restore and self.journal:
            for b, saved in self.journal.items():
                for t, old in zip((*self.k, *self.v), saved):
                    t[b].copy_(old)
        self.journal, self._live = None, frozenset()


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def pool_blocks(groups: int, blocks_per_row: int, rows: int = 1) -> int:
    """The blocks a pool needs for ``rows`` sequences of ``blocks_per_row`` blocks each, unshared:
    every layer group keeps its own table per sequence and a block holds one group's layers, so each
    row's blocks are needed once per group (``config_groups(config).count``; 1 unless the model has
    per-layer kinds). Every place that sizes a pool nobody sized (the paged cache's default, a
    conversation, beam search and speculative decoding, the Chat page's widget) counts with this."""
    return max(1, groups) * rows * blocks_per_row


@dataclass(frozen=True)
class PagedStats:
    """Exact accounting of one paged cache's tables over its pool."""

    block_size: int
    block_bytes: int  # one block, K and V, every layer of one group (every layer unless hybrid)
    num_blocks: int
    blocks_used: int  # distinct blocks these tables point at
    blocks_shared: int  # of those, pointed at more than once (ref count > 1)
    blocks_free: int  # the pool's free list
    blocks_cached: int  # ref 0, hashed: kept for a prefix hit, evicted first when the pool is full
    bytes_allocated: int  # the whole pool
    bytes_held: int  # blocks_used * block_bytes
    bytes_filled: int  # the slots of held blocks that hold a token
    fragmentation_bytes: int  # bytes_held - bytes_filled: the partial blocks' empty slots
    bytes_unshared: int  # what the same tables need if no block were shared (the calculator's --paged figure)
    bytes_saved_by_sharing: int  # bytes_unshared - bytes_held
    cow_copies: int
    evictions: int
    prefix_hits: int  # blocks taken back by hash instead of recomputed

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


Tables = list[list[list[int | None]]]  # [group][row][logical block] -> physical block, None once let go


def _held(gtables: Tables, pos: int, bs: int) -> tuple[dict[int, int], dict[int, int]]:
    """Every held block: how many table entries point at it, and how many of its slots hold a token."""
    n = blocks_for(pos, bs)
    refs: dict[int, int] = {}
    fill: dict[int, int] = {}  # a shared block sits at the same index j in every table that holds it
    for tables in gtables:
        for t in tables:
            for j, b in enumerate(t[:n]):
                if b is not None:
                    refs[b] = refs.get(b, 0) + 1
                    fill[b] = min(bs, pos - j * bs)
    return refs, fill


def table_stats(pool: PagedPool, gtables: Tables, pos: int) -> PagedStats:
    bp, bs = pool.blocks, pool.block_size
    refs, fill = _held(gtables, pos, bs)
    filled = sum(fill.values())
    used = len(refs)
    unshared = sum(refs.values()) * pool.block_bytes
    return PagedStats(
        block_size=bs, block_bytes=pool.block_bytes, num_blocks=bp.num_blocks, blocks_used=used,
        blocks_shared=sum(1 for b, n in refs.items() if n > 1 or bp.ref_count[b] > 1),
        blocks_free=len(bp.free), blocks_cached=len(bp.lru), bytes_allocated=pool.bytes_allocated,
        bytes_held=used * pool.block_bytes, bytes_filled=filled * pool.slot_bytes,
        fragmentation_bytes=used * pool.block_bytes - filled * pool.slot_bytes,
        bytes_unshared=unshared, bytes_saved_by_sharing=unshared - used * pool.block_bytes,
        cow_copies=bp.cow_copies, evictions=bp.evictions, prefix_hits=bp.hits,
    )


def table_snapshot(pool: PagedPool, gtables: Tables, freed: list[int], pos: int,
                   new_slots: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Plain data for the views: every block's state, ref count and owners; the tables (group 0's;
    -1 for a block a sliding group let go) and every group's (window, layers, tables, blocks let go)."""
    bp, bs = pool.blocks, pool.block_size
    n = blocks_for(pos, bs)
    owners: list[list[int]] = [[] for _ in range(bp.num_blocks)]
    fill = [0] * bp.num_blocks
    refs, held_fill = _held(gtables, pos, bs)
    for tables in gtables:
        for r, t in enumerate(tables):
            for b in t[:n]:
                if b is not None:
                    owners[b].append(r)
    for b, f in held_fill.items():
        fill[b] = f
    for b in bp.lru:
        fill[b] = bs

    def plain(tables: list[list[int | None]]) -> list[list[int]]:
        return [[-1 if b is None else b for b in t[:n]] for t in tables]

    g = pool.groups
    return {
        "num_blocks": bp.num_blocks, "block_size": bs, "pos": pos,
        "ref_count": list(bp.ref_count), "state": [bp.state(b) for b in range(bp.num_blocks)],
        "hash": [h.hex()[:8] if h else None for h in bp.hash_of], "owners": owners, "fill": fill,
        "tables": plain(gtables[0]), "new_slots": list(new_slots),
        "groups": [{"window": w, "layers": list(ls), "tables": plain(t), "freed": f}
                   for w, ls, t, f in zip(g.windows, g.layers, gtables, freed)],
        "stats": table_stats(pool, gtables, pos).to_dict(),
    }
