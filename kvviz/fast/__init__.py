"""The accelerator: the same maths as the readable models, run faster, held beside them.

``build(net)`` returns an accelerator for a loaded (frozen) model, or None for a family it does
not know. ``engine.loading.loader`` builds one when a model is loaded; the loop uses it only
when asked (``fast=True``, the default), so switching it off runs the readable model alone.
Nothing here is required: without a C compiler the accelerator keeps its PyTorch-op path.
"""
from __future__ import annotations

import torch.nn as nn

from kvviz.engine.models.gpt2 import GPT
from kvviz.engine.models.llama import Llama
from kvviz.fast.gpt2_flat import FastGPT2
from kvviz.fast.llama_flat import FastLlama, declines


def build(net: nn.Module) -> FastGPT2 | FastLlama | None:
    """An accelerator for ``net`` (eval mode, grads off), or None where there is none."""
    if isinstance(net, GPT):
        return FastGPT2(net)
    if isinstance(net, Llama):
        # Kin it does not compute exactly (Qwen3's q/k norms, a sliding window) run the readable model.
        return None if declines(net.config) else FastLlama(net)
    return None
