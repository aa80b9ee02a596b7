"""kvviz: see how an LLM generates text, and why the KV cache matters.

The public API is resolved on first use, so ``import kvviz.calculator`` (the calculator, pure
Python) never imports torch. That is safe because no submodule shares an API name: the
generation API lives in ``kvviz.engine.api``, so ``kvviz.generate`` is always the function
(tests/engine/test_generate.py holds that).
"""
from __future__ import annotations

import importlib
from typing import Any

_API: dict[str, str] = {
    "load_model": "kvviz.engine.loaded",
    "LoadedModel": "kvviz.engine.loading.loader",
    "KVVizError": "kvviz.errors",
    "Run": "kvviz.engine.generation.events",
    "StepEvent": "kvviz.engine.generation.events",
    "Capture": "kvviz.engine.generation.capture",
    "CAPTURE_ALL": "kvviz.engine.generation.capture",
    "generate": "kvviz.engine.api",
    "iter_generate": "kvviz.engine.api",
    "SamplingParams": "kvviz.engine.generation.sampling",
    "CacheSpec": "kvviz.engine.generation.valid_request",
    "Beam": "kvviz.engine.generation.valid_request",
    "Speculative": "kvviz.engine.generation.valid_request",
}

__all__ = sorted(_API)
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'kvviz' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once; later lookups never reach __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
