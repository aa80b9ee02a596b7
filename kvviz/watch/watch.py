"""Read a running server once: its /metrics, the model it serves (/v1/models) and, for llama.cpp, its
slots (/slots); then kvviz's figures beside them. The CLI's ``watch`` and the Live server page share it.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvviz.calculator.spec import ModelSpec
from kvviz.watch.scrape import DEFAULT_TIMEOUT_S, ScrapeError, Target, fetch_json, fetch_text
from kvviz.watch.server_calc import ServerCalc, match_preset, server_calc
from kvviz.watch.server_metrics import Reading, read_metrics


@dataclass(frozen=True)
class Snapshot:
    """One reading, when it was taken (monotonic seconds) and kvviz's figures for it."""

    reading: Reading
    at: float
    calc: ServerCalc
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The ``watch --once --json`` object (keys named in the issue and docs/usage.md)."""
        r = self.reading
        out = {"engine": r.engine, "model": r.model, "kv_cache_usage": r.kv_cache_usage,
               "requests_running": r.requests_running, "requests_waiting": r.requests_waiting,
               "prefix_cache_queries": r.prefix_cache_queries, "prefix_cache_hits": r.prefix_cache_hits,
               "preemptions": r.preemptions, "generation_tokens": r.generation_tokens, "block_size": r.block_size,
               "calculator": {"kv_cache_tokens": self.calc.kv_cache_tokens,
                              "max_concurrency": self.calc.max_concurrency}}
        out["details"] = {**r.to_dict(), "calculator": self.calc.to_dict(), "notes": list(self.notes)}
        return out


def read_server(target: Target, presets: Mapping[str, ModelSpec], spec: ModelSpec | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, kv_dtype: str | None = None, device: str = "cuda") -> Snapshot:
    """One Snapshot, or a ScrapeError when /metrics cannot be read. /v1/models and /slots are optional:
    a server without them still gives its metrics (a note says what was missing)."""
    text = fetch_text(target, "/metrics", timeout_s)
    at = time.monotonic()
    notes: list[str] = []
    models = slots = None
    try:
        models = fetch_json(target, "/v1/models", timeout_s)
    except ScrapeError as e:
        notes.append(f"no model name: {e}")
    reading = read_metrics(text, models)
    if reading.engine == "llama.cpp":
        try:
            slots = fetch_json(target, "/slots", timeout_s)
            reading = read_metrics(text, models, slots)
        except ScrapeError as e:
            notes.append(f"no slots: {e}")
    chosen = spec or match_preset(reading.model, presets)
    return Snapshot(reading, at, server_calc(reading, chosen, kv_dtype, device), tuple(notes))
