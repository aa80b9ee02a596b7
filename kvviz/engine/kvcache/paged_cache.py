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

from dataclasses import dataclass
from typing import Any

import torch

from kvviz.engine.kvcache.block_pool import ROOT_HASH, BlockPool, block_hash
from kvviz.engine.kvcache.dense import Checkpoint, KVCache
from kvviz.engine.models.config import GPTConfig
from kvviz.errors import KVVizError

DEFAULT_BLOCK_SIZE = 16  # vLLM's default


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class PagedPool:
    """The physical blocks of every layer plus their bookkeeping; caches may share one pool."""

    def __init__(self, config: GPTConfig, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.blocks = BlockPool(num_blocks, block_size)
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        shape = (num_blocks, config.kv_heads, block_size, config.head_dim)
        # empty, not zeros (as the static cache): a slot is read only after it was written.
        self.k = [torch.empty(shape, device=self.device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.empty(shape, device=self.device, dtype=dtype) for _ in range(config.n_layer)]
        self.slot_bytes = 2 * config.n_layer * config.kv_heads * config.head_dim * dtype.itemsize  # one token, K+V, all layers
        self.block_bytes = self.slot_bytes * block_size
        self.bytes_allocated = sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def copy_block(self, src: int, dst: int) -> None:
        for t in (*self.k, *self.v):
            t[dst].copy_(t[src])  # (nkv, bs, hs) of every layer

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


@dataclass(frozen=True)
class PagedStats:
    """Exact accounting of one paged cache's tables over its pool."""

    block_size: int
    block_bytes: int  # one block, K and V, every layer
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


class PagedKVCache(KVCache):
    """Block tables over a ``PagedPool``; same API and same numbers as the static cache."""

    kind = "paged"
    copies_on_reorder = False  # reorder shares blocks by reference

    def __init__(self, config: GPTConfig, batch: int = 1, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, block_size: int = DEFAULT_BLOCK_SIZE,
                 num_blocks: int | None = None, pool: PagedPool | None = None) -> None:
        super().__init__(config, batch, device, dtype)
        if pool is None:
            if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= 4096:
                raise KVVizError(f"the paged block size must be 1..4096 tokens (got {block_size!r})")
            if num_blocks is None:  # enough for every row to reach the context unshared
                num_blocks = batch * blocks_for(config.block_size, block_size)
            pool = PagedPool(config, num_blocks, block_size, device, dtype)
        elif (pool.config.n_layer, pool.config.kv_heads, pool.config.head_dim, pool.dtype) != \
                (config.n_layer, config.kv_heads, config.head_dim, dtype):
            raise ValueError("this pool was built for another model shape or dtype")
        self.pool = pool
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.tokens: list[list[int] | None] = [[] for _ in range(batch)]  # None once ids went untold
        self.hashes: list[list[bytes]] = [[] for _ in range(batch)]  # one per full block
        self.new_slots: list[tuple[int, int, int]] = []  # (row, block, slot) the last step wrote
        self._pending: torch.Tensor | None = None
        self._planned: tuple[int, int] | None = None  # (pos, T) of the step whose blocks are claimed
        self._claimed: list[tuple[int, int, int | None, bool]] = []
        self._gather: torch.Tensor | None = None
        self._slot_blk: torch.Tensor | None = None
        self._slot_off: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def bytes_allocated(self) -> int:
        return self.pool.bytes_allocated

    # ------------------------------------------------------------------ writing
    def plan_step(self, idx: torch.Tensor) -> None:
        """The step plan, before the forward: keep the ids (B, T) for the prefix hashes and claim
        the blocks positions pos..pos+T need, so no layer allocates."""
        self._plan(idx.shape[-1])
        self._pending = idx

    def _plan(self, T: int) -> None:
        """Claim the blocks positions pos..pos+T need (copy-on-write first) and index their slots.
        ``abort_step`` puts every table back. A copied block another table still holds is let go
        at once (so the last of n rows sharing it finds ref 1 and writes in place, as vLLM does);
        one this table alone held (hashed, so immutable) keeps its reference until ``advance``
        commits, so no allocation of this plan can evict it before an abort needs it back."""
        self.abort_step()  # a plan whose forward raised
        bs, blocks, start = self.block_size, self.pool.blocks, self.pos
        need = blocks_for(start + T, bs)
        claimed: list[tuple[int, int, int | None, bool]] = []  # (row, index, block replaced, its unref deferred)
        # Recorded as it goes: a full pool raising halfway is undone by the next abort_step.
        self._planned, self._claimed = (start, -1), claimed
        for r, table in enumerate(self.tables):
            j = start // bs
            if start % bs and blocks.needs_copy(table[j]):  # appending into a shared/immutable block
                old, new = table[j], blocks.allocate()
                self.pool.before_write(new)
                self.pool.copy_block(old, new)
                deferred = blocks.ref_count[old] == 1
                if not deferred:
                    blocks.unref(old)
                claimed.append((r, j, old, deferred))
                table[j] = new
                blocks.cow_copies += 1
                self.bytes_copied += self.pool.block_bytes
            while len(table) < need:
                table.append(blocks.allocate())  # PoolFull here leaves nothing to record
                claimed.append((r, len(table) - 1, None, False))
        pos = torch.arange(start, start + T)
        off = pos % bs  # (T,)
        tab = torch.tensor(self.tables, dtype=torch.long)  # (B, need)
        blk = tab[:, pos // bs]  # (B, T)
        for b in set(blk.reshape(-1).tolist()):  # a block live when a checkpoint was taken is copied first
            self.pool.before_write(b)
        self.new_slots = [(r, int(b), int(o)) for r in range(self.batch) for b, o in zip(blk[r], off)]
        self._slot_blk = blk.reshape(-1).to(self.device)  # (B*T,)
        self._slot_off = off.repeat(self.batch).to(self.device)  # (B*T,)
        self._gather = tab.reshape(-1).to(self.device)  # (B*need,)
        self._planned = (start, T)

    def abort_step(self) -> None:
        """Undo the plan (its forward raised): every table as before it, the claimed blocks freed."""
        if self._planned is None:
            return
        blocks = self.pool.blocks
        for r, j, old, deferred in reversed(self._claimed):
            table = self.tables[r]
            blocks.unref(table[j])
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
        if self._planned != (self.pos, T):
            if layer_idx != 0:  # two forwards on one cache at once, or a layer writing twice
                raise RuntimeError(f"layer {layer_idx} writes {T} positions at {self.pos}, but the step "
                                   f"planned {self._planned}: one forward at a time per cache")
            self._plan(T)  # a caller that drives the forward itself (tests, beam search) plans here
        assert self._gather is not None and self._slot_blk is not None and self._slot_off is not None
        end, bs = self.pos + T, self.block_size
        out = []
        for pool, new in ((self.pool.k[layer_idx], k), (self.pool.v[layer_idx], v)):
            # Scatter: (B*T, nkv, hs) rows into pool[block, :, slot, :].
            pool[self._slot_blk, :, self._slot_off] = new.transpose(1, 2).reshape(B * T, nkv, hs)
            # Gather: this step's tables -> (B, need, nkv, bs, hs) -> (B, nkv, need*bs, hs).
            seq = pool.index_select(0, self._gather).view(B, -1, nkv, bs, hs).transpose(1, 2)
            seq = seq.reshape(B, nkv, -1, hs)
            out.append(seq if seq.shape[2] == end else seq.narrow(2, 0, end))
        self.bytes_copied += 2 * k.nbytes
        return out[0], out[1]

    def advance(self, n: int) -> None:
        """Commit the step: the position moves, the blocks a copy replaced are let go, full blocks hashed."""
        super().advance(n)
        for _, _, old, deferred in self._claimed:
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

    def _hash_full_blocks(self, r: int) -> None:
        toks, hashes, bs = self.tokens[r], self.hashes[r], self.block_size
        assert toks is not None
        while len(hashes) < len(toks) // bs:
            j = len(hashes)
            h = block_hash(hashes[-1] if hashes else ROOT_HASH, toks[j * bs:(j + 1) * bs])
            hashes.append(h)
            self.pool.blocks.register(self.tables[r][j], h)

    # ------------------------------------------------------------------ reading
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        B, nkv, hs, bs = self.batch, self.config.kv_heads, self.config.head_dim, self.block_size
        n = blocks_for(self.pos, bs)
        idx = torch.tensor([t[:n] for t in self.tables], dtype=torch.long, device=self.device).reshape(-1)
        out = []
        for pool in (self.pool.k[i], self.pool.v[i]):
            seq = pool.index_select(0, idx).view(B, n, nkv, bs, hs).transpose(1, 2).reshape(B, nkv, n * bs, hs)
            out.append(seq[:, :, : self.pos])
        return out[0], out[1]

    # ------------------------------------------------------------------ moves
    def reset(self) -> None:
        self.abort_step()
        for r in range(self.batch):
            self._release(r, 0)
        self.tokens = [[] for _ in range(self.batch)]
        self.hashes = [[] for _ in range(self.batch)]
        self.pos = 0
        self.bytes_copied = 0
        self.new_slots = []

    def release(self) -> None:
        """Give every block back to the pool (hashed ones stay findable until evicted)."""
        self.reset()

    def _release(self, r: int, keep: int) -> None:
        for b in self.tables[r][keep:]:
            self.pool.blocks.unref(b)
        del self.tables[r][keep:]

    def _truncate(self, n: int) -> None:
        self.abort_step()
        keep = blocks_for(n, self.block_size)
        for r in range(self.batch):
            self._release(r, keep)
            toks = self.tokens[r]
            if toks is not None:
                del toks[n:]
            del self.hashes[r][n // self.block_size:]
        self.new_slots = []

    def _reorder(self, index: torch.Tensor) -> None:
        self.abort_step()
        picks = index.tolist()
        tables = [list(self.tables[i]) for i in picks]
        for t in tables:  # ref the new tables before dropping the old: a block never passes through 0
            for b in t:
                self.pool.blocks.ref(b)
        for t in self.tables:
            for b in t:
                self.pool.blocks.unref(b)
        self.tables = tables
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
        return {"tables": [list(t) for t in self.tables], "hashes": [list(h) for h in self.hashes],
                "tokens": [None if t is None else list(t) for t in self.tokens],
                "new_slots": list(self.new_slots), "blocks": self.pool.blocks.save()}

    def _load(self, cp: Checkpoint) -> None:
        st = cp.state
        self._planned, self._claimed, self._pending = None, [], None  # the saved bookkeeping replaces it
        self.pool.end_journal(restore=True)
        self.pool.blocks.load(st["blocks"])
        self.tables = [list(t) for t in st["tables"]]
        self.hashes = [list(h) for h in st["hashes"]]
        self.tokens = [None if t is None else list(t) for t in st["tokens"]]
        self.new_slots = list(st["new_slots"])

    def commit(self, cp: Checkpoint) -> None:
        self.pool.end_journal(restore=False)

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, ids: list[int]) -> list[int]:
        """The cached blocks that hold ids' leading full blocks (stops at the first miss)."""
        got, parent, bs = [], ROOT_HASH, self.block_size
        for j in range(len(ids) // bs):
            parent = block_hash(parent, ids[j * bs:(j + 1) * bs])
            b = self.pool.blocks.lookup(parent)
            if b is None:
                break
            got.append(b)
        return got

    def adopt_prefix(self, ids: list[int], blocks: list[int]) -> None:
        """An empty batch-1 cache takes ``blocks`` (from match_prefix) as its first positions."""
        if self.batch != 1 or self.pos != 0:
            raise ValueError("adopt_prefix needs an empty cache of one row")
        n = len(blocks) * self.block_size
        if len(ids) < n:
            raise ValueError("fewer ids than the adopted blocks hold")
        self.abort_step()
        for b in blocks:
            self.pool.blocks.ref(b)
        self.pool.blocks.hits += len(blocks)
        self.tables[0] = list(blocks)
        self.tokens[0] = list(ids[:n])
        self.hashes[0] = []
        self._hash_full_blocks(0)  # recomputes the same chain (the blocks are already registered)
        self.pos = n
        self.new_slots = []

    # ------------------------------------------------------------------ accounting
    def stats(self) -> PagedStats:
        pool, bp, bs = self.pool, self.pool.blocks, self.block_size
        n = blocks_for(self.pos, bs)
        refs: dict[int, int] = {}
        fill: dict[int, int] = {}  # a shared block sits at the same index j in every table that holds it
        for t in self.tables:
            for j, b in enumerate(t[:n]):
                refs[b] = refs.get(b, 0) + 1
                fill[b] = min(bs, self.pos - j * bs)
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

    def snapshot(self) -> dict[str, Any]:
        """Plain data for the views: every block's state, ref count and owners; the tables."""
        bp, bs = self.pool.blocks, self.block_size
        n = blocks_for(self.pos, bs)
        owners: list[list[int]] = [[] for _ in range(bp.num_blocks)]
        fill = [0] * bp.num_blocks
        for r, t in enumerate(self.tables):
            for j, b in enumerate(t[:n]):
                owners[b].append(r)
                fill[b] = min(bs, self.pos - j * bs)
        for b in bp.lru:
            fill[b] = bs
        return {
            "num_blocks": bp.num_blocks, "block_size": bs, "pos": self.pos,
            "ref_count": list(bp.ref_count), "state": [bp.state(b) for b in range(bp.num_blocks)],
            "hash": [h.hex()[:8] if h else None for h in bp.hash_of], "owners": owners, "fill": fill,
            "tables": [list(t[:n]) for t in self.tables], "new_slots": list(self.new_slots),
            "stats": self.stats().to_dict(),
        }
