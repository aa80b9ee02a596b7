"""The shared model loader: ``get_model`` for a sidebar choice.

``_load`` is ``@st.cache_resource``: one read-only model per (spec, device, dtype, file stamp),
shared by every session. Caches and generators are per run, never on the model.
"""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from kvviz import LoadedModel, load_model
from kvviz.engine.loading.loader import SHAKESPEARE_DIR
from kvviz.fast.heap import freeze_once
from kvviz.ui.state.model_menu import spec_for


def _file_stamp(spec: str) -> float:
    """The weights' modification time, so a retrained or replaced model is loaded afresh."""
    if spec in ("smollm2", "gemma3"):
        return 0.0  # an installed package's file: it changes only with a reinstall (a restart)
    if spec.lower().endswith(".gguf"):
        try:
            return Path(spec).stat().st_mtime
        except OSError:
            return 0.0
    folder = SHAKESPEARE_DIR if spec == "shakespeare" else Path(spec)
    try:
        return (folder / "model.safetensors").stat().st_mtime
    except OSError:
        return 0.0


# Shown by cache_resource only while a model really loads (a cache miss), so a rerun adds nothing
# to the page; one text for every model, since the decorator's text cannot depend on the call.
LOAD_MESSAGE = ("Loading the model, once per server: reading its file (SmolLM2: a 93.8 MiB GGUF file, its 30 "
                "layers dequantized to the chosen dtype), then building its tokenizer. A few seconds.")


@st.cache_resource(max_entries=4, show_spinner=LOAD_MESSAGE)
def _load(spec: str, device: str, dtype: str, stamp: float) -> LoadedModel:
    model = load_model(spec, device=device, dtype=dtype)
    freeze_once()  # torch's heap out of full GC walks; once, before any session holds a stream (kvviz.fast.heap)
    return model


def get_model(choice: str, device: str = "auto", dtype: str = "fp32") -> LoadedModel:
    """The shared, read-only model for a sidebar choice. Raises KVVizError with a message for users."""
    spec = spec_for(choice)
    stamp = 0.0 if spec.startswith("random:") else _file_stamp(spec)
    return _load(spec, device, dtype, stamp)
