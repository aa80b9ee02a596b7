"""The scheduler: which tokens of which requests the next step runs (vLLM V1's semantics).

Read from vLLM's vllm/v1/core/sched/scheduler.py (``Scheduler.schedule``) and
vllm/v1/core/kv_cache_manager.py (``get_computed_blocks``, ``allocate_slots``); nano-vllm's
``scheduler.py`` is the compact version. One call to ``schedule`` is one iteration:

1. **Running requests first**, in admission order: each gets what it still needs (one decode token,
   or the rest of its prompt), at most what is left of the token budget (``max_num_batched_tokens``):
   a prompt longer than that is prefilled in chunks (chunked prefill), so a step mixes prefill chunks
   and decodes. Its blocks are allocated now, before the forward; when the pool cannot hold them, the
   most recently admitted running request is **preempted by recompute** (its blocks freed, its
   computed tokens forgotten, back to the front of the waiting queue), and the allocation is tried
   again; a request that has to preempt itself waits.
2. **Then waiting requests**, in arrival order (a preempted one first), while the budget lasts,
   fewer than ``max_num_seqs`` run, and no request was preempted in this step: each looks up the
   prefix cache (the longest chain of cached full blocks, at most its length - 1 rounded down to a
   block), then allocates its first chunk; the first that does not fit stops the admissions.

Prefix-cache counters, as vLLM 0.33 keeps them: a lookup is counted only when its admission succeeds
(scheduler.py, ``schedule``: "Record at admission so unscheduled lookups are not counted", the
``record_prefix_cache_stats`` call after ``allocate_slots``), so a request that waits for blocks and
retries is counted once; and a request preempted before (``num_preemptions > 0``) is counted apart
(metrics/stats.py, ``PrefixCacheStats.record``: ``preempted_queries``/``preempted_hits``), outside
``queries``/``hits``, the two the ``vllm:prefix_cache_queries``/``_hits`` counters add up
(metrics/loggers.py). Older vLLM counted inside ``get_computed_blocks``, every attempt included.

Policies on the same loop, for the comparison: ``continuous`` (the above), ``static`` (admissions
only when the engine is idle: the arrived requests, up to ``max_num_seqs``, form a batch that runs
until its last request ends) and ``sequential`` (a batch of one: one request at a time).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from kvviz.engine.serving.ragged_cache import RaggedPagedCache
from kvviz.engine.serving.records import Scheduled
from kvviz.engine.serving.requests import Live

Policy = Literal["continuous", "static", "sequential"]
POLICIES: tuple[str, ...] = ("continuous", "static", "sequential")


@dataclass
class StepPlan:
    """What one iteration runs: per request (in token order) its share, and whom it preempted."""
    scheduled: list[tuple[Live, Scheduled]] = field(default_factory=list)
    preempted: list[tuple[Live, int]] = field(default_factory=list)  # (request, computed tokens it lost)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for _, s in self.scheduled)


class Scheduler:
    """Queues and the step plan over one ``RaggedPagedCache``."""

    def __init__(self, cache: RaggedPagedCache, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: Policy = "continuous") -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)} (got {policy!r})")
        self.cache, self.budget, self.max_num_seqs, self.policy = cache, max_num_batched_tokens, max_num_seqs, policy
        self.waiting: deque[Live] = deque()  # arrived, not running: queue order
        self.running: list[Live] = []  # admission order
        self.batch: set[str] = set()  # static/sequential: the current batch's requests
        self.prefix_query_tokens = 0  # vLLM's prefix_cache_queries: first admissions only
        self.prefix_hit_tokens = 0  # vLLM's prefix_cache_hits
        self.preempted_query_tokens = 0  # vLLM's PrefixCacheStats.preempted_queries: re-admissions
        self.preempted_hit_tokens = 0  # ... .preempted_hits

    def arrive(self, live: Live) -> None:
        self.waiting.append(live)

    def _cap(self) -> int:
        return 1 if self.policy == "sequential" else self.max_num_seqs

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.budget
        # 1. running requests, admission order; the list may shrink as preemption pops its tail.
        i = 0
        while i < len(self.running) and budget > 0:
            live = self.running[i]
            n = min(live.num_tokens - live.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            while not self.cache.allocate(live.rid, n):
                victim = self.running.pop()  # the most recently admitted
                plan.preempted.append((victim, self._preempt(victim)))
                if victim is live:
                    break
            if live not in self.running:  # it preempted itself: nothing more fits this step
                break
            # A recompute after preemption feeds prompt and output ids alike as prefill chunks.
            kind = "prefill" if live.num_computed < live.num_prompt else "decode"
            plan.scheduled.append((live, Scheduled(live.rid, kind, live.num_computed, n)))
            budget -= n
            i += 1
        # 2. waiting requests, queue order; none while this step preempted (vLLM does the same).
        if plan.preempted:
            return plan
        if self.policy != "continuous" and not self.running and not any(r.rid in self.batch for r in self.waiting):
            self.batch = {r.rid for r in list(self.waiting)[:self._cap()]}  # the engine is idle: a new batch
        while self.waiting and budget > 0 and len(self.running) < self._cap():
            live = self.waiting[0]
            if self.policy != "continuous" and live.rid not in self.batch:
                break
            hit = self.cache.find_prefix(live.all_ids, live.num_tokens - 1)
            n = min(live.num_tokens - hit.tokens, budget)
            if not self.cache.allocate(live.rid, n, hit):
                break
            self.waiting.popleft()
            self.running.append(live)
            self._count_lookup(live, hit.tokens)
            live.num_computed = hit.tokens
            live.status = "running"
            live.record.prefix_hit_tokens += hit.tokens
            plan.scheduled.append((live, Scheduled(live.rid, "prefill", hit.tokens, n, hit.tokens)))
            budget -= n
        return plan

    def _count_lookup(self, live: Live, hit_tokens: int) -> None:
        """One admitted request's prefix-cache lookup in vLLM 0.33's counters (KVCacheManager.
        record_prefix_cache_stats -> PrefixCacheStats.record): none with caching off; a request
        preempted before goes to the preempted counters. Called after the allocation succeeded."""
        if not self.cache.prefix_caching:
            return
        if live.record.preemptions > 0:
            self.preempted_query_tokens += live.num_tokens
            self.preempted_hit_tokens += hit_tokens
        else:
            self.prefix_query_tokens += live.num_tokens
            self.prefix_hit_tokens += hit_tokens

    def _preempt(self, live: Live) -> int:
        """Preemption by recompute: the blocks freed, computed tokens forgotten, first in the queue."""
        lost = live.num_computed
        self.cache.free(live.rid)
        live.num_computed = 0
        live.status = "waiting"
        live.record.preemptions += 1
        live.record.lost_tokens += lost
        self.waiting.appendleft(live)
        return lost

    def finish(self, live: Live) -> None:
        """A request ended (or the run stopped): out of the queues, its blocks back to the pool."""
        if live in self.running:
            self.running.remove(live)
        if live in self.waiting:
            self.waiting.remove(live)
        self.cache.free(live.rid)
        live.status = "finished"
