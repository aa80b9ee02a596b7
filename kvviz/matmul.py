"""The matmul of every layer, and how it is spread over the CPU's threads.

A decode step multiplies ONE row by every weight matrix, so it is bound by streaming the
weights from memory, and MKL's one-row GEMV streams on one core at a time. On CPU with s >= 2
intra-op threads and grads off, the rows go through ``bmm`` over s column blocks of the same
storage instead (a strided view, no copy): each thread streams its share of the weights.
Measured on tiny (2-core EPYC, fp32): 1.2 vs 1.8 ms per decode step.

Small batches of rows gain as well, since MKL's GEMM for a few rows streams the weights little
better. Split against plain, 2 threads: tiny's 17 matmuls of a step, median of 12 interleaved
repeats, 1.1-1.2x for 2 to 64 rows, 1.06x at 128 and none at 256-512; gpt2-small's shapes
1.7-1.8x for 2-8 rows, 1.24x at 32, 1.02x at 128. So up to 64 rows split (MAX_SPLIT_ROWS),
more keep the plain GEMM. One thread, training and bf16/fp16 keep it too: the half-precision
GEMM is a different, oneDNN kernel, which the split made slower (329 vs 455 tok/s in bf16).
"""
from __future__ import annotations

import torch


def _splittable(w: torch.Tensor, width: int, threads: int) -> bool:
    """Whether w can be cut into ``threads`` blocks along a dimension of ``width``: 2+ threads that
    divide it, and a contiguous fp32 weight on the CPU."""
    return (threads >= 2 and width % threads == 0 and w.device.type == "cpu" and w.dtype == torch.float32
            and w.is_contiguous())


def split_blocks(w: torch.Tensor, bias: torch.Tensor | None,
                 threads: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """w (in, out) as ``threads`` column blocks (s, in, out/s) and bias as (s, 1, out/s), both views.

    None when a one-row product should stay a plain GEMM: one thread, a width the threads do
    not divide, a non-CPU or non-fp32 weight, or a weight that is not contiguous.
    """
    n_in, n_out = w.shape
    if not _splittable(w, n_out, threads):
        return None
    blocks = w.view(n_in, threads, n_out // threads).permute(1, 0, 2)  # (s, in, out/s)
    return blocks, None if bias is None else bias.view(threads, 1, n_out // threads)


def split_rows(w: torch.Tensor, bias: torch.Tensor | None,
               threads: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """w (in, out) as ``threads`` row blocks (s, in/s, out), a view, and the bias as the
    accumulator of the s partial products: (s, 1, out), the bias in block 0 and zeros elsewhere,
    so that their sum is x @ w + bias. None in the cases ``split_blocks`` lists.

    The input of a row split is the row cut in s pieces (s, 1, in/s): the output of a column
    split, so two splits chain without reassembling the row (see kvviz.decode).
    """
    n_in, n_out = w.shape
    if not _splittable(w, n_in, threads):
        return None
    acc = None
    if bias is not None:
        acc = torch.zeros(threads, 1, n_out, dtype=bias.dtype, device=bias.device)  # (s, 1, out)
        acc[0, 0] = bias
    return w.view(threads, n_in // threads, n_out), acc  # (s, in/s, out)


MAX_SPLIT_ROWS = 64  # the most rows that gained through the split on both shapes (module doc)


def row_matmul(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x2 @ w (+ bias)`` for x2 (M, in) and w (in, out), split over the threads when it pays."""
    M = x2.shape[0]
    if M <= MAX_SPLIT_ROWS and not torch.is_grad_enabled():
        split = split_blocks(w, bias, torch.get_num_threads())
        if split is not None:
            blocks, bias_blocks = split
            s, n_in, n = blocks.shape
            rows = x2.expand(s, M, n_in)  # (s, M, in), no copy
            if bias_blocks is None:
                y = torch.bmm(rows, blocks)  # (s, M, out/s)
            else:  # the bias rides along as the accumulator: one op fewer per matmul
                y = torch.baddbmm(bias_blocks, rows, blocks)  # (s, M, out/s)
            # One row: the blocks are the output's columns, in order. Several: interleave them.
            return y.view(1, s * n) if M == 1 else y.transpose(0, 1).reshape(M, s * n)  # (M, out)
    return x2 @ w if bias is None else torch.addmm(bias, x2, w)
