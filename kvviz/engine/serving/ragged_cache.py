"""The serving scheduler's KV cache: many requests over one paged pool, each at its own position.

One ``PagedPool`` (tensors, layer groups) and its ``BlockPool`` (free list, ref counts, hashed full
blocks, the LRU of cached ones); per request a block table per layer group, its computed positions
and their token ids. This is vLLM V1's ``KVCacheManager`` (vllm/v1/core/kv_cache_manager.py:
``get_computed_blocks``, ``allocate_slots``, ``free``) over its ``BlockPool``, in kvviz's terms:

- ``find_prefix(ids, max_tokens)``: the longest chain of cached full blocks (held by running requests,
  or freed and not yet evicted) whose hashes match ids' leading blocks, every layer group's, capped
  at ``max_tokens`` rounded down to a block (the scheduler passes prompt length - 1: the last prompt
  token is always computed, for its logits). Hits are counted in tokens, as vLLM counts them.
- ``allocate(rid, n, hit)``: the blocks for n more tokens (and the hit's blocks taken back first), or
  False, with nothing changed, when free + cached blocks cannot hold them: the scheduler then preempts.
- ``free(rid)``: every block back, the tail first (vLLM's order: the tail is evicted first); full
  hashed blocks stay cached for a later hit.

A step (``run_step``): the scheduler names its layout, ``(request, start, n)`` per request in the
order of the step's tokens (``set_layout``); ``plan_step`` claims any block the step still needs
(normally none: ``allocate`` did) and indexes every token's slot; each layer's ``update(layer, k, v)``
scatters the step's K/V (1, nkv, N, hs) into those slots and gathers every scheduled request's
blocks, one after another, into (1, nkv, S, hs); ``attend(layer, q, k, v, scale)`` attends each
request's queries over its own rows (causal from its start, and by the layer's window on a sliding
layer: Gemma 3); ``advance`` commits each request's positions and hashes its full blocks (prefix
caching: reusable once computed).

Sliding-window groups (Gemma 3's local layers) let go of the blocks no later query can see: vLLM's
``SlidingWindowManager`` (vllm/v1/core/single_type_kv_cache_manager.py: ``get_num_skipped_tokens``
= num_computed - window + 1, ``remove_skipped_blocks`` frees the blocks wholly before that, the
latest first, and puts the null block in their places), called from ``KVCacheManager.allocate_slots``
before it counts the blocks to allocate, "even if we cannot schedule this request". Here ``allocate``
does the same: each such entry becomes ``NULL`` (the pool's ``unref``: a hashed block stays cached,
evictable), ``window_freed`` counts them. The step gathers a live block in a ``NULL``'s place: those
keys are out of every query's window, so the mask gives them weight 0 (the rows only need be finite).

Attention per request: a loop of one SDPA per request. The alternative, one SDPA over the
concatenated rows with a block-diagonal mask, computes every query against every request's keys:
on SmolLM2 with 16 and 32 running requests (docs/benchmarks.md, "ragged attention") the loop was
the faster on this CPU, so it is the one kept (``ATTENTION``; "mask" runs the other, for the test
that holds the two equal).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvviz.engine.kvcache.block_pool import ROOT_HASH, block_hash
from kvviz.engine.kvcache.paged_pool import PagedPool, blocks_for, first_needed_block
from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.errors import KVVizError

ATTENTION = "loop"  # "loop": one SDPA per request (measured faster); "mask": one SDPA, block-diagonal mask
NULL = -1  # a table entry a sliding group let go (vLLM's null block)


@dataclass
class SeqBlocks:
    """One request's share of the pool."""
    tables: list[list[int]]  # per layer group: its blocks, logical order (NULL: out of a sliding window, freed)
    tokens: list[int] = field(default_factory=list)  # ids of the computed positions 0..num_computed-1
    hashes: list[bytes] = field(default_factory=list)  # chained hash of each full computed block

    @property
    def num_computed(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class PrefixHit:
    """What ``find_prefix`` found: per layer group the cached blocks of the prefix, and its tokens."""
    blocks: tuple[tuple[int, ...], ...]
    hashes: tuple[bytes, ...]
    ids: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return len(self.ids)


class RaggedPagedCache:
    """Per-request block tables over one pool; a step is any mix of prefill chunks and decodes."""

    kind = "ragged"
    ragged = True
    pos = 0  # the models read cache.pos; a ragged step's positions are per request (``set_layout``)

    def __init__(self, config: GPTConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", prefix_caching: bool = True) -> None:
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.pool = PagedPool(config, num_blocks, block_size, self.device, dtype)
        for t in (*self.pool.k, *self.pool.v):
            t.zero_()  # a block's unwritten tail is gathered too: finite, so a masked-out row adds 0, never NaN
        self.blocks = self.pool.blocks
        self.groups = self.pool.groups
        self.prefix_caching = prefix_caching
        self.seqs: dict[str, SeqBlocks] = {}
        self.layout: list[tuple[str, int, int]] = []  # this step: (request, start, n), in token order
        self._ids: torch.Tensor | None = None
        self._claimed: list[tuple[str, int]] = []  # (request, group) whose table plan_step extended
        self._slot_blk: list[torch.Tensor] = []  # per group: (N,) block of each token
        self._slot_off: torch.Tensor | None = None  # (N,) slot of each token in its block
        self._gather: list[torch.Tensor] = []  # per group: the step's requests' blocks, concatenated
        self._spans: list[tuple[int, int, int, int]] = []  # per entry: (query from, n, key from, start)
        self._masks: dict[int | None, torch.Tensor] = {}  # window -> (N, S) mask (ATTENTION == "mask")
        self.window_freed = 0  # blocks sliding groups let go before their request ended (cumulative)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def _key(self, h: bytes, g: int) -> bytes:
        """Group g's hash of a prefix (as PagedKVCache's): a block of another group holds other layers."""
        return h if g == 0 else block_hash(h, [-1 - g])

    # ------------------------------------------------------------------ vLLM's KVCacheManager
    def blocks_needed(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` positions holds: every group covers them all."""
        return self.groups.count * blocks_for(tokens, self.block_size)

    def find_prefix(self, ids: list[int], max_tokens: int) -> PrefixHit:
        """The longest run of ids' leading full blocks cached, at most ``max_tokens``: every block in
        a global group; in a sliding group only those the next query's window reaches (the rest NULL,
        as vLLM's ``SlidingWindowManager.find_longest_cache_hit`` takes null blocks for them: a
        window lets its early blocks go, so they are rarely still cached)."""
        bs, hashes, found = self.block_size, [], []
        if not self.prefix_caching:
            return PrefixHit((), (), ())
        windows = self.groups.windows
        parent = ROOT_HASH
        for j in range(max(0, max_tokens) // bs):
            parent = block_hash(parent, ids[j * bs:(j + 1) * bs])
            got = [self.blocks.lookup(self._key(parent, g)) for g in range(self.groups.count)]
            if any(b is None for g, b in enumerate(got) if windows[g] is None):
                break
            hashes.append(parent)
            found.append(got)
        n = len(found)  # the global groups' chain; the sliding groups may cut it shorter
        while n and any(found[j][g] is None for g, w in enumerate(windows) if w is not None
                        for j in range(first_needed_block(n * bs, w, bs), n)):
            n -= 1
        per_group = tuple(tuple(NULL if w is not None and j < first_needed_block(n * bs, w, bs) else int(found[j][g])
                                for j in range(n)) for g, w in enumerate(windows))
        return PrefixHit(per_group, tuple(hashes[:n]), tuple(ids[:n * bs]))

    def can_allocate(self, rid: str, num_new: int, hit: PrefixHit | None = None) -> bool:
        seq = self.seqs.get(rid)
        have = seq.num_computed if seq else (hit.tokens if hit else 0)
        held = len(seq.tables[0]) if seq else (len(hit.blocks[0]) if hit and hit.blocks else 0)
        new = self.groups.count * max(0, blocks_for(have + num_new, self.block_size) - held)
        # Hit blocks sitting in the LRU leave the evictable set when taken (vLLM's num_evictable_computed_blocks).
        taken = sum(1 for t in (hit.blocks if hit and not seq else ()) for b in t
                    if b != NULL and self.blocks.ref_count[b] == 0)
        return new + taken <= len(self.blocks.free) + len(self.blocks.lru)

    def allocate(self, rid: str, num_new: int, hit: PrefixHit | None = None) -> bool:
        """Blocks for ``num_new`` more positions of rid (a new request takes ``hit``'s blocks first);
        False, changing nothing, when the pool cannot hold them."""
        self.remove_skipped(rid)  # vLLM frees these first, whether or not the allocation then fits
        if not self.can_allocate(rid, num_new, hit):
            return False
        seq = self.seqs.get(rid)
        if seq is None:
            seq = self.seqs[rid] = SeqBlocks([[] for _ in range(self.groups.count)])
            if hit is not None and hit.tokens:
                for g, t in enumerate(hit.blocks):
                    for b in t:
                        if b != NULL:
                            self.blocks.ref(b)  # a cached block leaves the LRU; a held one is shared
                            self.blocks.hits += 1
                    seq.tables[g] = list(t)
                seq.tokens, seq.hashes = list(hit.ids), list(hit.hashes)
        need = blocks_for(seq.num_computed + num_new, self.block_size)
        for table in seq.tables:
            while len(table) < need:
                table.append(self.blocks.allocate())
        return True

    def remove_skipped(self, rid: str) -> int:
        """Let go of rid's blocks that its sliding groups' next query cannot see (wholly before
        num_computed - window + 1), the latest first, each entry NULL from then on (vLLM's
        ``SlidingWindowManager.remove_skipped_blocks`` / ``_remove_blocks_in_range``); the count freed."""
        seq = self.seqs.get(rid)
        if seq is None:
            return 0
        freed = 0
        for g, table in enumerate(seq.tables):
            window = self.groups.windows[g]
            if window is None:
                continue
            for j in range(min(first_needed_block(seq.num_computed, window, self.block_size), len(table)) - 1,
                           -1, -1):
                if table[j] == NULL:
                    break  # the earlier ones went at an earlier step
                self.blocks.unref(table[j])
                table[j] = NULL
                freed += 1
        self.window_freed += freed
        return freed

    def free(self, rid: str) -> None:
        """Every block of rid back (tail first, so the tail is evicted first); hashed ones stay cached."""
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return
        for table in seq.tables:
            for b in reversed(table):
                if b != NULL:
                    self.blocks.unref(b)

    def num_computed(self, rid: str) -> int:
        seq = self.seqs.get(rid)
        return seq.num_computed if seq else 0

    # ------------------------------------------------------------------ the step
    def set_layout(self, layout: list[tuple[str, int, int]]) -> None:
        """This step's tokens: per request (id, first position, count), in the order they are fed."""
        for rid, start, n in layout:
            if rid not in self.seqs or self.seqs[rid].num_computed != start or n < 1:
                raise ValueError(f"request {rid!r} cannot be fed {n} tokens at {start}")
            if start + n > self.config.block_size:
                raise ValueError(f"request {rid!r} would reach position {start + n}, past the model's "
                                 f"context of {self.config.block_size}")
        self.layout = list(layout)

    def plan_step(self, ids: torch.Tensor) -> None:
        """Claim the blocks of every token of the step (any ``allocate`` left) and index their slots."""
        self.abort_step()
        N = sum(n for _, _, n in self.layout)
        if ids.shape != (1, N):
            raise ValueError(f"a ragged step feeds one row of {N} tokens (got {tuple(ids.shape)})")
        bs = self.block_size
        for rid, start, n in self.layout:
            need = blocks_for(start + n, bs)
            for g, table in enumerate(self.seqs[rid].tables):
                while len(table) < need:
                    table.append(self.blocks.allocate())  # PoolFull: the next abort_step undoes the claims
                    self._claimed.append((rid, g))
        self._ids = ids
        blk: list[list[int]] = [[] for _ in range(self.groups.count)]
        gather: list[list[int]] = [[] for _ in range(self.groups.count)]
        off: list[int] = []
        self._spans, q0, k0 = [], 0, 0
        for rid, start, n in self.layout:
            seq, held = self.seqs[rid], blocks_for(start + n, bs)
            for g, table in enumerate(seq.tables):
                blk[g].extend(table[p // bs] for p in range(start, start + n))  # never NULL: in the window
                live = table[held - 1]  # stands in for a NULL: its keys are masked out (window)
                gather[g].extend(live if b == NULL else b for b in table[:held])
            off.extend(p % bs for p in range(start, start + n))
            self._spans.append((q0, n, k0, start))
            q0, k0 = q0 + n, k0 + held * bs
        dev = self.device
        self._slot_blk = [torch.tensor(b, dtype=torch.long, device=dev) for b in blk]  # (N,) per group
        self._gather = [torch.tensor(b, dtype=torch.long, device=dev) for b in gather]  # (S/bs,) per group
        self._slot_off = torch.tensor(off, dtype=torch.long, device=dev)  # (N,)
        self._masks = {}

    def abort_step(self) -> None:
        """Undo what ``plan_step`` claimed (the forward raised): the tables as the scheduler left them."""
        for rid, g in reversed(self._claimed):
            self.blocks.unref(self.seqs[rid].tables[g].pop())
        self._claimed, self._ids = [], None

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter the step's K/V (1, nkv, N, hs) into their slots; every scheduled request's blocks,
        one request after another, as (1, nkv, S, hs) (S: their blocks' slots, the unwritten tail's too)."""
        _, nkv, N, hs = k.shape
        g, s = self.groups.group_of[layer_idx], self.groups.slot_of[layer_idx]
        bs = self.block_size
        out = []
        for pool, new in ((self.pool.k[s], k), (self.pool.v[s], v)):
            pool[self._slot_blk[g], :, self._slot_off] = new[0].transpose(0, 1).to(pool.dtype)  # (N, nkv, hs)
            seq = pool.index_select(0, self._gather[g])  # (S/bs, nkv, bs, hs)
            out.append(seq.transpose(0, 1).reshape(1, nkv, -1, hs))  # (1, nkv, S, hs)
        return out[0], out[1]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None) -> torch.Tensor:
        """Each request's queries over its own rows: q (1, nh, N, hs), k/v from ``update`` -> (1, nh, N, hs)."""
        window = self.groups.windows[self.groups.group_of[layer_idx]]
        gqa = k.shape[1] != q.shape[1]
        if ATTENTION == "mask":
            mask = self._masks.get(window)
            if mask is None:
                mask = self._masks[window] = self._block_mask(k.shape[2], window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        ys = []
        for q0, n, k0, start in self._spans:
            S = start + n
            kk, vv = k[:, :, k0:k0 + S], v[:, :, k0:k0 + S]  # (1, nkv, S, hs): positions 0..S-1
            mask = _causal(n, start, window, q.device)
            ys.append(F.scaled_dot_product_attention(q[:, :, q0:q0 + n], kk, vv, attn_mask=mask,
                                                     is_causal=mask is None and n > 1 and start == 0,
                                                     scale=scale, enable_gqa=gqa))  # (1, nh, n, hs)
        return torch.cat(ys, dim=2) if len(ys) > 1 else ys[0]

    def _block_mask(self, S: int, window: int | None) -> torch.Tensor:
        """(N, S) bool: query i of a request sees its own keys at positions <= its own (and within window)."""
        N = sum(n for _, n, _, _ in self._spans)
        mask = torch.zeros(N, S, dtype=torch.bool, device=self.device)
        for q0, n, k0, start in self._spans:
            mask[q0:q0 + n, k0:k0 + start + n] = _causal(n, start, window, self.device, explicit=True)
        return mask

    def advance(self, n: int) -> None:
        """Commit the step: each request's new positions and their ids; full blocks hashed (cachable)."""
        ids = self._ids
        assert ids is not None, "advance without a planned step"
        row = ids[0].tolist()
        at = 0
        for rid, start, k in self.layout:
            seq = self.seqs[rid]
            seq.tokens.extend(row[at:at + k])
            at += k
            self._hash_full_blocks(seq)
        self._claimed, self._ids, self.layout = [], None, []

    def _hash_full_blocks(self, seq: SeqBlocks) -> None:
        bs = self.block_size
        while len(seq.hashes) < seq.num_computed // bs:
            j = len(seq.hashes)
            h = block_hash(seq.hashes[-1] if seq.hashes else ROOT_HASH, seq.tokens[j * bs:(j + 1) * bs])
            seq.hashes.append(h)
            if self.prefix_caching:
                for g, table in enumerate(seq.tables):
                    if table[j] != NULL:  # hashed when full, before a window can pass it; never NULL here
                        self.blocks.register(table[j], self._key(h, g))

    # ------------------------------------------------------------------ accounting
    def tokens_in_blocks(self) -> int:
        """K/V positions written in used blocks, a shared block counted once (its fullest holder)."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for seq in self.seqs.values():
            c = seq.num_computed
            for table in seq.tables:
                for j, b in enumerate(table):
                    if b != NULL:
                        fill[b] = max(fill.get(b, 0), max(0, min(bs, c - j * bs)))
        return sum(fill.values())

    def owners(self) -> list[list[str]]:
        """Per block: the requests whose tables hold it."""
        out: list[list[str]] = [[] for _ in range(self.blocks.num_blocks)]
        for rid, seq in self.seqs.items():
            for table in seq.tables:
                for b in table:
                    if b != NULL:
                        out[b].append(rid)
        return out

    def audit(self) -> None:
        """The invariants every run keeps, errors and aborts included: every block in one state, free +
        cached + used == the pool, each block's ref count == the tables that hold it, no plan left."""
        bp = self.blocks
        bp.check()
        refs = [0] * bp.num_blocks
        for seq in self.seqs.values():
            for table in seq.tables:
                for b in table:
                    if b != NULL:
                        refs[b] += 1
        if refs != bp.ref_count:
            bad = [b for b in range(bp.num_blocks) if refs[b] != bp.ref_count[b]]
            raise AssertionError(f"ref counts differ from the block tables at blocks {bad[:8]}")
        used = sum(1 for r in bp.ref_count if r > 0)
        if len(bp.free) + len(bp.lru) + used != bp.num_blocks:
            raise AssertionError("free + cached + used != the pool")
        if self._claimed or self._ids is not None:
            raise AssertionError("a step is left planned")


def _causal(n: int, start: int, window: int | None, device: torch.device,
            explicit: bool = False) -> torch.Tensor | None:
    """The mask of n queries at start.. over keys 0..start+n-1 (None, unless ``explicit``, when SDPA
    needs none or its is_causal does: the solo run's paths, so the loop's sums are the solo run's)."""
    S = start + n
    if not explicit and n == 1 and (window is None or S <= window):
        return None  # one query sees every key
    if not explicit and start == 0 and (window is None or S <= window):
        return None  # a plain causal prefill: is_causal
    keys = torch.arange(S, device=device)
    p = torch.arange(start, S, device=device)[:, None]
    m = keys[None, :] <= p
    if window is not None:
        m &= keys[None, :] > p - window
    return m  # (n, S)


def check_pool(config: GPTConfig, num_blocks: int, block_size: int) -> None:
    """The pool's shape, checked before anything is allocated."""
    if not 1 <= block_size <= 4096:
        raise KVVizError(f"the block size must be 1..4096 tokens (got {block_size})")
    if num_blocks < 1:
        raise KVVizError(f"the pool needs at least one block (got {num_blocks})")
