"""What the serving scheduler records: plain dataclasses, no torch (the page, the CLI's JSON and
the replay read them). One ``StepRecord`` per scheduler iteration, idle ones included; one
``RequestRecord`` per request, final once it finished.

This is the contract between the engine (kvviz/engine/serving) and the page/charts: fields are
only added, never renamed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

RequestState = Literal["waiting", "running", "preempted", "finished"]


@dataclass(frozen=True)
class Scheduled:
    """One request's share of a step: a prefill chunk or one decode token."""
    request_id: str
    kind: Literal["prefill", "decode"]
    start: int  # first position fed this step
    num_tokens: int  # tokens fed this step (1 for a decode)
    prefix_hit_tokens: int = 0  # tokens taken from the prefix cache at admission (0 after the first chunk)


@dataclass(frozen=True)
class Preemption:
    """A request preempted by recompute: its blocks freed, it went back to the front of the queue."""
    step: int
    request_id: str
    lost_tokens: int  # computed tokens (prompt + generated) whose K/V it lost
    recomputed_at: int | None = None  # the step whose prefill got them back (None while waiting)


@dataclass(frozen=True)
class StepRecord:
    """One scheduler iteration, after its forward (an idle step has no ``scheduled``)."""
    step: int
    t_ms: float  # wall clock since the run began, at the end of the step
    forward_ms: float  # the forward alone (0 for an idle step)
    scheduled: tuple[Scheduled, ...]
    budget: int  # max_num_batched_tokens
    running: tuple[str, ...]  # request ids running after the step, in admission order
    waiting: tuple[str, ...]  # request ids waiting (arrived, not running), queue order
    finished: tuple[str, ...]  # request ids that finished in this step
    preempted: tuple[str, ...]  # request ids preempted in this step
    blocks_total: int
    blocks_used: int  # ref count >= 1
    blocks_cached: int  # ref 0, hashed, evictable
    blocks_free: int
    tokens_in_blocks: int  # K/V rows actually written in used blocks (<= blocks_used * block_size)
    block_owner: tuple[tuple[str, ...], ...]  # per block: the request ids whose table holds it (() = free/cached)
    block_state: tuple[str, ...]  # per block: "free", "used", "shared" (ref > 1) or "cached"
    prefix_query_tokens: int  # cumulative, vLLM's prefix_cache_queries (first admissions only, as 0.33)
    prefix_hit_tokens: int  # cumulative, vLLM's prefix_cache_hits
    new_tokens: dict[str, int] = field(default_factory=dict)  # request id -> token sampled this step
    preempted_query_tokens: int = 0  # cumulative: re-admissions after a preemption (vLLM's preempted_queries)
    preempted_hit_tokens: int = 0  # cumulative: their hits (vLLM's preempted_hits)
    window_freed_blocks: int = 0  # cumulative: blocks sliding-window groups let go mid-request (Gemma 3)

    @property
    def prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.kind == "prefill")

    @property
    def decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.kind == "decode")


@dataclass
class RequestRecord:
    """One request's life: its ids and text, its times, what preemption and the prefix cache did to it."""
    request_id: str
    prompt_len: int
    max_tokens: int
    arrival: float  # seconds or steps, as the workload gave it
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    state: RequestState = "waiting"
    admitted_step: int | None = None
    first_token_step: int | None = None
    finished_step: int | None = None
    arrival_ms: float | None = None  # wall clock of arrival (seconds mode), or of the step it became visible
    first_token_ms: float | None = None
    finished_ms: float | None = None
    token_ms: list[float] = field(default_factory=list)  # wall clock of every sampled token
    preemptions: int = 0
    lost_tokens: int = 0
    prefix_hit_tokens: int = 0
    finish_reason: str | None = None  # "length", "eos", "stop", "aborted"

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_ms is None or self.arrival_ms is None:
            return None
        return self.first_token_ms - self.arrival_ms

    @property
    def tpot_ms(self) -> float | None:
        """Mean inter-token time after the first token (vLLM's TPOT)."""
        if len(self.token_ms) < 2:
            return None
        return (self.token_ms[-1] - self.token_ms[0]) / (len(self.token_ms) - 1)

    @property
    def e2e_ms(self) -> float | None:
        if self.finished_ms is None or self.arrival_ms is None:
            return None
        return self.finished_ms - self.arrival_ms
