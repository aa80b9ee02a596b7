"""``python -m kvviz memory``: argparse glue around the torch-free calculator in kvviz.memory.

This layer may import the engine; kvviz.memory may not. So kvviz's own model shapes are read
here (``engine.load.builtin_shapes``) and handed to ``kvviz.memory.builtin_specs``; the page does the same.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from kvviz.argtypes import positive_int
from kvviz.errors import KVVizError
from kvviz.memory import (
    DEFAULT_BLOCK_SIZE, DEFAULT_EFFICIENCY, DEFAULT_GROUP_SIZE, DEFAULT_RESERVE, DTYPES, GPU_PRESETS_GIB, MAX_TP,
    SCALE_DTYPE_BYTES, STATE_DTYPES, CalcError, MemoryRequest, ModelSpec, builtin_specs, cache_window_problems,
    calculate, find_preset, load_config_file, load_gpus, summary_text, with_builtins, with_cache_window,
)

_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def all_presets() -> dict[str, ModelSpec]:
    """Published presets first, then kvviz's own models."""
    from kvviz.engine.load import builtin_shapes  # torch: imported only when the presets are asked for

    shapes, shipped = builtin_shapes()
    return with_builtins(builtin_specs(shapes, shipped, "kvviz/engine/load.py RANDOM_SHAPES"))


def parse_count(s: str) -> int:
    """A parameter count: '6738415616', '6,738,415,616', '6.7e9' or '6.7B'."""
    t = s.strip().lower().replace(",", "").replace("_", "")
    mult = 1
    if t and t[-1] in _SUFFIXES:
        t, mult = t[:-1], _SUFFIXES[t[-1]]
    try:
        v = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a parameter count like 6738415616 or 6.7B, got {s!r}") from None
    if not math.isfinite(v) or v < 1 or v > 1e15:
        raise argparse.ArgumentTypeError(f"expected a parameter count between 1 and 1e15, got {s!r}")
    return int(round(v))


def _gib(s: str) -> float:
    try:
        v = float(s.lower().removesuffix("gib").removesuffix("gb").strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU memory in GiB such as 80, got {s!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive amount of GiB, got {s!r}")
    return v


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.1, got {s!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {s!r}")
    return v


def _positive_float(what: str, example: str) -> Any:
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} such as {example}, got {s!r}") from None
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {what}, got {s!r}")
        return v
    return parse


def _price(s: str) -> float:
    try:
        v = float(s.removeprefix("$"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected dollars per GPU-hour such as 2.5, got {s!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"expected a price >= 0, got {s!r}")
    return v


def _efficiency(s: str) -> float:
    v = _positive_float("fraction", "0.7")(s)
    if v > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {s!r}")
    return v


def _tp(s: str) -> int:
    v = positive_int(s)
    if v > MAX_TP:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_TP:,} GPUs, got {s!r}")
    return v


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", metavar="NAME", help="a preset key or name (see --list-presets)")
    src.add_argument("--config", type=Path, metavar="config.json", help="a Hugging Face or kvviz config.json")
    src.add_argument("--list-presets", action="store_true", help="list the presets with their sources")
    src.add_argument("--list-gpus", action="store_true", help="list the GPU presets with their sources")
    p.add_argument("--seq-len", type=positive_int, metavar="N", help="tokens per sequence: prompt + output (required)")
    p.add_argument("--batch", type=positive_int, default=1, help="concurrent requests (default 1)")
    p.add_argument("--beams", type=positive_int, default=1, help="parallel samples / beams per request (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="fp16", help="KV-cache dtype (default fp16)")
    p.add_argument("--weight-dtype", choices=DTYPES,
                   help="weight dtype (default: the KV dtype when it is fp32, fp16 or bf16, else fp16)")
    p.add_argument("--group-size", type=positive_int, default=DEFAULT_GROUP_SIZE,
                   help=f"int8/int4: values per scale (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--scale-dtype", choices=tuple(SCALE_DTYPE_BYTES), default="fp16",
                   help="int8/int4: scale dtype (default fp16)")
    p.add_argument("--zero-point", action="store_true", help="int8/int4: count a zero point per group too")
    p.add_argument("--paged", action="store_true", help="vLLM-style paging: round tokens up to whole blocks")
    p.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                   help=f"paging block size in tokens (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--no-windows", action="store_true", help="ignore sliding windows: every layer keeps every token")
    p.add_argument("--window", type=positive_int, metavar="W",
                   help="a run-time cache window on every layer: keep the last W positions (kvviz's --window)")
    p.add_argument("--sinks", type=int, default=0, metavar="S",
                   help="with --window: also keep the first S positions forever (StreamingLLM keeps 4; default 0)")
    p.add_argument("--params", type=parse_count, metavar="COUNT",
                   help="parameter count (e.g. 6.7B); overrides the config's, needed when it is unknown")
    p.add_argument("--gpu", type=_gib, metavar="GIB",
                   help=f"GPU memory in GiB for the fit check ({', '.join(map(str, GPU_PRESETS_GIB))} or any)")
    p.add_argument("--reserve", type=_fraction, default=DEFAULT_RESERVE,
                   help=f"fraction of the GPU kept free for activations and the CUDA context (default {DEFAULT_RESERVE})")
    p.add_argument("--tp", type=_tp, default=1, metavar="N",
                   help="tensor-parallel GPUs: per-GPU KV and weights, KV heads replicated when N > KV heads")
    p.add_argument("--state-dtype", choices=STATE_DTYPES, default="auto",
                   help="linear-attention / Mamba state dtype (default auto: the weight dtype when it is a float)")
    p.add_argument("--gpu-model", choices=tuple(load_gpus()), metavar="GPU",
                   help=f"a GPU preset ({', '.join(load_gpus())}): its memory (unless --gpu), bandwidth and price")
    p.add_argument("--bandwidth", type=_positive_float("GB/s", "3350"), metavar="GB/S",
                   help="peak memory bandwidth of one GPU in GB/s: adds the decode roofline's tokens/s")
    p.add_argument("--price", type=_price, metavar="USD",
                   help="dollars per GPU-hour: adds the cost per 1M output tokens")
    p.add_argument("--efficiency", type=_efficiency, default=DEFAULT_EFFICIENCY,
                   help=f"achieved / peak bandwidth for the roofline (default {DEFAULT_EFFICIENCY})")
    p.add_argument("--json", action="store_true")


def _list(presets: dict[str, ModelSpec]) -> tuple[dict[str, Any], str]:
    rows = [{"key": k, "name": s.name, "attention": s.attention, "n_layers": s.n_layers, "n_heads": s.n_heads,
             "n_kv_heads": None if s.mla else s.n_kv_heads, "head_dim": s.head_dim, "params": s.params,
             "max_position_embeddings": s.max_positions, "source": s.source} for k, s in presets.items()]
    text = "\n".join(f"{r['key']:24} {r['attention']:4} {r['name']}  <{r['source']}>" for r in rows)
    return {"presets": rows}, text


def _list_gpus() -> tuple[dict[str, Any], str]:
    rows = [{"key": g.key, "name": g.name, "memory_gib": g.memory_gib, "bandwidth_gbs": g.bandwidth_gbs,
             "price_per_hour": g.price_per_hour, "source": g.source} for g in load_gpus().values()]
    text = "\n".join(f"{r['key']:10} {r['memory_gib']:>4} GiB {r['bandwidth_gbs']:>6,.0f} GB/s "
                     f"${r['price_per_hour']:<5g} {r['name']}  <{r['source']}>" for r in rows)
    return {"gpus": rows}, text


def _gpu_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Memory, bandwidth and price: as given, with --gpu-model filling in those not given."""
    out = {"gpu_gib": args.gpu, "bandwidth_gbs": args.bandwidth, "price_per_gpu_hour": args.price}
    if args.gpu_model is not None:
        g = load_gpus()[args.gpu_model]
        for key, value in (("gpu_gib", float(g.memory_gib)), ("bandwidth_gbs", g.bandwidth_gbs),
                           ("price_per_gpu_hour", g.price_per_hour)):
            if out[key] is None:
                out[key] = value
    return out


def weight_dtype(args: argparse.Namespace) -> str:
    """--weight-dtype, else the KV dtype when it is a float one: a model's cache is kept in its weights'
    dtype unless quantized, so `--dtype bf16` alone means bf16 weights (it said fp16 before, same bytes)."""
    if args.weight_dtype is not None:
        return args.weight_dtype
    return args.dtype if args.dtype in ("fp32", "fp16", "bf16") else "fp16"


def run_memory(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.list_gpus:
        return _list_gpus()
    presets = all_presets() if (args.list_presets or args.preset) else {}
    if args.list_presets:
        return _list(presets)
    if args.seq_len is None:
        raise KVVizError("--seq-len N is required (tokens per sequence: prompt + output)")
    if args.window is None and args.sinks:
        raise KVVizError("--sinks needs --window: the sinks are what a windowed cache keeps besides its last W positions")
    if args.window is not None and args.no_windows:
        raise KVVizError("--window and --no-windows contradict each other: the cache window is a window")
    try:
        spec = find_preset(args.preset, presets) if args.preset else load_config_file(args.config)
        if args.window is not None:
            problems = cache_window_problems(spec, args.window, args.sinks)
            if problems:
                raise CalcError(problems)
            spec = with_cache_window(spec, args.window, args.sinks)
        req = MemoryRequest(
            seq_len=args.seq_len, batch=args.batch, beams=args.beams, kv_dtype=args.dtype,
            weight_dtype=weight_dtype(args), group_size=args.group_size, scale_dtype=args.scale_dtype,
            zero_point=args.zero_point, paged=args.paged, block_size=args.block_size,
            use_windows=not args.no_windows, params=args.params, reserve=args.reserve, tp=args.tp,
            state_dtype=args.state_dtype, efficiency=args.efficiency, **_gpu_settings(args),
        )
        res = calculate(spec, req)
    except CalcError as e:
        raise KVVizError(str(e)) from None
    out = res.to_dict()
    out["cache_window"] = None if args.window is None else {"window": args.window, "sinks": args.sinks,
                                                            "positions_held": args.window + args.sinks}
    return out, summary_text(res)
