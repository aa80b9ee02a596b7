"""Matmuls over weights kept as a GGUF file keeps them: int8 codes with a scale per block.

``BlockCodes`` is one weight matrix in that form, ``w[r, i] = scale[r, i // block] * codes[r, i]
- minv[r, i // block]``, each value exactly what gguf's dequantizer gives for it
(``engine/loading/gguf_codes.py`` builds them from the file's blocks). ``BlockDot`` multiplies a
few fp32 rows by one or more of them side by side, through ``csrc/blockdot.c``: a decode step of a
quantized model then streams about a quarter of the bytes of its fp32 weights (Gemma 3 270M:
the Q8_0 head is 180 MiB of codes and scales where its fp32 copy is 640 MiB). The activations
stay fp32; only the order of additions differs from ``F.linear`` on the dequantized weights.

``BlockCodes.weight()`` rebuilds the fp32 matrix (tests hold it equal to the model's parameter);
``BlockCodes.rows(x)`` is the same product through PyTorch, for a machine without the kernel.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from kvviz.fast.rowops import load

MAX_SEGMENTS = 3  # matrices side by side in one call (q, k and v)
BLOCKS = (16, 32)  # the block sizes the kernel reads: Q6_K's scales cover 16 weights, the rest 32


@dataclass(frozen=True)
class BlockCodes:
    """One (out, in) weight as int8 codes with an fp32 scale, and optionally an offset, per block."""

    codes: torch.Tensor  # (out, in) int8
    scale: torch.Tensor  # (out, in // block) fp32
    minv: torch.Tensor | None  # (out, in // block) fp32, or None: no offsets
    block: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + (self.minv.nbytes if self.minv is not None else 0)

    def weight(self) -> torch.Tensor:
        """The fp32 (out, in) matrix, each value computed as gguf's dequantizer computes it:
        scale * code rounded, then the offset subtracted and rounded."""
        out, n_in = self.shape
        w = self.codes.view(out, -1, self.block).float() * self.scale.unsqueeze(-1)  # (out, nb, block)
        if self.minv is not None:
            w = w - self.minv.unsqueeze(-1)
        return w.reshape(out, n_in)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) @ W^T through PyTorch on the rebuilt weight: the kernel's maths, slowly."""
        return torch.nn.functional.linear(x, self.weight())


class _Spec(ctypes.Structure):
    """Mirror of ``kv_blocks`` in blockdot.c (its size is checked against the library's)."""

    _fields_ = [("codes", ctypes.c_void_p * MAX_SEGMENTS), ("scale", ctypes.c_void_p * MAX_SEGMENTS),
                ("minv", ctypes.c_void_p * MAX_SEGMENTS), ("n_out", ctypes.c_int * MAX_SEGMENTS),
                ("block", ctypes.c_int * MAX_SEGMENTS), ("n_seg", ctypes.c_int), ("n_in", ctypes.c_int)]


def _fn() -> "ctypes._CFuncPtr | None":  # type: ignore[name-defined]
    lib = load()
    if lib is None or lib.kv_blocks_struct_size() != ctypes.sizeof(_Spec) or lib.kv_blocks_max_seg() != MAX_SEGMENTS:
        return None
    fn = lib.kv_block_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return fn


@dataclass(frozen=True)
class BlockDot:
    """``x @ W^T`` for a few fp32 rows, the weights ``BlockCodes`` side by side; build with ``block_dot``."""

    spec: _Spec
    spec_addr: int
    n_in: int
    n_out: int
    threads: int
    fn: "ctypes._CFuncPtr"  # type: ignore[name-defined]
    keep: tuple[BlockCodes, ...]  # the tensors the spec points into

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: m rows of n_in contiguous fp32 values (any shape). Returns (m, n_out) fp32."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()  # the C side reads raw fp32 rows
        m = x.numel() // self.n_in
        y = torch.empty(m, self.n_out, dtype=torch.float32)
        if self.fn(self.spec_addr, x.data_ptr(), m, y.data_ptr(), self.threads):
            raise MemoryError(f"blockdot: no memory for the block sums of {m} rows")
        return y


def _fits(w: BlockCodes) -> bool:
    out, n_in = w.shape
    nb = n_in // w.block if w.block else 0
    ok = w.block in BLOCKS and n_in % w.block == 0 and w.codes.dtype == torch.int8 and w.codes.is_contiguous()
    for t in (w.scale, w.minv):
        if t is not None:
            ok = ok and t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == (out, nb)
    return ok and all(t.device.type == "cpu" for t in (w.codes, w.scale))


def block_dot(ws: Sequence[BlockCodes], threads: int) -> BlockDot | None:
    """A BlockDot over ``ws`` (same input width), or None when the kernel is missing or a weight
    does not fit (another block size, not CPU, not contiguous)."""
    fn = _fn()
    ws = list(ws)
    if fn is None or not 1 <= len(ws) <= MAX_SEGMENTS or not all(_fits(w) for w in ws):
        return None
    n_in = ws[0].shape[1]
    if any(w.shape[1] != n_in for w in ws):
        return None
    pad = [None] * (MAX_SEGMENTS - len(ws))
    ints = [0] * (MAX_SEGMENTS - len(ws))
    spec = _Spec((ctypes.c_void_p * MAX_SEGMENTS)(*[w.codes.data_ptr() for w in ws], *pad),
                 (ctypes.c_void_p * MAX_SEGMENTS)(*[w.scale.data_ptr() for w in ws], *pad),
                 (ctypes.c_void_p * MAX_SEGMENTS)(*[None if w.minv is None else w.minv.data_ptr() for w in ws], *pad),
                 (ctypes.c_int * MAX_SEGMENTS)(*[w.shape[0] for w in ws], *ints),
                 (ctypes.c_int * MAX_SEGMENTS)(*[w.block for w in ws], *ints), len(ws), n_in)
    return BlockDot(spec, ctypes.addressof(spec), n_in, sum(w.shape[0] for w in ws), max(1, threads), fn, tuple(ws))
