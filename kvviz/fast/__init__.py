"""The accelerator: the same maths as the readable models, run faster, held beside them.

``build(net)`` returns an accelerator for a loaded (frozen) model, or None for a family it does
not know. ``engine.loaded`` builds one when a model is loaded; the loop uses it only
when asked (``fast=True``, the default), so switching it off runs the readable model alone.
Nothing here is required: without a C compiler the accelerator keeps its PyTorch-op path.
"""
from __future__ import annotations

from typing import Mapping

import torch.nn as nn

from kvviz.engine.models.gemma3 import Gemma3
from kvviz.engine.models.gpt2 import GPT
from kvviz.engine.models.llama import Llama
from kvviz.engine.loading.gguf_codes import BlockCodes
from kvviz.fast.gemma3_flat import FastGemma3
from kvviz.fast.gpt2_flat import FastGPT2
from kvviz.fast.llama_codes import FastLlamaCodes
from kvviz.fast.llama_flat import FastLlama, declines

Accelerator = FastGPT2 | FastLlama | FastLlamaCodes | FastGemma3


def build(net: nn.Module, codes: Mapping[str, BlockCodes] | None = None) -> Accelerator | None:
    """An accelerator for ``net`` (eval mode, grads off), or None where there is none. ``codes``:
    a GGUF's weights as block codes by parameter name (Gemma 3 and the Llama family multiply by them)."""
    if isinstance(net, GPT):
        return FastGPT2(net)
    if isinstance(net, Llama):
        # Kin the fp32 path does not compute exactly (Qwen3's q/k norms, a sliding window) run the
        # readable model there; on block codes every kin runs (its attention is the readable one).
        fp32 = None if declines(net.config) else FastLlama(net)
        return FastLlamaCodes(net, codes, fp32) if codes else fp32
    if isinstance(net, Gemma3):
        return FastGemma3(net, codes)
    return None
