"""The serving page's workload builder, pure (no streamlit, no torch): the page's choices in, a
list of requests out, each as a line of ``serve-bench``'s workload file (``id``, ``prompt_ids``,
``max_tokens``, ``ignore_eos``, ``arrival`` in scheduler steps); and the checks that turn bad
input into one clear sentence before anything runs.

Arrivals are in steps, so a run is the same, step for step, every time (the replay relies on it).
Every random choice draws from one ``random.Random(seed)``.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

ARRIVALS = {"once": "all at once", "steady": "a steady rate", "poisson": "Poisson (seeded)", "bursts": "bursts"}
LENGTHS = {"fixed": "fixed", "uniform": "uniform", "real": "shipped real prompts"}
MAX_REQUESTS = 256


@dataclass(frozen=True)
class WorkloadSpec:
    """What the page's workload builder chose."""
    requests: int = 16
    arrival: str = "poisson"  # a key of ARRIVALS
    rate: float = 1.0  # requests per scheduler step (steady, Poisson)
    burst_size: int = 4
    burst_every: int = 10  # steps between bursts
    prompt: str = "uniform"  # a key of LENGTHS
    prompt_len: int = 32  # fixed; the low end for uniform
    prompt_max: int = 96  # the high end for uniform
    output: str = "uniform"  # "fixed" or "uniform"
    output_len: int = 8
    output_max: int = 32
    shared_fraction: float = 0.5  # of the requests, the share that start with the shared system prompt
    shared_len: int = 32  # tokens of the shared system prompt
    seed: int = 0


def arrivals(spec: WorkloadSpec, rng: random.Random) -> list[int]:
    """Each request's arrival step: all at 0; one every 1/rate steps; Poisson (exponential gaps of
    mean 1/rate, summed, floored to a step); or ``burst_size`` at once every ``burst_every`` steps."""
    n = spec.requests
    if spec.arrival == "once":
        return [0] * n
    if spec.arrival == "steady":
        return [math.floor(i / spec.rate) for i in range(n)]
    if spec.arrival == "bursts":
        return [(i // spec.burst_size) * spec.burst_every for i in range(n)]
    t, out = 0.0, []
    for _ in range(n):
        out.append(math.floor(t))
        t += rng.expovariate(spec.rate)
    return out


def _lengths(kind: str, low: int, high: int, n: int, rng: random.Random) -> list[int]:
    return [low] * n if kind == "fixed" else [rng.randint(low, max(low, high)) for _ in range(n)]


def _cut(ids: Sequence[int], length: int, offset: int) -> list[int]:
    """``length`` ids of ``ids`` cycled from ``offset`` (a text shorter than the length repeats)."""
    return [ids[(offset + k) % len(ids)] for k in range(length)] if ids else [0] * length


def build(spec: WorkloadSpec, texts: Sequence[Sequence[int]], system: Sequence[int],
          real: Sequence[Sequence[int]] = (), real_shared: Sequence[Sequence[int]] = ()) -> list[dict[str, object]]:
    """The requests. ``texts``: token ids of distinct texts; request i's own part is text i mod k,
    read from a different offset each round, so two requests share no prefix by accident.
    ``system``: the shared system prompt's ids (cut or cycled to ``shared_len``), put in front of
    every request whose place falls in the shared fraction (spread evenly, not the first ones).
    ``real``: whole prompts (LENGTHS "real"), taken in turn; ``real_shared``: the same prompts with
    the system prompt already laid out in them (a chat template's system message), used for the
    shared ones instead of a prefix."""
    rng = random.Random(spec.seed)
    n = spec.requests
    arrive = arrivals(spec, rng)
    own = _lengths("fixed" if spec.prompt == "fixed" else "uniform", spec.prompt_len, spec.prompt_max, n, rng)
    out_len = _lengths(spec.output, spec.output_len, spec.output_max, n, rng)
    shared_ids = _cut(system, spec.shared_len, 0) if spec.shared_len > 0 else []
    out = []
    for i in range(n):
        # Request i is shared when the running count of shared ones steps up at i (an even spread).
        shared = math.floor((i + 1) * spec.shared_fraction) > math.floor(i * spec.shared_fraction)
        prefix = shared_ids if shared and spec.shared_len > 0 else []
        if spec.prompt == "real" and real:
            if shared and real_shared:
                body, prefix = list(real_shared[i % len(real_shared)]), []
            else:
                body = list(real[i % len(real)])
        else:
            k = len(texts) or 1
            body = _cut(texts[i % k] if texts else [], own[i], 7 * (i // k))
        out.append({"id": f"r{i:03d}", "prompt_ids": prefix + body, "max_tokens": out_len[i], "ignore_eos": True,
                    "arrival": arrive[i], "shared": shared and (bool(prefix) or bool(real_shared))})
    return out


def problems(spec: WorkloadSpec, requests: Sequence[dict[str, object]], *, context: int, num_blocks: int,
             block_size: int, budget: int) -> list[str]:
    """Why this workload cannot run on this pool, one sentence each (empty: it can)."""
    out: list[str] = []
    if spec.requests < 1:
        out.append("A workload needs at least 1 request.")
    if budget < block_size:
        out.append(f"The token budget ({budget}) is smaller than one block ({block_size} tokens): raise the "
                   "budget or use smaller blocks.")
    if not requests:
        return out
    longest = max(len(r["prompt_ids"]) + int(r["max_tokens"]) for r in requests)  # type: ignore[arg-type]
    if longest > context:
        out.append(f"The longest request needs {longest} tokens (prompt + output), past this model's context of "
                   f"{context}: shorten the prompts or the outputs.")
    need = max(math.ceil((len(r["prompt_ids"]) + 1) / block_size) for r in requests)  # type: ignore[arg-type]
    if need > num_blocks:
        out.append(f"The pool ({num_blocks} blocks of {block_size} tokens) is smaller than one request's prompt "
                   f"({need} blocks): no request could ever run. Give the pool more blocks.")
    return out


def pool_blocks_from_mib(mib: float, bytes_per_token: float, block_size: int) -> int:
    """Blocks a pool of ``mib`` MiB holds: whole blocks of ``block_size`` tokens at the calculator's
    bytes per token (2 x layers x K/V heads x head_dim x bytes)."""
    return int(mib * 2 ** 20 // (bytes_per_token * block_size))


def max_concurrency(num_blocks: int, block_size: int, max_len: int) -> float:
    """vLLM's "Maximum concurrency for L tokens per request": the pool's blocks over one request's
    blocks at L tokens, ceil(L / block size) for full attention (kv_cache_utils.py, as
    ``calculator/server_vllm.py`` applies it)."""
    return num_blocks / math.ceil(max_len / block_size) if max_len > 0 else 0.0
