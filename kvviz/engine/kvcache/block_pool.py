"""The bookkeeping of a paged KV cache (vLLM style), in plain Python: no tensors here.

A pool of ``num_blocks`` fixed-size blocks. Every block is in exactly one of three states:
- **free**: on the free list, holds nothing anyone can find;
- **in use**: ref count >= 1 (one per block table that points at it; > 1 means shared);
- **cached**: ref count 0 but full and hashed, so a later request with the same prefix can take
  it back without recomputing (vLLM's automatic prefix caching). Cached blocks sit in an LRU;
  when the free list is empty, the least recently released one is evicted (its hash forgotten).

A full block's hash chains its parent's: ``hash(parent_hash, its tokens)``, so equal hashes mean
equal *prefixes*, not just equal blocks of 16 tokens. A hashed block is immutable: writing into
it (after a truncation, or when a sequence shares it) copies it first (copy-on-write).

    pool = BlockPool(num_blocks=8, block_size=4)
    b = pool.allocate()          # ref 1
    pool.ref(b)                  # shared by a second table: ref 2
    pool.unref(b); pool.unref(b) # ref 0: back on the free list (it was never hashed)
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence

from kvviz.errors import KVVizError

ROOT_HASH = b""  # the parent hash of a sequence's first block


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """16 bytes naming a full block *and everything before it*: blake2b(parent, token ids)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


class PoolFull(KVVizError):
    """No free block and nothing cached to evict."""


class BlockPool:
    """Free list, ref counts, the hash table of full blocks, the LRU of cached blocks, counters."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise KVVizError(f"a paged pool needs at least one block of at least one token "
                             f"(got {num_blocks} blocks of {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # never used or released unhashed
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached ref-0 blocks, oldest first
        self.cow_copies = 0  # blocks copied because a write hit a shared or hashed block
        self.evictions = 0  # cached blocks taken for new data
        self.hits = 0  # blocks taken back by a prefix hash instead of recomputed

    # ------------------------------------------------------------------ states
    def allocate(self) -> int:
        """A block with ref count 1: from the free list, else the LRU's oldest cached block."""
        if self.free:
            b = self.free.popleft()
        elif self.lru:
            b, _ = self.lru.popitem(last=False)
            self._forget_hash(b)
            self.evictions += 1
        else:
            raise PoolFull(f"the KV pool is full: all {self.num_blocks} blocks of {self.block_size} tokens "
                           f"are in use; give it more blocks or a shorter conversation")
        self.ref_count[b] = 1
        return b

    def ref(self, b: int) -> None:
        """One more table points at b (a shared prefix, a forked sample, a prefix-cache hit)."""
        if self.ref_count[b] == 0:
            if b not in self.lru:
                raise ValueError(f"block {b} is free: only a cached block can be taken back")
            del self.lru[b]
        self.ref_count[b] += 1

    def unref(self, b: int) -> None:
        """One table fewer; at 0 a hashed block is cached (evictable), an unhashed one is freed."""
        if self.ref_count[b] <= 0:
            raise ValueError(f"block {b} has no references to drop")
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            if self.hash_of[b] is not None:
                self.lru[b] = None  # most recently released last
            else:
                self.free.append(b)

    def register(self, b: int, h: bytes) -> None:
        """b is full and its prefix hashes to h: findable from now on (first block wins a tie)."""
        if self.hash_of[b] is None and h not in self.by_hash:
            self.hash_of[b] = h
            self.by_hash[h] = b

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def needs_copy(self, b: int) -> bool:
        """Writing into b must copy it first: shared by another table, or hashed (immutable)."""
        return self.ref_count[b] > 1 or self.hash_of[b] is not None

    def _forget_hash(self, b: int) -> None:
        h = self.hash_of[b]
        if h is not None:
            del self.by_hash[h]
            self.hash_of[b] = None

    # ------------------------------------------------------------------ transactions
    def save(self) -> tuple:
        """Every field, copied (a transaction's undo data; ``load`` puts them back exactly)."""
        return (list(self.ref_count), deque(self.free), list(self.hash_of), dict(self.by_hash),
                OrderedDict(self.lru), self.cow_copies, self.evictions, self.hits)

    def load(self, saved: tuple) -> None:
        ref, free, hash_of, by_hash, lru, self.cow_copies, self.evictions, self.hits = saved
        self.ref_count, self.free, self.hash_of = list(ref), deque(free), list(hash_of)
        self.by_hash, self.lru = dict(by_hash), OrderedDict(lru)

    # ------------------------------------------------------------------ accounting
    @property
    def used(self) -> list[int]:
        return [b for b, r in enumerate(self.ref_count) if r > 0]

    @property
    def shared(self) -> list[int]:
        return [b for b, r in enumerate(self.ref_count) if r > 1]

    @property
    def cached(self) -> list[int]:
        """Ref-0 blocks kept for their hash, oldest (next to evict) first."""
        return list(self.lru)

    def state(self, b: int) -> str:
        """"free", "cached" (ref 0, hashed, evictable) or "used"."""
        if self.ref_count[b] > 0:
            return "used"
        return "cached" if b in self.lru else "free"

    def check(self) -> None:
        """Invariants (tests call it): every block in exactly one state, hashes consistent."""
        free, lru = set(self.free), set(self.lru)
        assert len(free) == len(self.free), "a block is twice on the free list"
        for b in range(self.num_blocks):
            states = (self.ref_count[b] > 0) + (b in free) + (b in lru)
            assert states == 1, f"block {b} is in {states} states"
            if b in lru:
                assert self.hash_of[b] is not None
        for h, b in self.by_hash.items():
            assert self.hash_of[b] == h
