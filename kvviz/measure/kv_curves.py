"""Perplexity by position through full, windowed and StreamingLLM caches, and per KV dtype.

Slow on a small CPU (one token per forward once a window is full), so the page shows a file
this writes (``python -m kvviz kv-curves --out assets/kv_curves_smollm2.json``) and re-measures a
short version on demand. Held-out text: the tail of the shipped Tiny Shakespeare corpus.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

from kvviz.engine.generation.request import kv_spec
from kvviz.engine.generation.kv_spec import rotates_keys
from kvviz.engine.loading.loader import SHAKESPEARE_CORPUS, LoadedModel
from kvviz.errors import KVVizError
from kvviz.measure.kvcompare import by_position, compare, nll_through_cache
from kvviz.safeio import read_maybe_gzip

TAIL_BYTES = 40_000  # the corpus tail the text is taken from (the model never trained on it: SmolLM2)
MAX_CURVE_TOKENS = 4096


def heldout_ids(model: LoadedModel, tokens: int) -> list[int]:
    """The first ``tokens`` tokens of the corpus's last TAIL_BYTES bytes."""
    data = read_maybe_gzip(SHAKESPEARE_CORPUS, 10_000_000, "the Tiny Shakespeare corpus")
    text = data[-TAIL_BYTES:].decode("utf-8", errors="ignore")
    ids = model.tokenizer.encode(text)[:tokens]
    if len(ids) < tokens:
        raise KVVizError(f"the corpus tail has only {len(ids)} tokens (asked for {tokens})")
    return ids


def measure(model: LoadedModel, tokens: int = 1024, window: int = 128, sinks: int = 4, bins: int = 16,
            dtypes: tuple[str, ...] = ("int8", "int4", "fp8"), chunk: int = 64,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every curve and figure the compression page shows, as plain JSON-able data."""
    if not 2 <= tokens <= min(MAX_CURVE_TOKENS, model.config.block_size):
        raise KVVizError(f"tokens must be 2..{min(MAX_CURVE_TOKENS, model.config.block_size)} (got {tokens})")
    say = progress or (lambda s: None)
    ids = heldout_ids(model, tokens)
    rope = rotates_keys(getattr(model.config, "model_type", "gpt2"))
    caches: list[tuple[str, Any]] = [("full", None), (f"window {window}", kv_spec(model, window=window))]
    if sinks:
        caches.append((f"{sinks} sinks + window {window}", kv_spec(model, window=window, sinks=sinks)))
        if rope:
            caches.append((f"{sinks} sinks + window {window}, original positions",
                           kv_spec(model, window=window, sinks=sinks, positions="original")))
    out: dict[str, Any] = {"model": model.name, "tokens": tokens, "window": window, "sinks": sinks, "bins": bins,
                           "text": "the last 40 kB of Tiny Shakespeare", "curves": {}, "by_position": {},
                           "perplexity": {}, "seconds": {}}
    for name, spec in caches:
        say(f"{name}: teacher-forcing {tokens} tokens")
        t0 = time.perf_counter()
        nll, _ = nll_through_cache(model, ids, spec, chunk=chunk)
        out["seconds"][name] = round(time.perf_counter() - t0, 1)
        out["curves"][name] = [round(x, 4) for x in nll]
        out["by_position"][name] = by_position(nll, bins)
        out["perplexity"][name] = math.exp(sum(nll) / len(nll))
    out["kv_dtypes"] = {}
    for dt in dtypes:
        say(f"{dt}: teacher-forcing {tokens} tokens beside full precision")
        out["kv_dtypes"][dt] = compare(model, ids, kv_spec(model, dt, track_errors=True), chunk=chunk).summary()
    return out
