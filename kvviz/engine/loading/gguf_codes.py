"""A GGUF tensor's blocks as integer codes with a scale (and offset) per block: ``BlockCodes``.

What ``kvviz.fast.blockdot`` multiplies. Each function below unpacks one ggml type the way
gguf's own dequantizer (``gguf.quants``) does, stopping before the last multiply: the block's
scale (for the K types, the super-block's fp16 scale times the sub-block's integer scale, rounded
to fp32 as gguf rounds it), its offset, and the integer codes. ``scale * code - offset`` in fp32
then gives every weight exactly as ``gguf.quants.dequantize`` does (``tests/engine/
test_gguf_codes.py`` checks each type value for value). Types whose block the kernel does not
read (other sizes, the IQ and ternary types, floats) give None: those weights stay fp32.

Every type streams the file's own bytes (issue 42; the layouts in ``BlockCodes``): Q4_0, Q4_1,
Q5_0 and Q5_1 blocks are the file's bytes less their fp16 scale and offset, which stay fp16; Q8_0
keeps its int8 codes and fp16 scale; Q4_K, Q5_K and Q6_K keep their super-blocks of 256 as stored
(fp16 d and dmin, the sub-blocks' 6-bit or int8 scales, then the codes), so a step reads what
llama.cpp reads: Q4_K 0.5625 bytes a weight, Q5_K 0.6875, Q6_K 0.8203125.
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
PACKED_BLOCK_BYTES = {4: 16, 5: 20}  # bytes of one packed block of 32 codes, by bits
K_BLOCK_BYTES = {4: 144, 5: 176, 6: 210}  # bytes of one K super-block of 256 weights (Q4_K, Q5_K, Q6_K), by bits


@dataclass(frozen=True)
class BlockCodes:
    """One (out, in) weight as integer codes with a scale, and optionally an offset, per block.

    The codes are one int8 a weight (``bits`` 8: Q8_0, Q6_K), or packed as the file packs them
    (issue 42): ``bits`` 4, two codes a byte, 16 bytes a block of 32, byte k holding code k (low
    nibble) and code k + 16 (high) (Q4_0, Q4_1, Q4_K); ``bits`` 5, those nibbles after a
    little-endian uint32 whose bit k is code k's fifth bit, 20 bytes a block (Q5_0, Q5_1).
    ``zero`` is subtracted from each unpacked code (Q4_0's 8, Q5_0's 16). The legacy types' scales
    and offsets are the file's fp16 values (exact).

    With ``superblock`` the codes are a K type's super-blocks of 256 weights exactly as ggml stores
    them (``bits`` 4: Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins,
    128 of nibbles; 5: Q5_K, 176 bytes: the same with 32 bytes of fifth bits before the nibbles;
    6: Q6_K, 210 bytes: 128 of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d), and
    ``scale`` and ``minv`` are None: a sub-block's scale is d * its 6-bit (int8) scale and its
    offset dmin * its 6-bit min, products that fp32 holds exactly, so the kernel forms them in
    registers as ``scales()`` forms them here (``block``: the sub-block, 32, or Q6_K's 16)."""

    codes: torch.Tensor  # bits 8: (out, in) int8; 4|5: (out, in // 32 * 16|20) uint8, packed;
    # superblock: (out, in // 256 * 144|176|210) uint8, the file's super-blocks
    scale: torch.Tensor | None  # (out, in // block) fp32, or fp16 (the legacy types' own d: exact); None: superblock
    minv: torch.Tensor | None  # (out, in // block), scale's dtype, or None: no offsets (or superblock)
    block: int
    bits: int = 8  # 8: one int8 code a weight; 4 or 5: packed; with superblock 4|5|6 (the docstring)
    zero: int = 0  # subtracted from each unpacked 4/5-bit code
    superblock: bool = False  # the codes are K super-blocks as the file stores them

    @property
    def shape(self) -> tuple[int, int]:
        n = int(self.codes.shape[1])
        if self.superblock:
            return int(self.codes.shape[0]), n // K_BLOCK_BYTES[self.bits] * QK_K
        return (int(self.codes.shape[0]), n if self.bits == 8 else n // PACKED_BLOCK_BYTES[self.bits] * 32)

    @property
    def nbytes(self) -> int:
        """Bytes a product streams: codes, scales and offsets."""
        return sum(t.nbytes for t in (self.codes, self.scale, self.minv) if t is not None)

    def _super(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A superblock's codes (rows of ``block``, int8, centred), scales and offsets, as ``_k4`` / ``_q6_k``."""
        blocks = self.codes.numpy().reshape(-1, K_BLOCK_BYTES[self.bits])
        return _q6_k(blocks) if self.bits == 6 else _k4(blocks, self.bits)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, minv or None), each (out, in // block): the fields, or a superblock's formed from
        its fp16 d (dmin) and integer sub-block scales (mins) as gguf forms them, in fp32."""
        if not self.superblock:
            assert self.scale is not None
            return self.scale, self.minv
        out, n_in = self.shape
        _, s, m = self._super()
        return (torch.from_numpy(s.reshape(out, -1)),
                None if m is None else torch.from_numpy(np.ascontiguousarray(m).reshape(out, -1)))

    def unpacked(self) -> torch.Tensor:
        """The (out, in) int8 codes, unpacked and centred (``zero`` subtracted)."""
        if self.superblock:
            return torch.from_numpy(self._super()[0].reshape(self.shape))
        if self.bits == 8:
            return self.codes
        out, n_in = self.shape
        c = self.codes.view(out, n_in // 32, PACKED_BLOCK_BYTES[self.bits])  # (out, nb, 16|20) uint8
        nib = c[..., -16:]
        q = torch.cat([nib & 0x0F, nib >> 4], dim=-1)  # (out, nb, 32): codes 0-15 low, 16-31 high
        if self.bits == 5:  # bit k of the little-endian uint32 in bytes 0-3: code k's fifth bit
            shifts = torch.arange(8, dtype=torch.uint8)
            hi = (c[..., :4].unsqueeze(-1) >> shifts) & 1  # (out, nb, 4, 8): byte k // 8, bit k % 8
            q = q | (hi.reshape(out, n_in // 32, 32) << 4)
        return (q.to(torch.int16) - self.zero).to(torch.int8).reshape(out, n_in)

    def weight(self) -> torch.Tensor:
        """The fp32 (out, in) matrix, each value computed as gguf's dequantizer computes it:
        scale * code rounded, then the offset subtracted and rounded."""
        out, n_in = self.shape
        scale, minv = self.scales()
        w = self.unpacked().view(out, -1, self.block).float() * scale.float().unsqueeze(-1)  # (out, nb, block)
        if minv is not None:
            w = w - minv.float().unsqueeze(-1)
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


def _legacy_packed(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]:
    """Q4_0, Q4_1, Q5_0, Q5_1 as the file holds them: (packed blocks (n, 16|20), d (n, 1) fp16,
    -m or None, bits, zero). The bytes after d (and m) are already the kernel's layout."""
    from gguf.constants import GGMLQuantizationType as Q

    d = np.ascontiguousarray(blocks[:, :2]).view(np.float16)
    m = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16) if qtype in (Q.Q4_1, Q.Q5_1) else None
    packed = blocks[:, 4:] if m is not None else blocks[:, 2:]
    bits = 4 if qtype in (Q.Q4_0, Q.Q4_1) else 5
    zero = 0 if m is not None else (8 if bits == 4 else 16)
    return packed, d, None if m is None else -m, bits, zero  # w = d * code + m = d * code - (-m): negation is exact


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


def _k4(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K (bits 4), Q5_K (5): super-blocks of 256 -> 8 sub-blocks of 32, w = (d sc) q - (dmin m):
    (codes (n * 8, 32) int8, scale (n * 8, 1) fp32, offset (n * 8, 1) fp32)."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32)).reshape(n * 8, 1)
    offset = (dmin * mn.astype(np.float32)).reshape(n * 8, 1)
    if bits == 4:
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


def block_codes(t: LiteTensor, packed: bool = True) -> BlockCodes | None:
    """A 2-D tensor of a type the block kernel reads, as BlockCodes; None for any other. With
    ``packed`` (the default) the file's own bytes: the 4- and 5-bit legacy types packed with fp16
    scales, the K types' super-blocks as stored; without, every type is one int8 code a weight with
    fp32 scales (the layout before issue 42: the same weights, more bytes)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    legacy = legacy_types()
    if t.tensor_type not in packed_types() or len(t.shape) != 2:
        return None
    out, n_in = t.shape
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    blocks = np.asarray(t.data).reshape(-1, type_size)  # (out * n_in / block, type_size) uint8
    nb = n_in // (16 if t.tensor_type == Q.Q6_K else 32)  # blocks a row as the kernel reads them
    bits, zero = 8, 0
    if packed and t.tensor_type in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        codes, scale, offset, bits, zero = _legacy_packed(blocks, t.tensor_type)
    elif packed and t.tensor_type == Q.Q8_0:
        codes, scale, offset = blocks[:, 2:].view(np.int8), np.ascontiguousarray(blocks[:, :2]).view(np.float16), None
    elif t.tensor_type in legacy:
        codes, scale, offset = _legacy(blocks, t.tensor_type)
    elif packed:  # Q4_K, Q5_K, Q6_K: the super-blocks as stored
        return BlockCodes(torch.from_numpy(np.array(blocks).reshape(out, -1)), None, None, n_in // nb,
                          {Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}[t.tensor_type], 0, superblock=True)
    elif t.tensor_type == Q.Q6_K:
        codes, scale, offset = _q6_k(blocks)
    else:
        codes, scale, offset = _k4(blocks, 4 if t.tensor_type == Q.Q4_K else 5)
    return BlockCodes(torch.from_numpy(np.ascontiguousarray(codes).reshape(out, -1)),
                      torch.from_numpy(np.ascontiguousarray(scale).reshape(out, nb)),
                      None if offset is None else torch.from_numpy(np.ascontiguousarray(offset).reshape(out, nb)),
                      n_in // nb, bits, zero)
