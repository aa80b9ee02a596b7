"""What a ``Conversation`` checks and times on demand, and the step its turns are timed with.

``feed`` is one prefill or decode step on a cache (plan, forward, commit), the very code a turn's
TTFT times; ``recompute_ttft_ms`` times it over a turn's whole prompt on a fresh cache, so a turn's
TTFT with reuse and without it measure the same work but for what was reused. ``ConversationChecks``
is the part of ``Conversation`` (engine/sessions/conversation.py) that reads its finished turns:
warm-up, the check against a from-scratch generation, and the timing without reuse.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from kvviz.engine.core.step import Backend, backend_of, run_pieces
from kvviz.engine.core.loop import GenerationStream
from kvviz.engine.generation.request import BACKENDS, GenerateRequest, kv_spec
from kvviz.engine.generation.valid_request import CacheSpec
from kvviz.engine.generation.sampling import SamplingParams, make_generator, sample
from kvviz.engine.kvcache.dense import KVCache
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.generation.kv_spec import KVSpec
from kvviz.engine.kvcache.paged_cache import PagedKVCache
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.sessions.turn import TurnRecord
from kvviz.errors import KVVizError


def feed(model: LoadedModel, cache: KVCache, backend: Backend, inp: torch.Tensor,
         positions: torch.Tensor) -> torch.Tensor:
    """Plan, forward, commit the new positions (1, T) at ``cache.pos`` through the step driver:
    in pieces where a full window takes one token per forward. The last piece's logits (1, 1, V)."""
    return run_pieces(model, cache, inp, positions.narrow(0, cache.pos, inp.shape[1]), backend=backend)


def turn_sampling(sampling: object) -> SamplingParams:
    """The conversation's sampler: a SamplingParams; a turn ends at the model's end of turn, always."""
    if not isinstance(sampling, SamplingParams):
        raise KVVizError(f"sampling must be a SamplingParams, e.g. SamplingParams(temperature=0.8) (got {sampling!r})")
    if sampling.ignore_eos:
        raise KVVizError("a conversation's turn ends at the model's end of turn: ignore_eos is for plain runs")
    return sampling


def chat_cache(cache: object) -> CacheSpec:
    if not isinstance(cache, CacheSpec):
        raise KVVizError(f"cache must be a CacheSpec, e.g. CacheSpec(kind='paged') (got {cache!r})")
    if not cache.use_cache:
        raise KVVizError("a conversation keeps its turns in a KV cache: use_cache=False has nothing to reuse")
    return cache


def fast_backend(backend: object) -> bool:
    """The accelerator runs the turns ("fast") or the readable model does ("readable")."""
    if backend not in BACKENDS:
        raise KVVizError(f"backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
    return backend == "fast"


def chat_kv(model: LoadedModel, cache: CacheSpec) -> KVSpec | None:
    """The compressed cache asked for, resolved and checked for ``model`` (None: the plain kind)."""
    if not cache.kv.active:
        return None
    if cache.kind != "static":
        raise KVVizError(f"a {cache.kv.label()} cache replaces the static cache; it does not combine with "
                         f"{cache.kind!r}")
    return kv_spec(model, cache.kv_dtype, cache.window, cache.sinks, cache.group_size, cache.zero_point,
                   cache.fp8_scale, cache.positions, cache.track_errors)


class ConversationChecks:
    """Checks over a conversation's finished turns (mixed into ``Conversation``, which sets these)."""

    if TYPE_CHECKING:
        model: LoadedModel
        fast: bool
        cache: KVCache
        cache_kind: str
        kv: KVSpec | None
        params: SamplingParams
        max_new_tokens: int
        turns: list[TurnRecord]
        carried: int
        _lock: threading.RLock
        _active: Any

        def render(self, messages: list[dict[str, str]]) -> list[int]: ...

    def _own(self, turn: int) -> TurnRecord:
        """Turn ``turn``, if this cache's model computed it (a carried turn's ids are another tokenizer's)."""
        if not 0 <= turn < len(self.turns):
            raise KVVizError(f"there is no turn {turn + 1} (the conversation has {len(self.turns)})")
        if turn < self.carried:
            raise KVVizError(f"turn {turn + 1} was computed on an earlier cache ({self.turns[turn].made_on}); "
                             "only turns computed on this one can be checked or timed again")
        return self.turns[turn]

    def scratch_ids(self, turn: int) -> list[int]:
        """Turn ``turn``'s tokens generated from scratch (a fresh static cache, the turn's own sampling)."""
        t = self._own(turn)
        p = t.params or self.params
        req = GenerateRequest(list(t.prompt_ids), max_new_tokens=t.max_new_tokens or self.max_new_tokens,
                              sampling=p, backend="fast" if self.fast else "readable")
        stream = GenerationStream(self.model, req.validate(self.model))  # plain decoding, a fresh static cache
        for _ in stream:
            pass
        return list(stream.run.generated_ids)

    def matches_scratch(self, turn: int) -> bool:
        return self.scratch_ids(turn) == list(self.turns[turn].generated_ids)

    def recompute_ttft_ms(self, turn: int) -> float:
        """TTFT of turn ``turn`` with nothing reused: its whole prompt prefilled on a fresh cache of
        the conversation's kind, timed as the turn's own TTFT is (plan, forward, commit, sample)."""
        t, m = self._own(turn), self.model
        ids, p = list(t.prompt_ids), t.params or self.params
        backend = backend_of(m, self.fast)
        with torch.inference_mode():
            if isinstance(self.cache, PagedKVCache):  # a pool just big enough for this prompt
                bs = self.cache.block_size
                cache: KVCache = PagedKVCache(m.config, 1, m.device, m.dtype, bs,
                                              self.cache.pool.blocks_for_sequence(len(ids) + 1))
            else:
                cache = make_cache(self.cache_kind, m.config, 1, m.device, m.dtype, kv=self.kv)
            inp = torch.tensor([ids], dtype=torch.long, device=m.device)  # (1, N)
            gen = None if p.greedy else make_generator(p, m.device)
            t0 = time.perf_counter()
            logits = feed(m, cache, backend, inp, torch.arange(m.config.block_size, device=m.device))
            sample(logits.select(1, -1).float(), p, gen)
            return (time.perf_counter() - t0) * 1000.0

    def time_without_reuse(self) -> float | None:
        """Time the last turn's prompt prefilled from scratch (``recompute_ttft_ms``) and keep it on
        its record as ``no_reuse_ttft_ms``: what the turn cost vs what it would have cost, both
        measured on this machine, one right after the other. Holds the lock, so no turn runs
        beside the timing. None when there is nothing to time (no turn, a carried one, a turn
        running)."""
        with self._lock:
            last = len(self.turns) - 1
            if last < self.carried or self._active is not None:
                return None
            t = self.turns[last]
            if t.no_reuse_ttft_ms is None:
                t = replace(t, no_reuse_ttft_ms=self.recompute_ttft_ms(last))
                self.turns = [*self.turns[:last], t]
            return t.no_reuse_ttft_ms
