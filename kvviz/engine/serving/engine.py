"""The serving engine: requests arrive, the scheduler plans each step, one ragged forward runs it.

``ServeEngine(model, ServeConfig(...)).run(requests)`` loops, one iteration per step (vLLM's
``EngineCore.step``: schedule, execute, update): the requests whose arrival has come join the
waiting queue; ``Scheduler.schedule`` picks the step's tokens and allocates their blocks; every
scheduled token of every request goes through the weights in ONE forward (``run_step`` over the
``RaggedPagedCache``: the batch is one row of N tokens, each at its own position); each request
whose computed positions reach its ids is sampled from its own last logits with its own
``SamplingParams`` and generator; a request that ends (max_tokens, EOS, a stop string) frees its
blocks. One ``StepRecord`` per iteration, idle ones included, and one ``RequestRecord`` per request.

Arrival in steps (deterministic: step k sees the requests with arrival <= k; the counter advances on
every iteration) or in seconds (the wall clock since the run began; an idle engine sleeps until the
next arrival). ``abort()`` (another thread) or an ``on_step`` callback returning False stops the run
after the current step; whatever ends the run (the last request, a stop, an exception), every
request still in the engine ends "aborted" with what it generated and its blocks go back, so
``cache.audit()`` holds after every run.

The forward is the readable model's: the accelerator (kvviz.fast) runs one sequence's rows and
does not take a ragged step.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvviz.engine.core.step import run_step
from kvviz.engine.generation.sampling import make_generator, sample
from kvviz.engine.generation.stops import first_stop
from kvviz.engine.serving.ragged_cache import RaggedPagedCache, check_pool
from kvviz.engine.serving.records import Preemption, RequestRecord, StepRecord
from kvviz.engine.serving.requests import Live, ServeRequest, check_requests
from kvviz.engine.serving.scheduler import POLICIES, Scheduler, StepPlan
from kvviz.errors import KVVizError

if TYPE_CHECKING:
    from kvviz.engine.loading.loader import LoadedModel

MAX_ARRIVAL_STEPS = 100_000  # a step-mode arrival past this would only record idle steps


@dataclass(frozen=True)
class ServeConfig:
    num_blocks: int = 512
    block_size: int = 16
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    policy: str = "continuous"
    prefix_caching: bool = True
    arrival: str = "steps"  # "steps" or "seconds"
    keep_logits: bool = False  # keep each sampled position's logits (the equality tests read them)

    def settings(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "keep_logits"}


@dataclass
class ServeResult:
    settings: dict[str, Any]
    requests: list[RequestRecord]
    steps: list[StepRecord]
    preemptions: list[Preemption]
    stopped: str | None = None  # None, "aborted" (a Stop) or the exception's text
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # request id -> (V,) per sampled token
    blocks_leaked: int = 0  # blocks still held by a table after the run (0 unless a bug)


class ServeEngine:
    def __init__(self, model: "LoadedModel", config: ServeConfig) -> None:
        if config.policy not in POLICIES:
            raise KVVizError(f"--policy must be one of {', '.join(POLICIES)} (got {config.policy!r})")
        if config.arrival not in ("steps", "seconds"):
            raise KVVizError(f"arrival is counted in 'steps' or 'seconds' (got {config.arrival!r})")
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise KVVizError("max_num_seqs and max_num_batched_tokens must be >= 1")
        check_pool(model.config, config.num_blocks, config.block_size)
        self.model, self.config = model, config
        self.cache = RaggedPagedCache(model.config, config.num_blocks, config.block_size, model.dtype, model.device,
                                      config.prefix_caching)
        self._stop = threading.Event()

    def abort(self) -> None:
        """Stop the run after the current step (safe from another thread)."""
        self._stop.set()

    def check(self, requests: Sequence[ServeRequest]) -> None:
        c, cache = self.config, self.cache
        per_request = c.num_blocks // cache.groups.count * c.block_size  # tokens one request may hold
        check_requests(list(requests), self.model.config.block_size, per_request, c.block_size,
                       c.max_num_batched_tokens)
        if c.arrival == "steps":
            for r in requests:
                if r.arrival != int(r.arrival) or r.arrival > MAX_ARRIVAL_STEPS:
                    raise KVVizError(f"request {r.request_id!r}: a step arrival is a whole step 0..{MAX_ARRIVAL_STEPS} "
                                     f"(got {r.arrival!r})")

    def run(self, requests: Sequence[ServeRequest],
            on_step: Callable[[StepRecord], bool | None] | None = None) -> ServeResult:
        self.check(requests)
        self._stop.clear()
        run = _Run(self, list(requests))
        try:
            run.loop(on_step)
        except BaseException as e:
            run.stopped = f"{type(e).__name__}: {e}"
            raise
        finally:
            run.close()
        return run.result()


class _Run:
    """One run's state: the queues, the records, the clock."""

    def __init__(self, engine: ServeEngine, requests: list[ServeRequest]) -> None:
        self.engine, self.cache, self.model = engine, engine.cache, engine.model
        c = engine.config
        self.sched = Scheduler(self.cache, c.max_num_batched_tokens, c.max_num_seqs, c.policy)  # type: ignore[arg-type]
        self.lives = [Live(r, RequestRecord(r.request_id, len(r.prompt_ids), r.max_tokens, r.arrival), list(r.prompt_ids))
                      for r in requests]
        self.pending = sorted(self.lives, key=lambda lv: lv.req.arrival)  # stable: ties keep workload order
        self.gens = {lv.rid: make_generator(lv.req.sampling, self.model.device) for lv in self.lives}
        self.steps: list[StepRecord] = []
        self.preemptions: list[Preemption] = []
        self.open_preemption: dict[str, int] = {}  # request id -> index into preemptions, until recomputed
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.stopped: str | None = None
        self.t0 = time.perf_counter()
        self.step = 0
        eos = getattr(self.model.tokenizer, "eos_token_id", None)
        self.eos = eos if isinstance(eos, int) else None

    def ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0

    def _arrivals(self) -> None:
        secs = self.engine.config.arrival == "seconds"
        now = self.ms()
        while self.pending:
            lv = self.pending[0]
            if (lv.req.arrival * 1000.0 > now) if secs else (lv.req.arrival > self.step):
                break
            self.pending.pop(0)
            lv.record.arrival_ms = lv.req.arrival * 1000.0 if secs else now
            self.sched.arrive(lv)

    def loop(self, on_step: Callable[[StepRecord], bool | None] | None) -> None:
        while not self.engine._stop.is_set():
            self._arrivals()
            if not self.pending and not self.sched.waiting and not self.sched.running:
                return
            plan = self.sched.schedule()
            forward_ms, new, finished = 0.0, {}, []
            if plan.scheduled:
                forward_ms, new, finished = self._forward(plan)
            elif not self.sched.running and self.sched.waiting:
                raise RuntimeError("the scheduler made no progress with nothing running (a bug)")
            elif self.engine.config.arrival == "seconds" and self.pending:
                wait = self.pending[0].req.arrival - self.ms() / 1000.0
                if wait > 0:
                    self.engine._stop.wait(min(wait, 1.0))  # idle until the next arrival (or a Stop)
            for lv, lost in plan.preempted:
                self.open_preemption[lv.rid] = len(self.preemptions)
                self.preemptions.append(Preemption(self.step, lv.rid, lost))
            rec = self._record(plan, forward_ms, new, finished)
            self.steps.append(rec)
            self.step += 1
            if on_step is not None and on_step(rec) is False:
                self.engine.abort()
        self.stopped = "aborted"

    def _forward(self, plan: StepPlan) -> tuple[float, dict[str, int], list[str]]:
        layout, ids, pos, rows, at = [], [], [], [], 0
        for lv, s in plan.scheduled:
            if lv.record.admitted_step is None:
                lv.record.admitted_step = self.step
            layout.append((lv.rid, s.start, s.num_tokens))
            ids.extend(lv.all_ids[s.start:s.start + s.num_tokens])
            pos.extend(range(s.start, s.start + s.num_tokens))
            at += s.num_tokens
            if s.start + s.num_tokens == lv.num_tokens:
                rows.append(at - 1)  # this request samples from its last token's logits
        dev = self.model.device
        self.cache.set_layout(layout)
        on_cuda = dev.type == "cuda"
        if on_cuda:  # the clock reads finished work only: CUDA launches return before the kernels run
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        with torch.inference_mode():
            logits = run_step(self.model, self.cache, torch.tensor([ids], dtype=torch.long, device=dev),
                              torch.tensor(pos, dtype=torch.long, device=dev), backend="readable",
                              last_only=torch.tensor(rows, dtype=torch.long, device=dev))  # (1, K, V)
        if on_cuda:
            torch.cuda.synchronize(dev)
        forward_ms = (time.perf_counter() - t) * 1000.0
        new: dict[str, int] = {}
        finished: list[str] = []
        k = 0
        for lv, s in plan.scheduled:
            lv.num_computed += s.num_tokens
            if lv.rid in self.open_preemption and lv.num_computed >= self.preemptions[self.open_preemption[lv.rid]].lost_tokens:
                i = self.open_preemption.pop(lv.rid)
                self.preemptions[i] = dataclasses.replace(self.preemptions[i], recomputed_at=self.step)
            if lv.num_computed < lv.num_tokens:
                continue  # a prefill chunk short of the end: no token yet
            row = logits[0, k]  # (V,)
            k += 1
            if self.engine.config.keep_logits:
                self.logits.setdefault(lv.rid, []).append(row.float().clone())
            tok = int(sample(row[None], lv.req.sampling, self.gens[lv.rid])[0])
            new[lv.rid] = tok
            if self._append(lv, tok):
                finished.append(lv.rid)
        return forward_ms, new, finished

    def _append(self, lv: Live, tok: int) -> bool:
        """The sampled token joins the request; True when it ended it (and its blocks went back)."""
        rec, now = lv.record, self.ms()
        lv.all_ids.append(tok)
        rec.output_ids.append(tok)
        rec.token_ms.append(now)
        if rec.first_token_ms is None:
            rec.first_token_ms, rec.first_token_step = now, self.step
        reason = None
        if lv.req.stop:
            text = self.model.tokenizer.decode(rec.output_ids)
            hit = first_stop(text, max(1, len(text) - len(lv.text)), lv.req.stop)
            lv.text = text
            if hit is not None:
                lv.text, reason = text[:hit[0]], "stop"
        if reason is None and tok == self.eos and not lv.req.ignore_eos:
            reason = "eos"
        if reason is None and lv.num_output >= lv.req.max_tokens:
            reason = "length"
        if reason is None:
            return False
        self._end(lv, reason)
        return True

    def _end(self, lv: Live, reason: str) -> None:
        rec = lv.record
        if reason != "stop":
            lv.text = self.model.tokenizer.decode(rec.output_ids)
        rec.output_text, rec.finish_reason = lv.text, reason
        rec.state = "finished"
        rec.finished_step, rec.finished_ms = self.step, self.ms()
        self.sched.finish(lv)

    def _record(self, plan: StepPlan, forward_ms: float, new: dict[str, int], finished: list[str]) -> StepRecord:
        for lv in self.sched.running:
            lv.record.state = "running"
        for lv, _ in plan.preempted:
            lv.record.state = "preempted"
        bp = self.cache.blocks
        owners = self.cache.owners()
        state = tuple("used" if bp.ref_count[b] == 1 else "shared" if bp.ref_count[b] > 1
                      else "cached" if b in bp.lru else "free" for b in range(bp.num_blocks))
        used = sum(1 for r in bp.ref_count if r > 0)
        return StepRecord(
            step=self.step, t_ms=self.ms(), forward_ms=forward_ms, scheduled=tuple(s for _, s in plan.scheduled),
            budget=self.sched.budget, running=tuple(lv.rid for lv in self.sched.running),
            waiting=tuple(lv.rid for lv in self.sched.waiting), finished=tuple(finished),
            preempted=tuple(lv.rid for lv, _ in plan.preempted), blocks_total=bp.num_blocks, blocks_used=used,
            blocks_cached=len(bp.lru), blocks_free=len(bp.free), tokens_in_blocks=self.cache.tokens_in_blocks(),
            block_owner=tuple(tuple(o) for o in owners), block_state=state,
            prefix_query_tokens=self.sched.prefix_query_tokens, prefix_hit_tokens=self.sched.prefix_hit_tokens,
            new_tokens=new, preempted_query_tokens=self.sched.preempted_query_tokens,
            preempted_hit_tokens=self.sched.preempted_hit_tokens, window_freed_blocks=self.cache.window_freed)

    def close(self) -> None:
        """Whatever ended the run: no plan left, every request still in the engine ended "aborted"."""
        self.cache.abort_step()
        self.cache.layout = []
        for lv in self.lives:
            if lv.record.state != "finished":
                lv.record.output_text = self.model.tokenizer.decode(lv.record.output_ids)
                lv.record.finish_reason, lv.record.state = "aborted", "finished"
                self.sched.finish(lv)

    def result(self) -> ServeResult:
        leaked = sum(1 for r in self.cache.blocks.ref_count if r > 0)
        return ServeResult(self.engine.config.settings(), [lv.record for lv in self.lives], self.steps,
                           self.preemptions, self.stopped, self.logits, leaked)
