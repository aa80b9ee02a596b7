"""Where a forward pass first went non-finite: run only after the logits came out NaN or infinite.

Generation checks its logits every step; this module turns "the logits are NaN" into a sentence a
user can act on ("at step 3, first in layer 2 (transformer.h.2.ln_2)"). It re-runs the readable
model once, on the sequence so far, with a forward hook on every module: one uncached forward
pass, paid only on the failure path.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn

from kvviz.errors import KVVizError


class NonFiniteLogits(KVVizError):
    """The model produced NaN or infinite logits: its weights or its config are broken."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def _kind(t: torch.Tensor) -> str:
    return "NaN" if bool(torch.isnan(t).any()) else "infinite values"


_LAYER = re.compile(r"\.(?:h|layers)\.(\d+)(?:\.|$)")  # GPT-2's transformer.h.N, Llama's model.layers.N


def first_nonfinite_stage(net: nn.Module, ids: list[int]) -> str | None:
    """Where the readable model's output first stops being finite on ``ids``: "layer 2
    (transformer.h.2.ln_2)", "transformer.wte", ...; None if every output is finite.

    A forward hook on every submodule fires when that module returns, so inner modules report
    before the block that holds them and the first record is the innermost first failure. Works
    for any family (GPT-2's ``h.N``, Llama's ``layers.N``).
    """
    bad: list[str] = []
    hooks = []
    for name, module in net.named_modules():
        if not name:
            continue

        def hook(_m: nn.Module, _inp: object, out: object, name: str = name) -> None:
            if not bad and isinstance(out, torch.Tensor) and out.is_floating_point() \
                    and not bool(torch.isfinite(out).all()):
                bad.append(name)
        hooks.append(module.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            dev = next(net.parameters()).device
            block = int(getattr(net.config, "block_size", len(ids)))
            net(torch.tensor([ids[-block:]], dtype=torch.long, device=dev))
    finally:
        for h in hooks:
            h.remove()
    if not bad:
        return None
    m = _LAYER.search(bad[0])
    return f"layer {m.group(1)} ({bad[0]})" if m else bad[0]


def nonfinite_error(gpt: nn.Module, logits: torch.Tensor, ids: list[int], step: int) -> NonFiniteLogits:
    """The error to raise for non-finite ``logits`` at ``step`` (``ids``: row 0's tokens so far)."""
    where = first_nonfinite_stage(gpt, ids)
    at = f", first in {where}" if where else ""
    half = next(gpt.parameters()).dtype in (torch.float16, torch.bfloat16)
    cause = ("fp16/bf16 overflowed (try fp32), or its weights are broken" if half
             else "its weights or its config (layer_norm_epsilon, say) are broken")
    return NonFiniteLogits(f"the model produced {_kind(logits)} at step {step}{at}: {cause}", step)
