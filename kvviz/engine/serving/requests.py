"""A serving request and its live state: what the scheduler schedules and the engine samples for.

``ServeRequest`` is what a workload gives (id, prompt ids, sampling, max_tokens, ignore_eos, stop
strings, arrival); ``Live`` is the scheduler's view of it while it runs, as vLLM's ``Request``
(vllm/v1/request.py): ``all_ids`` (prompt + output), ``num_computed`` (positions whose K/V are in
the pool), its status, preemptions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.serving.records import RequestRecord
from kvviz.errors import KVVizError


@dataclass(frozen=True)
class ServeRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    arrival: float = 0  # scheduler steps (step mode) or seconds since the run began (seconds mode)
    prompt_text: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise KVVizError(f"request {self.request_id!r} has an empty prompt")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise KVVizError(f"request {self.request_id!r}: max_tokens must be an integer >= 1 "
                             f"(got {self.max_tokens!r})")
        if isinstance(self.arrival, bool) or not isinstance(self.arrival, (int, float)) or not \
                0 <= self.arrival < 1e9:
            raise KVVizError(f"request {self.request_id!r}: arrival must be a number >= 0 (got {self.arrival!r})")


@dataclass
class Live:
    """One request inside the engine (vLLM's Request): ids so far, computed positions, its record."""
    req: ServeRequest
    record: RequestRecord
    all_ids: list[int]
    num_computed: int = 0
    status: str = "waiting"  # "waiting", "running", "finished"
    text: str = ""

    @property
    def rid(self) -> str:
        return self.req.request_id

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def num_output(self) -> int:
        return len(self.all_ids) - self.num_prompt


def check_requests(requests: list[ServeRequest], context: int, pool_tokens: int, block_size: int,
                   budget: int) -> None:
    """What no schedule can serve, named before anything runs: 0 requests, a duplicate id, a request
    past the model's context, one whose prompt and output the whole pool cannot hold, a budget
    smaller than a block."""
    if not requests:
        raise KVVizError("the workload has no requests (0 requests): give at least one")
    seen: set[str] = set()
    for r in requests:
        if r.request_id in seen:
            raise KVVizError(f"two requests share the id {r.request_id!r}")
        seen.add(r.request_id)
        total = len(r.prompt_ids) + r.max_tokens
        if total > context:
            raise KVVizError(f"request {r.request_id!r}: prompt ({len(r.prompt_ids)} tokens) + max_tokens "
                             f"({r.max_tokens}) = {total} is past the model's context of {context} tokens")
        if total > pool_tokens:
            raise KVVizError(f"the KV pool holds {pool_tokens} tokens per request at most, smaller than request "
                             f"{r.request_id!r}'s prompt + output ({total} tokens): give the pool more blocks")
    if budget < block_size:
        raise KVVizError(f"the token budget ({budget}) is smaller than one block ({block_size} tokens): "
                         f"raise --max-num-batched-tokens or lower --block-size")
