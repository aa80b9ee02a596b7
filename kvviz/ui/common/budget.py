"""How much a run's captures weigh, and how to keep a browser session small (no streamlit import).

A run's captures grow with the square of its length (the attention row of step t has t entries,
for every layer and head), so a long run on a big model could hold hundreds of MB. The live page
plans its ``Capture`` with ``plan_capture`` (fewer attention layers when a run would not fit) and
the run store strips the captures of older runs with ``strip_captures`` when the session total
passes ``SESSION_CAPTURE_BUDGET``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvviz import Capture, Run

FP16 = 2  # captures are float16
SESSION_CAPTURE_BUDGET = 160 * 2**20  # capture bytes kept per browser session (the goal is < 200 MB in all)


@dataclass(frozen=True)
class Shape:
    """The model dimensions that size a capture (a GPTConfig has them all)."""

    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int


def attention_row_sum(n_prompt: int, n_new: int) -> int:
    """Sum over steps of the keys the newest query sees: step s sees n_prompt + s keys."""
    return n_new * n_prompt + n_new * (n_new - 1) // 2


def projected_capture_bytes(shape: Shape, n_prompt: int, n_new: int, attention_layers: int | None = None,
                            kv_values: bool = True) -> int:
    """Bytes a run's captures will hold (attention rows + K/V norms + one layer's K/V values)."""
    n_attn = shape.n_layer if attention_layers is None else attention_layers
    columns = n_prompt + n_new - 1  # K/V columns written over the run (the last token is never fed)
    attn = n_attn * shape.n_head * attention_row_sum(n_prompt, n_new) * FP16
    norms = shape.n_layer * 2 * shape.n_kv_head * columns * FP16
    values = 2 * shape.n_kv_head * columns * shape.head_dim * FP16 if kv_values else 0
    return attn + norms + values


def plan_capture(shape: Shape, n_prompt: int, n_new: int, kv_layer: int,
                 budget: int = SESSION_CAPTURE_BUDGET) -> tuple[Capture, str]:
    """The Capture for a live run, and a note when attention had to be limited to fit ``budget``.

    Every layer's attention is captured when it fits; otherwise evenly spaced layers (always the
    first and the last), as many as the budget allows, at least one.
    """
    kv_layer = min(max(kv_layer, 0), shape.n_layer - 1)
    full = projected_capture_bytes(shape, n_prompt, n_new)
    if full <= budget:
        return Capture(attention=True, kv_norms=True, kv_layer=kv_layer), ""
    fixed = projected_capture_bytes(shape, n_prompt, n_new, attention_layers=0)
    per_layer = max(1, shape.n_head * attention_row_sum(n_prompt, n_new) * FP16)
    k = int(max(1, min(shape.n_layer, (budget - fixed) // per_layer)))
    layers = evenly_spaced(shape.n_layer, k)
    note = (f"Attention is captured for {k} of {shape.n_layer} layers ({', '.join(map(str, layers))}) "
            f"so this run's captures stay under {budget / 2**20:.0f} MiB; "
            f"all {shape.n_layer} would take {full / 2**20:.0f} MiB.")
    return Capture(attention=layers, kv_norms=True, kv_layer=kv_layer), note


def evenly_spaced(n: int, k: int) -> tuple[int, ...]:
    """k distinct indices in [0, n), spread evenly and including both ends when k > 1."""
    if k >= n:
        return tuple(range(n))
    if k == 1:
        return (n - 1,)
    return tuple(sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}))


def strip_captures(run: Run) -> Run:
    """The run without its capture arrays: text, timings and bytes stay, replay shows less."""
    events = tuple(dataclasses.replace(e, attn=None, attn_layers=(), kv_norms=None, kv_values=None,
                                       kv_layer=None, logits=None) for e in run.events)
    return dataclasses.replace(run, events=events)
