"""Where a forward pass first went non-finite: run only after the logits came out NaN or infinite.

Generation checks its logits every step; this module turns "the logits are NaN" into a sentence a
user can act on ("at step 3, first in layer 2 (transformer.h.2.ln_2)"). The stream re-runs the
readable model once, on the sequence so far, through the step driver (``run_step`` with no cache:
one uncached forward, paid only on the failure path) inside ``first_nonfinite``, which hooks every
module. This module runs no forward itself: it sits below the step driver (floor 1).
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

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


@contextmanager
def first_nonfinite(net: nn.Module) -> Iterator[list[str]]:
    """Hooks on every submodule of the readable model ``net`` while the block runs its forward; the
    list it yields then holds the first module whose output was not finite (empty if none was).

    A forward hook fires when its module returns, so inner modules report before the block that
    holds them and the first record is the innermost first failure. Works for any family
    (GPT-2's ``h.N``, Llama's and Gemma 3's ``layers.N``)."""
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
        yield bad
    finally:
        for h in hooks:
            h.remove()


def stage_name(bad: list[str]) -> str | None:
    """"layer 2 (transformer.h.2.ln_2)", "transformer.wte", ... for ``first_nonfinite``'s list; None if empty."""
    if not bad:
        return None
    m = _LAYER.search(bad[0])
    return f"layer {m.group(1)} ({bad[0]})" if m else bad[0]


def nonfinite_error(gpt: nn.Module, logits: torch.Tensor, where: str | None, step: int) -> NonFiniteLogits:
    """The error to raise for non-finite ``logits`` at ``step``; ``where`` is ``stage_name``'s answer."""
    at = f", first in {where}" if where else ""
    half = next(gpt.parameters()).dtype in (torch.float16, torch.bfloat16)
    cause = ("fp16/bf16 overflowed (try fp32), or its weights are broken" if half
             else "its weights or its config (layer_norm_epsilon, say) are broken")
    return NonFiniteLogits(f"the model produced {_kind(logits)} at step {step}{at}: {cause}", step)
