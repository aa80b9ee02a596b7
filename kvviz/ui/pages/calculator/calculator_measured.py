"""The calculator page's only contact with the engine (which imports torch; kvviz.calculator may not):
kvviz's own model shapes for the presets, and the bytes its live caches really allocate, so the
page can put the calculator's figure next to a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvviz.calculator import BUILTIN_PREFIX

SHAPES_SOURCE = "kvviz/engine/loading/loader.py RANDOM_SHAPES"


@dataclass(frozen=True)
class Measured:
    """One cache kind: what it holds and the bytes its tensors hold (``nbytes``, on the meta device)."""

    kind: str  # "static" or "concat"
    tokens: int  # positions its buffers hold
    bytes_allocated: int


SMOLLM2_PRESET = "smollm2-135m"  # the published preset whose model kvviz also runs (from its GGUF file)


def measure_caches(preset_key: str, kv_dtype: str, batch: int, seq_len: int) -> list[Measured] | None:
    """Build each engine cache for a model kvviz runs and read its bytes; None when kvviz does not
    run this model or cannot cache this dtype. Meta tensors: exact nbytes, nothing allocated.

    SmolLM2's config comes from its installed GGUF file's own metadata (the engine's reader), not
    from the preset, so the two sides are computed from independent sources."""
    if not (preset_key.startswith(BUILTIN_PREFIX) or preset_key == SMOLLM2_PRESET):
        return None
    import torch

    from kvviz.engine.kvcache.dense import CACHE_KINDS
    from kvviz.engine.loading.loader import SHAKESPEARE_DIR, DTYPES, RANDOM_SHAPES, config_from_json, read_config

    if kv_dtype not in DTYPES:
        return None
    name = preset_key.removeprefix(BUILTIN_PREFIX)
    if preset_key == SMOLLM2_PRESET:
        cfg = _smollm2_config()
        if cfg is None:
            return None
    elif name == "shakespeare":
        cfg = config_from_json(read_config(SHAKESPEARE_DIR))[0]
    elif name.startswith("random:") and name.removeprefix("random:") in RANDOM_SHAPES:
        cfg = RANDOM_SHAPES[name.removeprefix("random:")]
    else:
        return None
    dtype, t = DTYPES[kv_dtype], min(seq_len, cfg.block_size)
    out = []
    for kind, cls in CACHE_KINDS.items():
        cache = cls(cfg, batch=batch, device="meta", dtype=dtype)
        if kind != "static":  # a growing cache holds what was written: write t tokens into every layer
            # No model runs here (meta tensors, no weights): the K/V a forward would write, written
            # through the cache's step contract (plan, every layer's update, commit) as a step's layers write them.
            # Not run_step: a forward needs the model built on the meta device each rerun, seconds for
            # what a model adds nothing to (docs/ARCHITECTURE.md, engine/core).
            kv = torch.empty((batch, cfg.kv_heads, t, cfg.head_dim), device="meta", dtype=dtype)
            cache.plan_step(torch.zeros((batch, t), dtype=torch.long, device="meta"))
            for i in range(cfg.n_layer):
                cache.update(i, kv, kv)
            cache.advance(t)
        out.append(Measured(kind, cfg.block_size if kind == "static" else t, cache.bytes_allocated))
    return out


@lru_cache(maxsize=1)  # the page reruns on every widget change; the installed file does not change
def _smollm2_config():  # type: ignore[no-untyped-def]
    """The installed SmolLM2 GGUF file's config (its header only: the reader maps the file, no
    tensor is dequantized), or None when the package is missing or the file unreadable."""
    from kvviz.engine.loading.gguf_lite import read_gguf
    from kvviz.engine.loading.gguf_llama import config_from_metadata
    from kvviz.engine.loading.llama_loader import smollm2_path
    from kvviz.errors import KVVizError

    try:
        return config_from_metadata(read_gguf(smollm2_path()))
    except (KVVizError, OSError, ValueError):
        return None
