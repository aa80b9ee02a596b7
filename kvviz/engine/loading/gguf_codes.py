"""A GGUF tensor's blocks as int8 codes with an fp32 scale (and offset) per block: ``BlockCodes``.

What ``kvviz.fast.blockdot`` multiplies. Each function below unpacks one ggml type the way
gguf's own dequantizer (``gguf.quants``) does, stopping before the last multiply: the block's
scale (for the K types, the super-block's fp16 scale times the sub-block's integer scale, rounded
to fp32 as gguf rounds it), its offset, and the integer codes. ``scale * code - offset`` in fp32
then gives every weight exactly as ``gguf.quants.dequantize`` does (``tests/engine/
test_gguf_codes.py`` checks each type value for value). Types whose block the kernel does not
read (other sizes, the IQ and ternary types, floats) give None: those weights stay fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # gguf is imported where a file's blocks are unpacked: kvviz.fast imports BlockCodes from
    # here for every model, and only a GGUF load needs the gguf package (engine/loading/loader.py says so)
    from gguf.constants import GGMLQuantizationType as Q

    from kvviz.engine.loading.gguf_lite import LiteTensor

QK_K = 256


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


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) bytes -> (n, 1) fp32, as gguf reads a block's fp16 scale."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Low nibbles of ``width`` bytes, then their high nibbles: (n, 2 * width) uint8 (ggml's order)."""
    qs = qs.reshape(qs.shape[0], -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Bit j of each block's little-endian uint32 ``qh``, for j < n: (blocks, n) uint8."""
    v = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1) >> np.arange(n, dtype=np.uint32).reshape(1, n)
    return (v & np.uint32(1)).astype(np.uint8)


def _legacy(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: one block of 32 -> (codes (n, 32), scale (n, 1), offset or None)."""
    from gguf.constants import GGMLQuantizationType as Q
    d = _f16(blocks[:, :2])
    if qtype == Q.Q8_0:
        return blocks[:, 2:].view(np.int8), d, None
    m = _f16(blocks[:, 2:4]) if qtype in (Q.Q4_1, Q.Q5_1) else None
    rest = blocks[:, 4:] if m is not None else blocks[:, 2:]
    if qtype in (Q.Q4_0, Q.Q4_1):
        q = _nibbles(rest, 16)
    else:  # Q5_0, Q5_1: 32 fifth bits, then the nibbles
        q = _nibbles(rest[:, 4:], 16) | (_high_bits(rest[:, :4], 32) << np.uint8(4))
    if m is None:  # symmetric: codes centred on zero, w = d * code
        return q.astype(np.int8) - np.int8(8 if qtype == Q.Q4_0 else 16), d, None
    return q.astype(np.int8), d, -m  # w = d * code + m = d * code - (-m), rounded alike


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k4(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K, Q5_K: super-blocks of 256 -> 8 sub-blocks of 32, w = (d sc) q - (dmin m)."""
    from gguf.constants import GGMLQuantizationType as Q
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32)).reshape(n * 8, 1)
    offset = (dmin * mn.astype(np.float32)).reshape(n * 8, 1)
    if qtype == Q.Q4_K:
        q = _nibbles(blocks[:, 16:], 32)  # (n, 256): each 32 bytes give 32 low, then 32 high nibbles
    else:
        qh, qs = blocks[:, 16:48], blocks[:, 48:]
        hi = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)  # (n, 8, 32)
        q = _nibbles(qs, 32).reshape(n, 8, 32) | (hi << np.uint8(4))
    return q.reshape(n * 8, 32).astype(np.int8), scale, offset


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Q6_K: super-blocks of 256 -> 16 sub-blocks of 16 with int8 scales, w = (d sc) q."""
    n = blocks.shape[0]
    ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208].view(np.int8), _f16(blocks[:, 208:210])
    scale = (d * sc.astype(np.float32)).reshape(n * 16, 1)
    lo = _nibbles(ql, 64).reshape(n, -1, 32)  # (n, 8, 32)
    hi = ((qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1))
          & np.uint8(3)).reshape(n, -1, 32)
    q = (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q.reshape(n * 16, 16), scale, None


def legacy_types() -> tuple[Q, ...]:
    """The ggml types of one block of 32 with an fp16 scale (and offset): Q4_0 ... Q8_0."""
    from gguf.constants import GGMLQuantizationType as Q

    return (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)


def packed_types() -> tuple[Q, ...]:
    """Every ggml type whose blocks the block kernel reads."""
    from gguf.constants import GGMLQuantizationType as Q

    return (*legacy_types(), Q.Q4_K, Q.Q5_K, Q.Q6_K)


def block_codes(t: LiteTensor) -> BlockCodes | None:
    """A 2-D tensor of a type the block kernel reads, as BlockCodes; None for any other."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    legacy = legacy_types()
    if t.tensor_type not in packed_types() or len(t.shape) != 2:
        return None
    out, n_in = t.shape
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    blocks = np.asarray(t.data).reshape(-1, type_size)  # (out * n_in / block, type_size) uint8
    if t.tensor_type in legacy:
        codes, scale, offset = _legacy(blocks, t.tensor_type)
    elif t.tensor_type == Q.Q6_K:
        codes, scale, offset = _q6_k(blocks)
    else:
        codes, scale, offset = _k4(blocks, t.tensor_type)
    sub = codes.shape[1]  # the block the kernel reads: 32, or Q6_K's 16
    return BlockCodes(torch.from_numpy(np.ascontiguousarray(codes).reshape(out, n_in)),
                      torch.from_numpy(np.ascontiguousarray(scale).reshape(out, n_in // sub)),
                      None if offset is None else torch.from_numpy(np.ascontiguousarray(offset).reshape(out, n_in // sub)),
                      sub)
