"""The matmul of every layer, and how it is spread over the CPU's threads.

A few rows times a weight matrix is bound by streaming the weights from memory, and MKL's GEMM
for a few rows streams on one core at a time. On CPU with s >= 2 intra-op threads and grads
off, the rows go through ``bmm`` over s column blocks of the same storage instead (a strided
view, no copy): each thread streams its share of the weights. (One fp32 row in a decode step
goes to the C kernel of ``kvviz.fast.rowops`` where it can; this is its fallback, and the path of
prefill and batches.)

The split pays most for a few rows and fades as the rows grow, so up to ``MAX_SPLIT_ROWS`` rows
split and more keep the plain GEMM. One thread, training and bf16/fp16 keep it too: the
half-precision GEMM is a different (oneDNN) kernel, which the split made slower.
``docs/performance.md`` has the measurements.
"""
from __future__ import annotations

import torch


def split_blocks(w: torch.Tensor, bias: torch.Tensor | None,
                 threads: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """w (in, out) as ``threads`` column blocks (s, in, out/s) and bias as (s, 1, out/s), both views.

    None when the product should stay a plain GEMM: one thread, a width the threads do
    not divide, a non-CPU or non-fp32 weight, or a weight that is not contiguous.
    """
    n_in, n_out = w.shape
    if not (threads >= 2 and n_out % threads == 0 and w.device.type == "cpu" and w.dtype == torch.float32
            and w.is_contiguous()):
        return None
    blocks = w.view(n_in, threads, n_out // threads).permute(1, 0, 2)  # (s, in, out/s)
    return blocks, None if bias is None else bias.view(threads, 1, n_out // threads)


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
