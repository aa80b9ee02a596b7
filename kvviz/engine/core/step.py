"""The step driver: the ONE routine that runs a forward over a KV cache.

Every path that generates (the plain loop, beam search, speculative decoding, a conversation's
turns, parallel samples, the KV comparison, evaluation, the non-finite diagnosis and the serving
scheduler) calls ``run_step``; none calls a model's forward itself (tests/project test this).
Training (kvviz/train.py) calls its model directly: a forward with gradients, not a step.

A step is three moves, in this order, as in vLLM and nano-vllm:
1. **plan**: the cache claims the blocks every token of every sequence in the step will occupy
   (``cache.plan_step``), before any layer runs; a full pool fails here, with nothing written;
2. **forward**: the backend chosen in one place (``backend_forward``): the accelerator (kvviz.fast,
   same maths, flat) or the readable nn.Module; each layer writes its K/V through ``cache.update``;
3. **commit**: ``cache.advance`` moves the cache position (or ``abort_step`` undoes the plan when
   the forward raised), so a failed step leaves the cache as it was.

Sampling stays with the caller: each strategy samples its own way (greedy/top-p, beams, a draft's
verification), from the logits this returns.

The batch is (B, T) ids at positions (T,): B rows in lock-step (one sequence, or B copies of it),
or, for a ragged cache (the serving scheduler's), one row of N tokens whose per-sequence layout
the cache was told before the step (its ``plan_step`` reads it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from kvviz.engine.kvcache.dense import KVCache
    from kvviz.engine.loading.loader import LoadedModel

Backend = Literal["fast", "readable"]


def backend_of(model: "LoadedModel", fast: bool = True) -> Backend:
    """"fast" when the accelerator runs the step (asked for and built for this model), else "readable"."""
    return "fast" if fast and model.fast is not None else "readable"


def backend_forward(model: "LoadedModel", backend: Backend) -> Any:
    """The forward that runs: the accelerator (same signature, same maths) or the readable model."""
    return model.fast.forward if backend == "fast" and model.fast is not None else model.model


def run_step(model: "LoadedModel", cache: "KVCache | None", ids: torch.Tensor, positions: torch.Tensor, *,
             backend: Backend = "fast", capture: Any = None, last_only: bool | torch.Tensor = True,
             commit: bool = True, hash_ids: bool = True) -> torch.Tensor:
    """Plan, forward, commit: logits (B, T|1, V) for ``ids`` (B, T) at ``positions`` (T,).

    ``last_only``: True for the last position's logits, False for every position's, or a (K,) long
    tensor of the positions (indices into T) whose logits to compute: a ragged step needs each
    sequence's last token only (the serving scheduler), never N x V logits.
    ``commit=False`` leaves the planned step uncommitted: the caller advances (or aborts) itself,
    e.g. to look at the logits first.
    ``hash_ids=False`` claims the step's blocks without telling the cache its ids, so a paged cache
    never offers them for prefix reuse: a speculative verify (its drafts are rolled back after the
    commit) and beam search (its rows are reordered after it)."""
    if cache is not None:  # blocks claimed before the forward; no layer allocates
        if hash_ids:
            cache.plan_step(ids)
        else:
            cache.plan_step(ids, hash_ids=False)
    try:
        logits = backend_forward(model, backend)(ids, positions, cache, capture, last_only=last_only)
    except BaseException:
        if cache is not None:
            cache.abort_step()
        raise
    if cache is not None and commit:
        cache.advance(ids.shape[-1])
    return logits


def run_pieces(model: "LoadedModel", cache: "KVCache | None", ids: torch.Tensor, positions: torch.Tensor, *,
               backend: Backend = "fast", capture: Any = None, last_only: bool | torch.Tensor = True) -> torch.Tensor:
    """``run_step`` over ``ids`` (B, T) at ``positions`` (T,), in as many committed steps as the cache
    takes (a full window cache takes one token per forward, ``max_feed``): the earlier pieces'
    logits are never read, the last piece's (with ``capture``) are returned."""
    fed, T = 0, ids.shape[-1]
    while cache is not None and T - fed > (n := cache.max_feed()) >= 1:
        run_step(model, cache, ids.narrow(1, fed, n), positions.narrow(0, fed, n), backend=backend)
        fed += n
    if fed:
        ids, positions = ids.narrow(1, fed, T - fed), positions.narrow(0, fed, T - fed)
    return run_step(model, cache, ids, positions, backend=backend, capture=capture, last_only=last_only)
