"""Every cache kind by name: static and concat (dense.py) and paged (paged_cache.py), one factory."""
from __future__ import annotations

import torch

from kvviz.engine.kvcache.dense import CACHE_KINDS, KVCache
from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.engine.kvcache.compressed_caches import QuantizedKVCache, WindowKVCache
from kvviz.engine.generation.kv_spec import KVSpec
from kvviz.engine.kvcache.paged_cache import DEFAULT_BLOCK_SIZE, PagedKVCache
from kvviz.engine.kvcache.paged_pool import PagedPool

KINDS = (*CACHE_KINDS, "paged")


def make_cache(kind: str, config: GPTConfig, batch: int, device: torch.device | str, dtype: torch.dtype,
               block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None,
               kv: KVSpec | None = None, pool: PagedPool | None = None) -> KVCache:
    """A cache of ``kind``; ``block_size`` (tokens per block), ``num_blocks`` and ``pool`` (an existing
    pool to take blocks from, shared with other caches) apply to "paged".

    An active ``kv`` spec (resolved by ``kv_spec.resolve``) replaces a static cache with a windowed
    or quantized one (engine/kvcache/compressed_caches.py)."""
    if kv is not None and kv.active:
        if kind != "static":
            raise ValueError(f"a quantized or windowed KV cache replaces the static one, not {kind!r}")
        cls = WindowKVCache if kv.windowed else QuantizedKVCache
        return cls(config, kv, batch=batch, device=device, dtype=dtype)
    if kind == "paged":
        return PagedKVCache(config, batch=batch, device=device, dtype=dtype, block_size=block_size,
                            num_blocks=num_blocks, pool=pool)
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; choose one of {list(KINDS)}")
    return CACHE_KINDS[kind](config, batch=batch, device=device, dtype=dtype)
