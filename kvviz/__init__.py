"""kvviz: see how an LLM generates text, and why the KV cache matters.

The API is imported eagerly on purpose: `kvviz.engine.generate` must stay the function even after the
submodule of the same name is imported (a lazy `__getattr__` would let the submodule win).
"""
from kvviz.engine.load import LoadedModel, load_model
from kvviz.errors import KVVizError
from kvviz.engine.events import Run, StepEvent
from kvviz.engine.capture import CAPTURE_ALL, Capture
from kvviz.engine.generate import generate, iter_generate

__all__ = ["CAPTURE_ALL", "Capture", "KVVizError", "LoadedModel", "Run", "StepEvent", "generate",
           "iter_generate", "load_model"]
__version__ = "0.1.0"
