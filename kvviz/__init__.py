"""kvviz: see how an LLM generates text, and why the KV cache matters.

The public API is imported lazily (PEP 562), so ``import kvviz.memory`` or the calculator page
never pays for importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "kvviz.checkpoints",
    "LoadedModel": "kvviz.checkpoints",
    "KVVizError": "kvviz.errors",
    "Run": "kvviz.events",
    "StepEvent": "kvviz.events",
    "generate": "kvviz.generate",
    "iter_generate": "kvviz.generate",
    "Capture": "kvviz.generate",
    "CAPTURE_ALL": "kvviz.generate",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.checkpoints import LoadedModel, load_model
    from kvviz.errors import KVVizError
    from kvviz.events import Run, StepEvent
    from kvviz.generate import CAPTURE_ALL, Capture, generate, iter_generate


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvviz' has no attribute {name!r}")
