"""What each new query may see: the one attention mask every model family and the accelerator share.

Causal attention over T new tokens placed after ``start`` cached ones:
- one token (a decode step) sees everything cached, so it needs no mask;
- a plain prefill (nothing cached) is SDPA's own causal path;
- a chunked prefill needs an explicit mask: query i, at position input_pos[i], sees keys 0..input_pos[i].
"""
from __future__ import annotations

import torch


def attention_mask(T: int, start: int, input_pos: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """(mask (T, start + T) or None, is_causal) for ``F.scaled_dot_product_attention``."""
    if T == 1:
        return None, False
    if start == 0:
        return None, True
    keys = torch.arange(start + T, device=input_pos.device)
    return keys[None, :] <= input_pos[:, None], False  # (T, S)
