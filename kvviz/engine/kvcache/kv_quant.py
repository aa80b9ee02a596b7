"""Quantize and dequantize K/V vectors: int8, int4 (two per byte) and fp8 e4m3. Pure tensor functions.

int8 / int4 (KIVI, vLLM, llama.cpp's q8_0/q4_0 style): per token and head, with one scale per
``group`` values along head_dim (the default group is the whole head vector).
- symmetric: q = round(x / s), s = amax / qmax (127 or 7), stored as signed int8 (int4: q + 8 in a nibble);
- asymmetric (``zero_point=True``): q = round((x - m) / s), m = min, s = (max - min) / (2^bits - 1),
  stored unsigned; m is kept as an fp16 "zero point" beside the scale.
Scales (and zero points) are fp16. The scale is rounded to fp16 *before* quantizing, so the
dequantized value q * s is exactly what the stored bytes say, and the error bound is s / 2.

fp8 e4m3 (``torch.float8_e4m3fn``): x / s cast to fp8 (3 mantissa bits: relative error 2^-4 at
most), with one fp32 scale per tensor or per KV head. The scale is taken from the first write
(the prefill), as a calibrated static scale is in vLLM; later values beyond 448 s saturate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT_DTYPES = ("int8", "int4")
QUANT_DTYPES = ("int8", "int4", "fp8")
BITS = {"int8": 8, "int4": 4, "fp8": 8}
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_FP16_TINY = 2.0**-24  # the smallest positive fp16: a scale never rounds to 0
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class QTensor:
    """A quantized block of vectors: ``payload`` (..., packed hs), ``scale`` and ``zero`` (..., groups) fp16."""

    payload: torch.Tensor  # int8 (symmetric int8), uint8 (asymmetric int8, packed int4)
    scale: torch.Tensor  # (..., hs // group) fp16
    zero: torch.Tensor | None  # (..., hs // group) fp16, asymmetric only


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """Round to fp16 without underflowing to 0 or overflowing to inf."""
    return x.clamp(_FP16_TINY, _FP16_MAX).to(torch.float16)


def quantize_int(x: torch.Tensor, dtype: str, group: int, zero_point: bool = False) -> QTensor:
    """x (..., hs) float -> QTensor; ``group`` must divide hs (and be even for int4)."""
    bits = BITS[dtype]
    hs = x.shape[-1]
    g = x.float().reshape(*x.shape[:-1], hs // group, group)  # (..., groups, group)
    if zero_point:
        levels = 2**bits - 1  # 255 or 15
        lo = g.amin(-1)
        zero = lo.to(torch.float16)  # (..., groups): rounded first, the scale covers what is left
        zf = zero.float()
        scale = _fp16((g.amax(-1) - zf) / levels)
        q = torch.round((g - zf[..., None]) / scale.float()[..., None]).clamp_(0, levels)
        q = q.to(torch.uint8).reshape(x.shape)
        payload = pack_int4(q) if bits == 4 else q
        return QTensor(payload, scale, zero)
    qmax = 2 ** (bits - 1) - 1  # 127 or 7: symmetric, so -128 / -8 are never used
    scale = _fp16(g.abs().amax(-1) / qmax)  # (..., groups)
    q = torch.round(g / scale.float()[..., None]).clamp_(-qmax, qmax).reshape(x.shape)
    if bits == 4:
        return QTensor(pack_int4((q + 8).to(torch.uint8)), scale, None)
    return QTensor(q.to(torch.int8), scale, None)


def dequantize_int(qt: QTensor, dtype: str, group: int, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """QTensor -> (..., hs) in ``out_dtype``."""
    if BITS[dtype] == 4:
        q = unpack_int4(qt.payload).float()  # (..., hs) in 0..15
        if qt.zero is None:
            q = q - 8.0
    else:
        q = qt.payload.float()
    hs = q.shape[-1]
    g = q.reshape(*q.shape[:-1], hs // group, group) * qt.scale.float()[..., None]
    if qt.zero is not None:
        g = g + qt.zero.float()[..., None]
    return g.reshape(q.shape).to(out_dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(..., hs) uint8 values 0..15 -> (..., hs / 2) bytes: element 2i in the low nibble, 2i+1 in the high."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """(..., hs / 2) bytes -> (..., hs) uint8 values 0..15."""
    return torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def fp8_scale(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """fp32 scale(s) mapping x's amax onto fp8's 448: () per tensor, (nkv,) per head of x (B, nkv, T, hs)."""
    amax = x.float().abs().amax(dim=(0, 2, 3)) if per_head else x.float().abs().amax()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (B, nkv, T, hs) / scale -> float8_e4m3fn, saturating at +-448 (the cast would give NaN)."""
    s = scale.view(1, -1, 1, 1) if scale.dim() else scale
    return (x.float() / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(p: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    s = scale.view(1, -1, 1, 1) if scale.dim() else scale
    return (p.float() * s).to(out_dtype)
