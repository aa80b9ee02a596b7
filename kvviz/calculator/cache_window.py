"""A cache window chosen at run time: every KV layer keeps at most S sink positions plus the last W.

This is what kvviz's own windowed caches do (``--window W --sinks S``, StreamingLLM when S > 0),
applied to any model the calculator sizes. It is a runtime choice, like the KV dtype, so it is a
transformation of the ModelSpec rather than a field of it: each layer that would hold more than
S + W positions becomes a sliding layer of span S + W, and every sum, curve and fit downstream
then counts it without knowing a window was asked for. Layers that already hold fewer (a model's
own shorter sliding windows or chunks) and linear layers (no KV) are left as they are.
"""
from __future__ import annotations

from dataclasses import replace

from kvviz.limits import MAX_SINKS  # the engine's bound too
from kvviz.calculator.spec import MAX_SEQ_LEN, Layer, ModelSpec, is_int


def cache_window_problems(spec: ModelSpec, window: int, sinks: int) -> list[str]:
    """Why this window cannot be applied to ``spec``, as sentences (the engine's rules); empty when it can."""
    out: list[str] = []
    if not is_int(window) or not 1 <= window <= MAX_SEQ_LEN:
        out.append(f"the window must be a positive number of positions (got {window!r})")
        return out
    if not is_int(sinks) or not 0 <= sinks <= MAX_SINKS:
        out.append(f"sinks must be 0..{MAX_SINKS} positions (got {sinks!r})")
    elif sinks >= window:
        out.append(f"sinks ({sinks}) must be fewer than the window ({window}): StreamingLLM keeps a few sink "
                   "positions (4) beside a much longer recent window")
    if spec.max_positions is not None and window > spec.max_positions:
        out.append(f"a window of {window:,} positions is larger than the model's context of "
                   f"{spec.max_positions:,}: nothing would ever be evicted; choose at most {spec.max_positions:,}")
    return out


def with_cache_window(spec: ModelSpec, window: int, sinks: int = 0) -> ModelSpec:
    """``spec`` with every KV layer capped at ``sinks + window`` positions (see the module doc).

    Call ``cache_window_problems`` first; this assumes a valid window.
    """
    span = sinks + window
    capped = Layer("sliding", span, sinks)
    layers = tuple(capped if layer.has_kv and (not layer.caps or (layer.span or 0) > span) else layer
                   for layer in (spec.layers or (Layer("full"),) * spec.n_layers))
    what = f"{window:,} + {sinks:,} sinks" if sinks else f"{window:,}"
    note = (f"cache window {what}: every KV layer keeps at most {span:,} positions "
            "(layers that already keep fewer are unchanged)")
    return replace(spec, layers=layers, notes=(*spec.notes, note))
