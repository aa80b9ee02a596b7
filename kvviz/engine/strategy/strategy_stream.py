"""What beam search and speculative decoding add to the stream base: a cache sized for their rows.

``open_stream`` (engine/core/loop.py) opens a beam or speculative stream when the checked
request carries ``BeamOptions`` or ``SpecOptions``; text, stops, events and the Run come from
``StreamBase`` (engine/core/stream_base.py), exactly as for the plain loop, so the CLI and
the API treat every strategy alike.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvviz.engine.core.stream_base import StreamBase
from kvviz.engine.kvcache.dense import KVCache
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.kvcache.paged_cache import blocks_for
from kvviz.engine.kvcache.paged_pool import config_groups, pool_blocks


@dataclass
class StrategyStream(StreamBase):
    def _cache(self, rows: int, tokens: int) -> KVCache:
        """The run's cache, any kind; a paged pool gets room for ``rows`` sequences of ``tokens``."""
        m, r = self.model, self.req
        groups = config_groups(m.config).count  # a hybrid model's layer groups each keep a table
        # Each row: the blocks its tokens fill and one more (the sizing these strategies always had).
        blocks = r.kv_blocks or pool_blocks(groups, blocks_for(tokens, r.kv_block_size) + 1, rows)
        return make_cache(r.cache_kind, m.config, 1, m.device, m.dtype, block_size=r.kv_block_size,
                          num_blocks=blocks)
