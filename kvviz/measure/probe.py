"""The roofline probe: what this machine's matmuls and memory deliver, measured in about a second.

The timing pages place their measurements against these two numbers (peak matmul FLOP/s and
memory bandwidth) to say whether a step is compute- or memory-bound. CUDA timings synchronize
before the clock is read.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from kvviz.measure.stats import MachineProbe


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` synchronized calls (after one warm-up): the least disturbed one."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def probe_machine(device: torch.device | str, dtype: torch.dtype = torch.float32, matmul_n: int | None = None,
                  copy_mb: int | None = None, repeats: int = 8) -> MachineProbe:
    """Peak matmul FLOP/s (n x n @ n x n) and memory bandwidth (copy, sum) of this machine.

    Sizes default to what takes about a second: n = 1024 and 256 MiB on a CPU, n = 8192 and
    1 GiB on a GPU, so the copied tensor is far bigger than any cache level.
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    n = matmul_n or (8192 if cuda else 1024)
    nbytes = (copy_mb or (1024 if cuda else 256)) * 2**20
    t_start = time.perf_counter()
    with torch.inference_mode():
        peak = _matmul_flops(dev, dtype, n, repeats)
        bw = _bandwidth(dev, nbytes, repeats)
    dtype_name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    return MachineProbe(device=device_name(dev), dtype=dtype_name, peak_flops=peak, bandwidth=bw, matmul_n=n,
                        copy_bytes=nbytes, seconds=time.perf_counter() - t_start)


def _matmul_flops(dev: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn((n, n), device=dev, generator=g).to(dtype)  # (n, n)
    b = torch.randn((n, n), device=dev, generator=g).to(dtype)  # (n, n)
    out = torch.empty((n, n), device=dev, dtype=dtype)  # (n, n): no allocation inside the clock
    return 2.0 * n**3 / _best_seconds(lambda: torch.matmul(a, b, out=out), dev, repeats)


def _bandwidth(dev: torch.device, nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes // 4, device=dev, dtype=torch.float32)  # (nbytes / 4,)
    dst = torch.empty_like(src)
    t_copy = _best_seconds(lambda: dst.copy_(src), dev, repeats)
    t_sum = _best_seconds(lambda: src.sum(), dev, repeats)
    return max(2.0 * src.nbytes / t_copy, src.nbytes / t_sum)  # a copy reads and writes; a sum only reads


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    n = torch.get_num_threads()
    return f"cpu ({n} thread{'s' if n != 1 else ''})"
