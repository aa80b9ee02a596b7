"""Cost per token from the decode bandwidth roofline, and the GPU presets it needs.

A decode step reads every weight on each GPU once and every sequence's KV cache (and linear
state) once, so at best

    step_s = (weights_bytes_per_gpu + sequences x bytes_per_sequence_per_gpu) / (bandwidth x efficiency)
    tokens/s = sequences / step_s                    (one new token per sequence per step)
    $ per 1M output tokens = price_per_gpu_hour x tp / (tokens/s x 3600) x 1e6

It is an upper bound on throughput: compute, kernel launches, the prefill, sampling and the
scheduler are left out, and MoE weights are counted whole (at small batches fewer experts are read).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from kvviz.calculator.formulas import kv_bytes, state_bytes, weights_per_gpu
from kvviz.calculator.presets import PRESETS_PATH
from kvviz.calculator.result import Cost
from kvviz.calculator.spec import MemoryRequest, ModelSpec
from kvviz.units import fmt_usd


@dataclass(frozen=True)
class GPUPreset:
    """One GPU's published memory and peak bandwidth, with an example price to edit."""

    key: str
    name: str
    memory_gib: int  # the nominal size, read as GiB like every GPU size in the calculator
    bandwidth_gbs: float  # peak memory bandwidth, GB/s (decimal, as spec sheets state it)
    price_per_hour: float  # an example on-demand $/GPU-hour: edit it to yours
    source: str  # the spec sheet the memory and bandwidth come from
    usable_mib: int | None = None  # the total nvidia-smi reports (what an engine sizes against); None: unknown

    @property
    def usable_gib(self) -> float:
        """The memory an engine can size against: nvidia-smi's total when known, else the nominal size."""
        return self.usable_mib / 1024 if self.usable_mib else float(self.memory_gib)


@lru_cache(maxsize=4)
def load_gpus(path: Path = PRESETS_PATH) -> dict[str, GPUPreset]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return {g["key"]: GPUPreset(g["key"], g["name"], int(g["memory_gib"]), float(g["bandwidth_gbs"]),
                                float(g["price_per_hour"]), g["source"], g.get("usable_mib")) for g in data["gpus"]}


def decode_cost(weights_bytes_per_gpu: int, bytes_per_sequence_per_gpu: int, sequences: int, bandwidth_gbs: float,
                efficiency: float, price_per_gpu_hour: float | None, tp: int = 1) -> Cost:
    """The roofline for one decode step of ``sequences`` sequences on ``tp`` GPUs (see the module doc)."""
    moved = weights_bytes_per_gpu + sequences * bytes_per_sequence_per_gpu
    bandwidth = bandwidth_gbs * 1e9
    step_s = moved / (bandwidth * efficiency)
    tokens_per_s = sequences / step_s
    usd = None if price_per_gpu_hour is None else price_per_gpu_hour * tp / (tokens_per_s * 3600) * 1e6
    formula = [
        f"bytes per step per GPU = {weights_bytes_per_gpu:,} B weights + {sequences:,} sequences x "
        f"{bytes_per_sequence_per_gpu:,} B (KV + state) = {moved:,} B",
        f"step = {moved:,} B / ({bandwidth_gbs:,.0f} GB/s x {efficiency:g}) = {step_s * 1e3:,.3f} ms",
        f"tokens/s = {sequences:,} / {step_s:.6g} s = {tokens_per_s:,.1f}",
    ]
    if usd is not None:
        formula.append(f"$ per 1M tokens = ${price_per_gpu_hour:g}/h x {tp} GPU{'s' if tp > 1 else ''} / "
                       f"({tokens_per_s:,.1f} tokens/s x 3600) x 1e6 = {fmt_usd(usd)}")
    return Cost(bandwidth, efficiency, sequences, moved, step_s, tokens_per_s, price_per_gpu_hour, usd, tuple(formula))


def bytes_per_sequence_per_gpu(spec: ModelSpec, req: MemoryRequest, kv_dtype: str | None = None) -> int:
    """What one sequence adds to every step on one GPU: its KV at the context (unpaged: the
    unfilled tail of a block is never read) plus its linear state."""
    fmt = replace(req.kv_format, dtype=kv_dtype) if kv_dtype else req.kv_format
    return (kv_bytes(spec, fmt, req.seq_len, 1, req.use_windows, None, req.tp)
            + state_bytes(spec, req.resolved_state_dtype, 1, req.tp))


def request_cost(spec: ModelSpec, req: MemoryRequest, weights: int | None, kv_dtype: str | None = None,
                 sequences: int | None = None) -> Cost | None:
    """The roofline at the request's settings (or another KV dtype / number of sequences);
    None without a bandwidth or with unknown weights."""
    if req.bandwidth_gbs is None or weights is None:
        return None
    return decode_cost(weights_per_gpu(weights, req.tp), bytes_per_sequence_per_gpu(spec, req, kv_dtype),
                       req.sequences if sequences is None else sequences, req.bandwidth_gbs, req.efficiency,
                       req.price_per_gpu_hour, req.tp)


def cost_curve(spec: ModelSpec, req: MemoryRequest, weights: int, batches: Sequence[int],
               kv_dtype: str | None = None) -> list[Cost]:
    """The roofline at each batch (requests; each with the request's beams)."""
    out = []
    for b in batches:
        cost = request_cost(spec, req, weights, kv_dtype, b * req.beams)
        if cost is not None:
            out.append(cost)
    return out


def batch_steps(max_batch: int, cap: int = 1 << 16) -> list[int]:
    """Powers of two up to ``max_batch`` (and ``max_batch`` itself): the x axis of the cost charts."""
    top = max(1, min(max_batch, cap))
    xs = [1 << k for k in range(top.bit_length()) if 1 << k <= top]
    return xs + ([top] if xs[-1] != top else [])
