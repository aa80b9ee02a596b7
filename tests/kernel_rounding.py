"""The block kernel's maths on a readable model (issue 42): csrc/lblocks.c rounds each matmul's input
rows to int16 per block of 32; ``kernel_rounding`` makes a model's coded nn.Linear layers compute the
same, so tests can measure what that rounding does to a model's logits. test_gguf_codes.py holds
the kernel itself to the spec, call by call.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping

import numpy as np
import torch

from kvviz.engine.loading.gguf_codes import BlockCodes


def round_like_the_kernel(x: torch.Tensor) -> torch.Tensor:
    """(..., n) fp32 rows -> the rounded rows q * dx in float64 (exact), by the spec round_rows follows."""
    n = x.shape[-1]
    rows = x.detach().reshape(-1, n).float()
    nq = -(-n // 32)
    xb = torch.nn.functional.pad(rows, (0, nq * 32 - n)).view(-1, nq, 32)
    dx = (xb.abs().amax(-1) / 32767).double().unsqueeze(-1)  # the fp32 division, then widened
    q = torch.round(xb.double() / dx).nan_to_num(0.0).clamp(-32767, 32767)  # half to even, as np.rint
    return (q * dx).view(-1, nq * 32)[:, :n].reshape(x.shape)


@contextmanager
def kernel_rounding(root: torch.nn.Module, codes: Mapping[str, BlockCodes]) -> Iterator[None]:
    """While inside, every nn.Linear of ``root`` whose weight has block codes computes what the kernel
    computes: W xhat + M (xhat - x) + b in float64, xhat its input rounded as the kernel rounds it and
    M the codes' offsets (the kernel multiplies them by the unrounded input's sums), then fp32. A
    readable model (or transformers') under it differs from the kernels only by fp32's order of
    additions and by an input that rounds to the other neighbour where the two paths' fp32 inputs
    differ. ``codes``: by transformers' parameter names; a tied head's key is the embedding's."""
    handles = []
    for name, c in codes.items():
        mod = root.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(mod, torch.nn.Embedding):  # tied: the head multiplies by the embedding's codes
            mod = getattr(root, "lm_head", None)
        if not isinstance(mod, torch.nn.Linear) or not torch.equal(mod.weight.detach(), c.weight()):
            continue  # no such layer, or codes that no longer rebuild it (the kernels skip those too)
        minv = c.scales()[1]
        mw = None if minv is None else minv.double().repeat_interleave(c.block, dim=1)

        def hook(m: torch.nn.Linear, args: tuple[torch.Tensor, ...], out: torch.Tensor,
                 mw: torch.Tensor | None = mw) -> torch.Tensor:
            x = args[0].double()
            xh = round_like_the_kernel(args[0])
            y = xh @ m.weight.double().T
            if mw is not None:
                y = y + (xh - x) @ mw.T
            if m.bias is not None:
                y = y + m.bias.double()
            return y.to(out.dtype)

        handles.append(mod.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def assert_records_close(x: np.ndarray, y: np.ndarray, field: str) -> None:
    """Two float16 capture records of the same values: within 2e-3, plus one float16 step of the value
    (2^-10 of it at most), as the step's logits moving by 1e-5 can round a record to its neighbour."""
    a, b = x.astype("float64"), y.astype("float64")
    assert (abs(a - b) <= 2e-3 + abs(b) * 2.0 ** -10).all(), field
