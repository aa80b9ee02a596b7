"""Every cache kind by name: static and concat (cache.py) and paged (paged.py), one factory."""
from __future__ import annotations

import torch

from kvviz.engine.cache import CACHE_KINDS, KVCache
from kvviz.engine.config import GPTConfig
from kvviz.engine.paged import DEFAULT_BLOCK_SIZE, PagedKVCache

KINDS = (*CACHE_KINDS, "paged")


def make_cache(kind: str, config: GPTConfig, batch: int, device: torch.device | str, dtype: torch.dtype,
               block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None) -> KVCache:
    """A cache of ``kind``; ``block_size`` (tokens per block) and ``num_blocks`` apply to "paged"."""
    if kind == "paged":
        return PagedKVCache(config, batch=batch, device=device, dtype=dtype, block_size=block_size,
                            num_blocks=num_blocks)
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; choose one of {list(KINDS)}")
    return CACHE_KINDS[kind](config, batch=batch, device=device, dtype=dtype)
