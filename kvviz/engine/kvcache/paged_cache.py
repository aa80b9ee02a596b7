"""A paged KV cache (vLLM style): a pool of fixed-size blocks and a block table per sequence.

Physical layout: per layer, one K and one V tensor of shape (num_blocks, nkv, block_size, hs).
A sequence's position p lives in block ``table[p // block_size]`` at slot ``p % block_size``; its
blocks need not be contiguous or in order, so memory is claimed a block at a time (at most
block_size - 1 empty slots per sequence: the internal fragmentation) and several sequences can
point at the same block (a shared prompt, n parallel samples, a prefix-cache hit).

``update`` scatters the new K/V into their slots, then *gathers* this sequence's blocks into a
contiguous (B, nkv, pos+T, hs) tensor for SDPA. That copy is what a fused paged-attention kernel
(vLLM's PagedAttention, FlashInfer, FlashAttention's paged KV) saves: it reads K/V straight from
the blocks through the block table inside the attention kernel, so a decode step never
materializes the sequence (here it copies pos+T slots per layer per step, O(T) bytes per step).
Correctness is the point here: the gathered tensor equals the static cache's, bit for bit.

Sharing is by reference: ``reorder`` (n samples from one prompt, beam parents) copies block
tables and bumps ref counts; nothing moves. A write into a shared or hashed (immutable) block
copies that one block first (copy-on-write). Full blocks are hashed on (parent hash, tokens)
when the loop tells the cache its token ids (``plan_step``), so a later request with the same
prefix can take them back (``match_prefix`` + ``adopt_prefix``) instead of recomputing.

A step's blocks are claimed by ``plan_step`` before the forward (never by a layer), committed by
``advance`` and undone by ``abort_step``; a chat turn's ``checkpoint``/``restore`` copies the
pool's bookkeeping and journals each live block before its first write (docs/paged.md).
"""
from __future__ import annotations

from typing import Any

import torch

from kvviz.engine.kvcache.block_pool import ROOT_HASH, block_hash
from kvviz.engine.kvcache.dense import Checkpoint, KVCache
from kvviz.engine.kvcache.paged_pool import (PagedPool, PagedStats, blocks_for, config_groups, first_needed_block,
                                             pool_blocks, table_snapshot, table_stats)
from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.errors import KVVizError
from kvviz.limits import DEFAULT_KV_BLOCK_SIZE

DEFAULT_BLOCK_SIZE = DEFAULT_KV_BLOCK_SIZE  # vLLM's default (kvviz/limits.py)


class PagedKVCache(KVCache):
    """Block tables over a ``PagedPool``; same API and same numbers as the static cache.

    One table per row per layer group (``pool.groups``; one group unless the model has per-layer
    kinds). A sliding group's table lets go of the blocks wholly out of its window at ``advance``
    (their entries become None; ``freed[g]`` counts them, the same for every row), so its
    ``update`` returns only the held blocks' rows, positions ``freed*bs .. pos+T-1``, which
    ``ring_positions`` names for the model's sliding mask, as the static cache's ring does."""

    kind = "paged"
    copies_on_reorder = False  # reorder shares blocks by reference

    def __init__(self, config: GPTConfig, batch: int = 1, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, block_size: int = DEFAULT_BLOCK_SIZE,
                 num_blocks: int | None = None, pool: PagedPool | None = None) -> None:
        super().__init__(config, batch, device, dtype)
        if pool is None:
            if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= 4096:
                raise KVVizError(f"the paged block size must be 1..4096 tokens (got {block_size!r})")
            if num_blocks is None:  # enough for every row of every group to reach the context unshared
                num_blocks = pool_blocks(config_groups(config).count, blocks_for(config.block_size, block_size), batch)
            pool = PagedPool(config, num_blocks, block_size, device, dtype)
        elif (pool.config.n_layer, pool.config.kv_heads, pool.config.head_dim, pool.dtype) != \
                (config.n_layer, config.kv_heads, config.head_dim, dtype):
            raise ValueError("this pool was built for another model shape or dtype")
        self.pool = pool
        self.groups = pool.groups
        G = self.groups.count
        self.gtables: list[list[list[int | None]]] = [[[] for _ in range(batch)] for _ in range(G)]
        self.freed = [0] * G  # per group: leading blocks let go (out of a sliding window), every row
        # Positions a rollback may take back (speculative decoding sets its draft length): a sliding
        # group keeps the blocks the window of pos - rollback needs, so truncate(pos - rollback) works.
        self.rollback = 0
        self.tokens: list[list[int] | None] = [[] for _ in range(batch)]  # None once ids went untold
        self.hashes: list[list[bytes]] = [[] for _ in range(batch)]  # one per full block
        self.new_slots: list[tuple[int, int, int]] = []  # (row, block, slot) the last step wrote (group 0)
        self._pending: torch.Tensor | None = None
        self._planned: tuple[int, int] | None = None  # (pos, T) of the step whose blocks are claimed
        self._claimed: list[tuple[int, int, int, int | None, bool]] = []
        self._gather: list[torch.Tensor] = []
        self._slot_blk: list[torch.Tensor] = []
        self._slot_off: torch.Tensor | None = None

    @property
    def tables(self) -> list[list[int | None]]:
        """Group 0's tables (every layer's, unless the model has per-layer kinds): one per row."""
        return self.gtables[0]

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def bytes_allocated(self) -> int:
        return self.pool.bytes_allocated

    def _key(self, h: bytes, g: int) -> bytes:
        """Group g's hash of a prefix: group 0's is the chain itself; another group's blocks hold
        other layers, so its key names the group too."""
        return h if g == 0 else block_hash(h, [-1 - g])

    # ------------------------------------------------------------------ writing
    def plan_step(self, idx: torch.Tensor, *, hash_ids: bool = True) -> None:
        """The step plan, before the forward: claim the blocks positions pos..pos+T need, so no
        layer allocates, and keep the ids (B, T) for the prefix hashes (``hash_ids=False``: not
        told, so this row's blocks are hashed no more: drafts a rollback drops, reordered beams)."""
        self._plan(idx.shape[-1])
        self._pending = idx if hash_ids else None

    def _plan(self, T: int) -> None:
        """Claim the blocks positions pos..pos+T need (copy-on-write first) and index their slots.
        ``abort_step`` puts every table back. A copied block another table still holds is let go
        at once (so the last of n rows sharing it finds ref 1 and writes in place, as vLLM does);
        one this table alone held (hashed, so immutable) keeps its reference until ``advance``
        commits, so no allocation of this plan can evict it before an abort needs it back."""
        self.abort_step()  # a plan whose forward raised
        bs, blocks, start = self.block_size, self.pool.blocks, self.pos
        need = blocks_for(start + T, bs)
        claimed: list[tuple[int, int, int, int | None, bool]] = []  # (group, row, index, block replaced, deferred)
        # Recorded as it goes: a full pool raising halfway is undone by the next abort_step.
        self._planned, self._claimed = (start, -1), claimed
        for g, tables in enumerate(self.gtables):
            for r, table in enumerate(tables):
                j = start // bs
                old = table[j] if start % bs else None  # the tail block is never out of a window
                if old is not None and blocks.needs_copy(old):  # appending into a shared/immutable block
                    new = blocks.allocate()
                    self.pool.before_write(new)
                    self.pool.copy_block(old, new)
                    deferred = blocks.ref_count[old] == 1
                    if not deferred:
                        blocks.unref(old)
                    claimed.append((g, r, j, old, deferred))
                    table[j] = new
                    blocks.cow_copies += 1
                    self.bytes_copied += self.pool.block_bytes
                while len(table) < need:
                    table.append(blocks.allocate())  # PoolFull here leaves nothing to record
                    claimed.append((g, r, len(table) - 1, None, False))
        pos = torch.arange(start, start + T)
        off = pos % bs  # (T,)
        self._slot_blk, self._gather = [], []
        for g, tables in enumerate(self.gtables):
            f = self.freed[g]
            tab = torch.tensor([t[f:need] for t in tables], dtype=torch.long)  # (B, need - f): held blocks
            blk = tab[:, pos // bs - f]  # (B, T)
            for b in set(blk.reshape(-1).tolist()):  # a block live when a checkpoint was taken is copied first
                self.pool.before_write(b)
            if g == 0:
                self.new_slots = [(r, int(b), int(o)) for r in range(self.batch) for b, o in zip(blk[r], off)]
            self._slot_blk.append(blk.reshape(-1).to(self.device))  # (B*T,)
            self._gather.append(tab.reshape(-1).to(self.device))  # (B*(need-f),)
        self._slot_off = off.repeat(self.batch).to(self.device)  # (B*T,)
        self._planned = (start, T)

    def abort_step(self) -> None:
        """Undo the plan (its forward raised): every table as before it, the claimed blocks freed."""
        if self._planned is None:
            return
        blocks = self.pool.blocks
        for g, r, j, old, deferred in reversed(self._claimed):
            table = self.gtables[g][r]
            b = table[j]
            assert b is not None
            blocks.unref(b)
            if old is None:
                del table[j]
            else:
                table[j] = old
                if not deferred:
                    blocks.ref(old)
                blocks.cow_copies -= 1
                self.bytes_copied -= self.pool.block_bytes
        self._planned, self._claimed, self._pending = None, [], None
        self.new_slots = []

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, nkv, T, hs = k.shape
        if self._planned != (self.pos, T):  # no plan (a forward run around run_step), or another one
            raise RuntimeError(f"layer {layer_idx} writes {T} positions at {self.pos}, but the step planned "
                               f"{'nothing' if self._planned is None else self._planned}: a paged cache's "
                               "blocks are claimed by plan_step before the forward (run_step), one forward "
                               "at a time per cache")
        assert self._slot_off is not None
        g, s = self.groups.group_of[layer_idx], self.groups.slot_of[layer_idx]
        bs = self.block_size
        rows = self.pos + T - self.freed[g] * bs  # positions freed*bs .. pos+T-1
        out = []
        for pool, new in ((self.pool.k[s], k), (self.pool.v[s], v)):
            # Scatter: (B*T, nkv, hs) rows into pool[block, :, slot, :].
            pool[self._slot_blk[g], :, self._slot_off] = new.transpose(1, 2).reshape(B * T, nkv, hs)
            # Gather: the held blocks -> (B, held, nkv, bs, hs) -> (B, nkv, held*bs, hs).
            seq = pool.index_select(0, self._gather[g]).view(B, -1, nkv, bs, hs).transpose(1, 2)
            seq = seq.reshape(B, nkv, -1, hs)
            out.append(seq if seq.shape[2] == rows else seq.narrow(2, 0, rows))
        self.bytes_copied += 2 * k.nbytes
        return out[0], out[1]

    def ring_positions(self, window: int, T: int) -> torch.Tensor | None:
        """The positions ``update`` returns for a sliding layer of ``window`` once it let blocks go."""
        w = min(window, self.config.block_size)
        for g, gw in enumerate(self.groups.windows):
            if gw == w and self.freed[g]:
                return torch.arange(self.freed[g] * self.block_size, self.pos + T)
        return None

    def advance(self, n: int) -> None:
        """Commit the step: the position moves, the blocks a copy replaced are let go, full blocks
        hashed, and each sliding group lets go of the blocks its window no longer reaches."""
        super().advance(n)
        for _, _, _, old, deferred in self._claimed:
            if deferred:
                assert old is not None
                self.pool.blocks.unref(old)
        self._planned, self._claimed = None, []
        ids, self._pending = self._pending, None
        rows = ids.tolist() if ids is not None and ids.shape[-1] == n else None
        for r in range(self.batch):
            toks = self.tokens[r]
            if toks is None:
                continue
            if rows is None:  # positions whose ids nobody told: stop hashing this row
                self.tokens[r] = None
                continue
            toks.extend(rows[r])
            self._hash_full_blocks(r)
        self._slide()

    def _slide(self) -> None:
        """Release the blocks wholly out of each sliding group's window (hashed ones stay cached)."""
        for g, w in enumerate(self.groups.windows):
            f = first_needed_block(max(0, self.pos - self.rollback), w, self.block_size)
            for table in self.gtables[g]:
                for j in range(self.freed[g], min(f, len(table))):
                    b = table[j]
                    if b is not None:
                        self.pool.blocks.unref(b)
                        table[j] = None
            self.freed[g] = max(self.freed[g], f)

    def _hash_full_blocks(self, r: int) -> None:
        toks, hashes, bs = self.tokens[r], self.hashes[r], self.block_size
        assert toks is not None
        while len(hashes) < len(toks) // bs:
            j = len(hashes)
            h = block_hash(hashes[-1] if hashes else ROOT_HASH, toks[j * bs:(j + 1) * bs])
            hashes.append(h)
            for g, tables in enumerate(self.gtables):
                b = tables[r][j]
                if b is not None:
                    self.pool.blocks.register(b, self._key(h, g))

    # ------------------------------------------------------------------ reading
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's held rows: positions 0..pos-1, or freed*bs..pos-1 on a sliding layer that let
        blocks go (``ring_positions(W, 0)`` names them)."""
        B, nkv, hs, bs = self.batch, self.config.kv_heads, self.config.head_dim, self.block_size
        g, s = self.groups.group_of[i], self.groups.slot_of[i]
        f, n = self.freed[g], blocks_for(self.pos, bs)
        idx = torch.tensor([t[f:n] for t in self.gtables[g]], dtype=torch.long, device=self.device).reshape(-1)
        out = []
        for pool in (self.pool.k[s], self.pool.v[s]):
            seq = pool.index_select(0, idx).view(B, n - f, nkv, bs, hs).transpose(1, 2).reshape(B, nkv, -1, hs)
            out.append(seq[:, :, : self.pos - f * bs])
        return out[0], out[1]

    # ------------------------------------------------------------------ moves
    def reset(self) -> None:
        self.abort_step()
        for r in range(self.batch):
            self._release(r, 0)
        self.freed = [0] * self.groups.count
        self.tokens = [[] for _ in range(self.batch)]
        self.hashes = [[] for _ in range(self.batch)]
        self.pos = 0
        self.bytes_copied = 0
        self.new_slots = []

    def release(self) -> None:
        """Give every block back to the pool (hashed ones stay findable until evicted)."""
        self.reset()

    def _release(self, r: int, keep: int) -> None:
        for tables in self.gtables:
            for b in tables[r][keep:]:
                if b is not None:
                    self.pool.blocks.unref(b)
            del tables[r][keep:]

    def can_truncate(self, n: int) -> bool:
        # A sliding group that let go of blocks position n's window needs cannot roll back to n.
        return 0 <= n <= self.pos and (n in (0, self.pos) or all(
            f <= first_needed_block(n, w, self.block_size) for f, w in zip(self.freed, self.groups.windows)))

    def _truncate(self, n: int) -> None:
        if not self.can_truncate(n):
            raise ValueError(f"this cache's sliding layers let go of the blocks before position "
                             f"{max(self.freed) * self.block_size}; they cannot roll back to {n}")
        self.abort_step()
        keep = blocks_for(n, self.block_size)
        for r in range(self.batch):
            self._release(r, keep)
            toks = self.tokens[r]
            if toks is not None:
                del toks[n:]
            del self.hashes[r][n // self.block_size:]
        if n == 0:
            self.freed = [0] * self.groups.count
        self.new_slots = []

    def _reorder(self, index: torch.Tensor) -> None:
        self.abort_step()
        picks = index.tolist()
        gtables = [[list(tables[i]) for i in picks] for tables in self.gtables]
        for tables in gtables:  # ref the new tables before dropping the old: a block never passes through 0
            for t in tables:
                for b in t:
                    if b is not None:
                        self.pool.blocks.ref(b)
        for tables in self.gtables:
            for t in tables:
                for b in t:
                    if b is not None:
                        self.pool.blocks.unref(b)
        self.gtables = gtables
        self.tokens = [None if self.tokens[i] is None else list(self.tokens[i]) for i in picks]  # type: ignore[arg-type]
        self.hashes = [list(self.hashes[i]) for i in picks]

    # ------------------------------------------------------------------ transactions
    def _save(self, keep: int) -> Any:
        # The whole pool's bookkeeping, exactly (free-list and LRU order included), and from now on
        # a copy of each live block before its first write: a truncation may release a block to the
        # free list and a later claim reuse it, an eviction overwrites a cached one, and the tail
        # block is written from a truncated position. A restore is exact only while this cache is
        # the pool's one writer until then (a conversation's turn runs under its lock).
        self.pool.begin_journal()
        return {"gtables": [[list(t) for t in tables] for tables in self.gtables], "freed": list(self.freed),
                "hashes": [list(h) for h in self.hashes],
                "tokens": [None if t is None else list(t) for t in self.tokens],
                "new_slots": list(self.new_slots), "blocks": self.pool.blocks.save()}

    def _load(self, cp: Checkpoint) -> None:
        st = cp.state
        self._planned, self._claimed, self._pending = None, [], None  # the saved bookkeeping replaces it
        self.pool.end_journal(restore=True)
        self.pool.blocks.load(st["blocks"])
        self.gtables = [[list(t) for t in tables] for tables in st["gtables"]]
        self.freed = list(st["freed"])
        self.hashes = [list(h) for h in st["hashes"]]
        self.tokens = [None if t is None else list(t) for t in st["tokens"]]
        self.new_slots = list(st["new_slots"])

    def commit(self, cp: Checkpoint) -> None:
        self.pool.end_journal(restore=False)

    # ------------------------------------------------------------------ prefix cache
    def _chain(self, ids: list[int]) -> list[bytes]:
        out, parent, bs = [], ROOT_HASH, self.block_size
        for j in range(len(ids) // bs):
            parent = block_hash(parent, ids[j * bs:(j + 1) * bs])
            out.append(parent)
        return out

    def _found(self, chain: list[bytes], m: int, g: int) -> list[int | None]:
        """Group g's blocks for a prefix of m blocks: None below its window, where none is needed."""
        f = first_needed_block(m * self.block_size, self.groups.windows[g], self.block_size)
        return [None] * f + [self.pool.blocks.lookup(self._key(chain[j], g)) for j in range(f, m)]

    def match_prefix(self, ids: list[int]) -> list[int]:
        """The cached blocks that hold ids' leading full blocks (stops at the first miss): group 0's
        blocks of the longest prefix every group can take back. A sliding group needs only the
        blocks its window reaches from the prefix's end (vLLM's sliding-window hit), so a global
        group bounds the match; -1 marks a block of a sliding group 0 that its window no longer needs."""
        chain = self._chain(ids)
        for m in range(len(chain), 0, -1):
            got = [self._found(chain, m, g) for g in range(self.groups.count)]
            if self._complete(got, m):
                return [-1 if b is None else b for b in got[0]]
        return []

    def _complete(self, got: list[list[int | None]], m: int) -> bool:
        """Every group found every block its window needs of a prefix of m blocks."""
        return all(b is not None for g, t in enumerate(got)
                   for b in t[first_needed_block(m * self.block_size, self.groups.windows[g], self.block_size):])

    def adopt_prefix(self, ids: list[int], blocks: list[int]) -> None:
        """An empty batch-1 cache takes ``blocks`` (from match_prefix) as its first positions, and
        every other group's blocks of the same prefix."""
        if self.batch != 1 or self.pos != 0:
            raise ValueError("adopt_prefix needs an empty cache of one row")
        n = len(blocks) * self.block_size
        if len(ids) < n:
            raise ValueError("fewer ids than the adopted blocks hold")
        self.abort_step()
        chain = self._chain(ids[:n])
        got = [self._found(chain, len(blocks), g) for g in range(self.groups.count)]
        if not self._complete(got, len(blocks)):
            raise ValueError("a block of this prefix is no longer cached; match the prefix again")
        for g, t in enumerate(got):
            for b in t:
                if b is not None:
                    self.pool.blocks.ref(b)
                    self.pool.blocks.hits += 1
            self.gtables[g][0] = t
            self.freed[g] = first_needed_block(n, self.groups.windows[g], self.block_size)
        self.tokens[0] = list(ids[:n])
        self.hashes[0] = []
        self._hash_full_blocks(0)  # recomputes the same chain (the blocks are already registered)
        self.pos = n
        self.new_slots = []

    # ------------------------------------------------------------------ accounting
    def layer_bytes(self) -> list[int]:
        """Bytes each layer holds in the pool: the distinct blocks its group's tables hold times one
        layer's share of a block (K and V, ``block_size`` slots, filled or not). The calculator's
        analogue is blocks, not tokens: ``ceil(pos / bs)`` for a global layer, and for a sliding
        layer of window W that minus ``max(0, pos - W + 1) // bs`` (paged_pool.blocks_held)."""
        per_group = [len({b for t in tables for b in t if b is not None}) for tables in self.gtables]
        return [per_group[self.groups.group_of[i]] * self.pool.layer_block_bytes for i in range(self.config.n_layer)]

    @property
    def bytes_used(self) -> int:
        """The positions each layer still holds (a sliding layer's from its first held block on)."""
        per = self.bytes_per_token // self.config.n_layer  # one position of one layer, every row
        return sum((self.pos - self.freed[self.groups.group_of[i]] * self.block_size) * per
                   for i in range(self.config.n_layer)) if self.pos else 0

    def stats(self) -> PagedStats:
        return table_stats(self.pool, self.gtables, self.pos)

    def snapshot(self) -> dict[str, Any]:
        """Plain data for the views (paged_pool.table_snapshot)."""
        return table_snapshot(self.pool, self.gtables, self.freed, self.pos, self.new_slots)
