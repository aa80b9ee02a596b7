"""What each new query may see: the one attention mask every model family and the accelerator share.

Causal attention over T new tokens placed after ``start`` cached ones:
- one token (a decode step) sees everything cached, so it needs no mask;
- a plain prefill (nothing cached) is SDPA's own causal path;
- a chunked prefill needs an explicit mask: query i, at position input_pos[i], sees keys 0..input_pos[i].

A sliding window of W (Mistral) also hides every key more than W - 1 positions behind its query
(key j is seen by query i when i - W < j <= i, as transformers' and llama.cpp's masks do). While
all keys lie within the window the plain rules above hold, so short runs take SDPA's fast paths.
"""
from __future__ import annotations

import torch


def attention_mask(T: int, start: int, input_pos: torch.Tensor,
                   window: int | None = None) -> tuple[torch.Tensor | None, bool]:
    """(mask (T, start + T) or None, is_causal) for ``F.scaled_dot_product_attention``; ``window``:
    each query sees its last ``window`` positions only (keys are positions 0..start+T-1)."""
    if window is not None and start + T > window:
        keys = torch.arange(start + T, device=input_pos.device)
        pos = input_pos[:, None]  # (T, 1)
        return (keys[None, :] <= pos) & (keys[None, :] > pos - window), False  # (T, S)
    if T == 1:
        return None, False
    if start == 0:
        return None, True
    keys = torch.arange(start + T, device=input_pos.device)
    return keys[None, :] <= input_pos[:, None], False  # (T, S)
