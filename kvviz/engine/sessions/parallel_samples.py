"""n parallel samples from one prompt, the way a serving engine runs them (vLLM's ``n=4``).

The prompt is prefilled once, on one row; ``cache.reorder([0] * n)`` then fans that row out to n.
A paged cache shares the prompt's blocks by reference (ref count n, nothing copied); a static
cache copies the prompt n times (``reorder`` returns those bytes). Each row then samples its
own answer; on a paged cache the first write into the shared partial last block copies that
block (copy-on-write), and from there every row owns its blocks.

Both cache kinds run the same arithmetic, so their tokens are equal (tests hold them to it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from kvviz.engine.core.step import backend_of, run_step
from kvviz.engine.kvcache.dense import KVCache
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.generation.request import check_budget, check_pool
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.kvcache.paged_cache import DEFAULT_BLOCK_SIZE, PagedKVCache, PagedPool
from kvviz.engine.kvcache.paged_pool import blocks_for, config_groups, pool_blocks
from kvviz.engine.generation.sampling import SamplingParams, make_generator, sample
from kvviz.errors import KVVizError

MAX_SAMPLES = 16


@dataclass
class ParallelSamples:
    """Iterate it for the pool's state after each step (paged; {} otherwise)."""

    model: LoadedModel
    prompt_ids: list[int]
    n: int = 4
    max_new_tokens: int = 24
    temperature: float = 1.0
    seed: int = 0
    cache_kind: str = "paged"
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    pool: PagedPool | None = None
    fast: bool = True
    rows: list[list[int]] = field(default_factory=list)  # each sample's tokens
    reorder_bytes: int = 0  # what fanning the prompt out to n rows copied
    cache: KVCache | None = None

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES:
            raise KVVizError(f"the number of samples must be 1..{MAX_SAMPLES} (got {self.n!r})")
        if not self.prompt_ids:
            raise KVVizError("the prompt is empty")
        check_budget(self.model, len(self.prompt_ids), self.max_new_tokens)
        if self.cache_kind == "paged" and self.pool is None:
            check_pool(self.kv_block_size, None, 1)
        self.params = SamplingParams(temperature=self.temperature, seed=self.seed)  # 0: greedy

    def __iter__(self) -> Iterator[dict[str, Any]]:
        m, dev, n = self.model, self.model.device, self.n
        backend = backend_of(m, self.fast)
        with torch.inference_mode():
            # Unless a pool is given, one of n whole contexts, unshared: the copy-on-write worst case.
            rows = pool_blocks(config_groups(m.config).count, blocks_for(m.config.block_size, self.kv_block_size), n)
            cache: KVCache = make_cache(self.cache_kind, m.config, 1, dev, m.dtype, block_size=self.kv_block_size,
                                        num_blocks=None if self.pool else rows, pool=self.pool)
        self.cache = cache
        gen = None if self.params.greedy else make_generator(self.params, dev)
        positions = torch.arange(m.config.block_size, device=dev)
        inp = torch.tensor([self.prompt_ids], dtype=torch.long, device=dev)  # (1, N)
        self.rows = [[] for _ in range(n)]
        try:
            for step in range(self.max_new_tokens):
                start = cache.pos
                with torch.inference_mode():
                    logits = run_step(m, cache, inp, positions.narrow(0, start, inp.shape[1]), backend=backend)
                    last = logits.select(1, -1).float()  # (B, V)
                    if step == 0:  # one prompt row fans out to n: the rows share it from here
                        self.reorder_bytes = cache.reorder(torch.zeros(n, dtype=torch.long))
                        last = last.expand(n, -1)  # (n, V): the same distribution, n draws
                    nxt = sample(last, self.params, gen)  # (n,)
                for r, t in enumerate(nxt.tolist()):
                    self.rows[r].append(t)
                yield cache.snapshot() if isinstance(cache, PagedKVCache) else {}
                inp = nxt.view(n, 1)
        except BaseException:
            # Abandoned (GeneratorExit), stopped or failed inside a layer: on a shared pool the rows'
            # blocks go back (full ones stay findable by hash), so its ref counts equal the tables
            # of the caches still running.
            with torch.inference_mode():
                cache.reset()
            raise

    def run(self) -> "ParallelSamples":
        for _ in self:
            pass
        return self

    def texts(self) -> list[str]:
        return [self.model.tokenizer.decode(r) for r in self.rows]
