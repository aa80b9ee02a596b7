"""Every loader's last check on the values it read: no NaN or infinite weight.

A damaged file (a flipped exponent in a safetensors tensor, a NaN scale in a GGUF block) loads
without complaint and then poisons every output, or worse, hides in a head whose NaN scores the
attention kernel drops: the text comes out, and it is wrong. So each loader refuses it here, naming
the tensor and the counts, before a model is built.
"""
from __future__ import annotations

from typing import Mapping

import torch

from kvviz.errors import KVVizError


def check_finite(sd: Mapping[str, torch.Tensor], where: str) -> None:
    """KVVizError naming the first tensor of ``sd`` that holds a NaN or infinite value (``where``:
    the file, as the message names it)."""
    for k, t in sd.items():
        if not bool(torch.isfinite(t).all()):
            n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise KVVizError(f"{where} is damaged: {k} holds {n_nan:,} NaN and {n_inf:,} infinite values, "
                             "so every output would be NaN")
