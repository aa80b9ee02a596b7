"""Slot stores: where a cache keeps its K/V rows, in full precision or quantized.

A store is ``slots`` positions per layer, K and V each (B, nkv, slots, hs) once dequantized;
``slots`` may differ per layer (a sequence): a sliding layer of Gemma 3 keeps a ring of its window.
The quantized cache is a store of ``block_size`` slots written in order (its sliding layers a ring
of W); the window cache is a store of ``sinks + window`` slots written as a ring. Keeping "how rows are stored" apart from
"which position goes to which slot" lets the two combine (an int8 sliding window).

Byte accounting is exact: ``slot_bytes`` is what one position occupies across every layer,
K and V, payload plus fp16 scales (and zero points); ``fixed_bytes`` is what does not grow with
positions (fp8's per-tensor or per-head scales).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.engine.kvcache.kv_quant import (BITS, QTensor, dequantize_fp8, dequantize_int, fp8_scale, quantize_fp8,
                                  quantize_int)


@dataclass
class ErrorLog:
    """What quantizing cost, measured on every write (only when the cache was asked to track).

    ``rows``: one per (write, layer): the first position written, the layer, and per KV head
    the max and mean |dequantized - exact| of K and of V (batch row 0). ``k_absmax`` /
    ``k_err_sum`` per layer are (nkv, hs): keys' largest magnitude per channel (their outlier
    channels) and the summed absolute error per channel, over ``k_count`` rows.
    """

    rows: list[tuple[int, int, list[float], list[float], list[float], list[float]]] = field(default_factory=list)
    k_absmax: dict[int, torch.Tensor] = field(default_factory=dict)
    k_err_sum: dict[int, torch.Tensor] = field(default_factory=dict)
    v_err_sum: dict[int, torch.Tensor] = field(default_factory=dict)
    k_count: dict[int, int] = field(default_factory=dict)

    def add(self, start: int, layer: int, k: torch.Tensor, kd: torch.Tensor, v: torch.Tensor,
            vd: torch.Tensor) -> None:
        ek = (kd.float() - k.float()).abs()[0]  # (nkv, T, hs), batch row 0
        ev = (vd.float() - v.float()).abs()[0]
        self.rows.append((start, layer, ek.amax(dim=(1, 2)).tolist(), ek.mean(dim=(1, 2)).tolist(),
                          ev.amax(dim=(1, 2)).tolist(), ev.mean(dim=(1, 2)).tolist()))
        amax = k.float().abs()[0].amax(dim=1)  # (nkv, hs)
        if layer in self.k_absmax:
            self.k_absmax[layer] = torch.maximum(self.k_absmax[layer], amax)
            self.k_err_sum[layer] += ek.sum(dim=1)
            self.v_err_sum[layer] += ev.sum(dim=1)
            self.k_count[layer] += k.shape[2]
        else:
            self.k_absmax[layer], self.k_err_sum[layer] = amax, ek.sum(dim=1)
            self.v_err_sum[layer], self.k_count[layer] = ev.sum(dim=1), k.shape[2]

    def per_layer_head(self, which: str = "k", stat: str = "max") -> list[list[float]]:
        """(n_layer, nkv): the max (over writes) of each write's max or mean |error|, of K or V."""
        col = {("k", "max"): 2, ("k", "mean"): 3, ("v", "max"): 4, ("v", "mean"): 5}[(which, stat)]
        out: dict[int, list[float]] = {}
        for r in self.rows:
            vals = r[col]
            old = out.get(r[1])
            out[r[1]] = list(vals) if old is None else [max(a, b) for a, b in zip(old, vals)]
        return [out[i] for i in sorted(out)]

    def per_step(self) -> list[tuple[int, float, float, float, float]]:
        """One row per write (a prefill, a chunk or a decode step), by the first position it wrote:
        (position, K max, K mean, V max, V mean) of |dequantized - exact| over every layer and KV
        head (the mean weights each layer's heads alike)."""
        by: dict[int, list[tuple[list[float], list[float], list[float], list[float]]]] = {}
        for start, _, kmax, kmean, vmax, vmean in self.rows:
            by.setdefault(start, []).append((kmax, kmean, vmax, vmean))
        out = []
        for start in sorted(by):
            rows = by[start]
            n = sum(len(r[1]) for r in rows)
            out.append((start, max(max(r[0]) for r in rows), sum(sum(r[1]) for r in rows) / n,
                        max(max(r[2]) for r in rows), sum(sum(r[3]) for r in rows) / n))
        return out

    def summary(self) -> dict[str, float]:
        """Max and mean absolute error of K and V over every write, layer and head."""
        if not self.rows:
            return {}
        kmax = max(max(r[2]) for r in self.rows)
        vmax = max(max(r[4]) for r in self.rows)
        n = sum(self.k_count.values())
        heads = len(self.rows[0][2])
        hs = next(iter(self.k_err_sum.values())).shape[-1]
        kmean = float(sum(t.sum() for t in self.k_err_sum.values())) / (n * heads * hs)
        vmean = float(sum(t.sum() for t in self.v_err_sum.values())) / (n * heads * hs)
        return {"k_max_abs_error": kmax, "k_mean_abs_error": kmean, "v_max_abs_error": vmax,
                "v_mean_abs_error": vmean}


def per_layer(slots: int | Sequence[int], n_layer: int) -> list[int]:
    """Each layer's slot count: one number for every layer, or one per layer."""
    return [slots] * n_layer if isinstance(slots, int) else list(slots)


class FloatStore:
    """Rows kept as they come, in the cache's dtype; reads are views (no copy)."""

    def __init__(self, config: GPTConfig, batch: int, slots: int | Sequence[int], device: torch.device,
                 dtype: torch.dtype) -> None:
        rows = per_layer(slots, config.n_layer)
        self.dtype, self.slots = dtype, max(rows)
        self.k = [torch.zeros((batch, config.kv_heads, r, config.head_dim), device=device, dtype=dtype) for r in rows]
        self.v = [torch.zeros((batch, config.kv_heads, r, config.head_dim), device=device, dtype=dtype) for r in rows]
        self.errors: ErrorLog | None = None  # nothing is lost, so nothing to track

    @property
    def slot_bytes(self) -> int:
        t = self.k[0]
        return 2 * len(self.k) * t.shape[0] * t.shape[1] * t.shape[3] * t.element_size()

    fixed_bytes = 0

    @property
    def allocated(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    def roundtrip(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What reading k, v back after a write gives, without storing them: k, v themselves."""
        return k, v

    def set_scale(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """No scales to set (QuantStore's fp8 has them)."""

    def write(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor, position: int | None = None) -> None:
        """k, v (B, nkv, T, hs) into slots slot..slot+T."""
        self.k[layer].narrow(2, slot, k.shape[2]).copy_(k)
        self.v[layer].narrow(2, slot, v.shape[2]).copy_(v)

    def read(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer].narrow(2, 0, n), self.v[layer].narrow(2, 0, n)  # (B, nkv, n, hs) views

    def clear(self, a: int, b: int) -> None:
        for t in (*self.k, *self.v):
            t[:, :, a:b].zero_()

    def reorder(self, index: torch.Tensor) -> None:
        self.k = [t.index_select(0, index) for t in self.k]
        self.v = [t.index_select(0, index) for t in self.v]

    def save(self, a: int, b: int) -> dict[str, Any]:
        """Copies of slots a..b (a transaction's undo data; ``load`` writes them back)."""
        return {"a": a, "rows": [t[:, :, a:b].clone() for t in (*self.k, *self.v)]}

    def load(self, saved: dict[str, Any]) -> None:
        a = saved["a"]
        for t, old in zip((*self.k, *self.v), saved["rows"]):
            t[:, :, a: a + old.shape[2]].copy_(old)


class QuantStore:
    """Rows stored quantized (int8, int4 or fp8) and dequantized on every read, for attention."""

    def __init__(self, config: GPTConfig, batch: int, slots: int | Sequence[int], device: torch.device,
                 dtype: torch.dtype, kv_dtype: str, group: int, zero_point: bool = False,
                 per_head_scale: bool = False, track: bool = False) -> None:
        nkv, hs, L = config.kv_heads, config.head_dim, config.n_layer
        rows = per_layer(slots, L)
        self.dtype, self.slots, self.kv_dtype, self.group = dtype, max(rows), kv_dtype, group
        self.zero_point, self.per_head = zero_point, per_head_scale
        self.errors = ErrorLog() if track else None
        fp8 = kv_dtype == "fp8"
        width = hs * BITS[kv_dtype] // 8  # int4: two values per byte
        pdtype = torch.float8_e4m3fn if fp8 else (torch.uint8 if (zero_point or kv_dtype == "int4") else torch.int8)
        pshape = [(batch, nkv, r, width) for r in rows]
        gshape = [(batch, nkv, r, hs // group) for r in rows]

        def bufs(shape: tuple[int, ...] | list[tuple[int, ...]], dt: torch.dtype) -> list[torch.Tensor]:
            shapes = shape if isinstance(shape, list) else [shape] * L  # per layer, or one for every layer
            return [torch.zeros(sh, device=device, dtype=dt) for sh in shapes]

        self.payload = {"k": bufs(pshape, pdtype), "v": bufs(pshape, pdtype)}
        self.scale: dict[str, list[torch.Tensor]] = {}
        self.zero: dict[str, list[torch.Tensor]] = {}
        if fp8:  # one fp32 scale per layer (and head), set by the first write
            sshape = (nkv,) if per_head_scale else ()
            self.scale = {"k": bufs(sshape, torch.float32), "v": bufs(sshape, torch.float32)}
            self._scale_set = [False] * L
        else:
            self.scale = {"k": bufs(gshape, torch.float16), "v": bufs(gshape, torch.float16)}
            if zero_point:
                self.zero = {"k": bufs(gshape, torch.float16), "v": bufs(gshape, torch.float16)}

    def _per_slot(self) -> list[torch.Tensor]:
        out = [t[0] for t in (self.payload["k"][0], self.payload["v"][0])]
        if self.kv_dtype != "fp8":
            out += [self.scale["k"][0], self.scale["v"][0]]
            if self.zero:
                out += [self.zero["k"][0], self.zero["v"][0]]
        return out

    @property
    def slot_bytes(self) -> int:
        """One position across every layer: K and V payload, plus scales and zero points."""
        per_layer = 0
        for name in ("payload", "scale", "zero"):
            d = getattr(self, name)
            if d and not (name == "scale" and self.kv_dtype == "fp8"):
                t = d["k"][0]
                per_layer += 2 * t.nbytes // t.shape[2]
        return per_layer * len(self.payload["k"])

    @property
    def fixed_bytes(self) -> int:
        if self.kv_dtype != "fp8":
            return 0
        return sum(t.nbytes for t in (*self.scale["k"], *self.scale["v"]))

    @property
    def allocated(self) -> int:
        return sum(t.nbytes for d in (self.payload, self.scale, self.zero) for ts in d.values() for t in ts)

    def _quant(self, name: str, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.kv_dtype == "fp8":
            return (quantize_fp8(x, self.scale[name][layer]),)
        qt = quantize_int(x, self.kv_dtype, self.group, self.zero_point)
        return (qt.payload, qt.scale) if qt.zero is None else (qt.payload, qt.scale, qt.zero)

    def _deq(self, name: str, layer: int, a: int, n: int) -> torch.Tensor:
        p = self.payload[name][layer].narrow(2, a, n)
        if self.kv_dtype == "fp8":
            return dequantize_fp8(p, self.scale[name][layer], self.dtype)
        z = self.zero[name][layer].narrow(2, a, n) if self.zero else None
        return dequantize_int(QTensor(p, self.scale[name][layer].narrow(2, a, n), z), self.kv_dtype, self.group,
                              self.dtype)

    def set_scale(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """fp8: the layer's scales from its first write's rows (k, v), once; nothing for the ints."""
        if self.kv_dtype == "fp8" and not self._scale_set[layer]:
            self.scale["k"][layer].copy_(fp8_scale(k, self.per_head))
            self.scale["v"][layer].copy_(fp8_scale(v, self.per_head))
            self._scale_set[layer] = True

    def roundtrip(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What reading k, v (B, nkv, T, hs) back after a write gives, without storing them: a ring's
        chunk attends to rows its own later tokens overwrite (set_scale first for fp8)."""
        out = []
        for name, x in (("k", k), ("v", v)):
            parts = self._quant(name, layer, x)
            if self.kv_dtype == "fp8":
                out.append(dequantize_fp8(parts[0], self.scale[name][layer], self.dtype))
            else:
                qt = QTensor(parts[0], parts[1], parts[2] if len(parts) > 2 else None)
                out.append(dequantize_int(qt, self.kv_dtype, self.group, self.dtype))
        return out[0], out[1]

    def write(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor, position: int | None = None) -> None:
        """k, v (B, nkv, T, hs) into slots slot..slot+T; ``position``: the first row's, for the error
        log, when it is not the slot (a ring)."""
        T = k.shape[2]
        self.set_scale(layer, k, v)
        for name, x in (("k", k), ("v", v)):
            parts = self._quant(name, layer, x)
            self.payload[name][layer].narrow(2, slot, T).copy_(parts[0])
            if len(parts) > 1:
                self.scale[name][layer].narrow(2, slot, T).copy_(parts[1])
            if len(parts) > 2:
                self.zero[name][layer].narrow(2, slot, T).copy_(parts[2])
        if self.errors is not None:
            self.errors.add(slot if position is None else position, layer, k, self._deq("k", layer, slot, T), v, self._deq("v", layer, slot, T))

    def read(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V (B, nkv, n, hs): new tensors, as a kernel reading int8 would see them."""
        return self._deq("k", layer, 0, n), self._deq("v", layer, 0, n)

    def clear(self, a: int, b: int) -> None:
        if a == 0:  # emptied: the next write sets fp8's scales again, and the error log starts afresh
            if self.kv_dtype == "fp8":
                self._scale_set = [False] * len(self._scale_set)
            if self.errors is not None:
                self.errors = ErrorLog()
        for d in (self.payload, self.zero):
            for ts in d.values():
                for t in ts:
                    t[:, :, a:b].zero_()
        if self.kv_dtype != "fp8":
            for ts in self.scale.values():
                for t in ts:
                    t[:, :, a:b].zero_()

    def _slotted(self) -> list[torch.Tensor]:
        """Every tensor with a slot dimension (dim 2): payloads, int scales and zero points."""
        ds = (self.payload, self.zero) + (() if self.kv_dtype == "fp8" else (self.scale,))
        return [t for d in ds for ts in d.values() for t in ts]

    def save(self, a: int, b: int) -> dict[str, Any]:
        """Copies of slots a..b plus what is not per slot (fp8's scales, whether each is set, the
        error log): a transaction's undo data; ``load`` writes them back."""
        out: dict[str, Any] = {"a": a, "rows": [t[:, :, a:b].clone() for t in self._slotted()],
                               "errors": copy.deepcopy(self.errors)}
        if self.kv_dtype == "fp8":
            out["scale"] = [t.clone() for ts in self.scale.values() for t in ts]
            out["scale_set"] = list(self._scale_set)
        return out

    def load(self, saved: dict[str, Any]) -> None:
        a = saved["a"]
        for t, old in zip(self._slotted(), saved["rows"]):
            t[:, :, a: a + old.shape[2]].copy_(old)
        self.errors = saved["errors"]
        if self.kv_dtype == "fp8":
            for t, old in zip([t for ts in self.scale.values() for t in ts], saved["scale"]):
                t.copy_(old)
            self._scale_set = list(saved["scale_set"])

    def reorder(self, index: torch.Tensor) -> None:
        for d in (self.payload, self.zero) + (() if self.kv_dtype == "fp8" else (self.scale,)):
            for name in d:
                d[name] = [t.index_select(0, index) for t in d[name]]
