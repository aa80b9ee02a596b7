"""The compressed-KV options of ``generate`` and ``eval``, and the ``kv-curves`` subcommand.

``generate --kv-dtype int8|int4|fp8 --window W --sinks S`` runs the loop through a quantized or
windowed cache and reports its bytes and the measured K/V error; ``eval`` with the same options
scores a text teacher-forced through that cache against a full-precision one on the same tokens.
"""
from __future__ import annotations

import argparse
from typing import Any

import kvviz.cli.argtypes as types
from kvviz.units import fmt_bytes


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("compressed KV cache (engine/kvcache/compressed_caches.py)")
    g.add_argument("--kv-dtype", choices=["int8", "int4", "fp8"], default=None,
                   help="store K/V quantized, dequantized on every read (default: the model's dtype)")
    g.add_argument("--kv-group-size", type=types.group_size, default=None, metavar="G",
                   help="int8/int4: values per fp16 scale along head_dim (default: the whole head vector)")
    g.add_argument("--kv-zero-point", action="store_true", help="int8/int4: asymmetric, with an fp16 zero point")
    g.add_argument("--fp8-scale", choices=["tensor", "head"], default="tensor",
                   help="fp8: one scale per layer, or per layer and KV head (set from the prefill)")
    g.add_argument("--window", type=types.token_count, default=None, metavar="W",
                   help="keep only the last W positions (a ring buffer)")
    g.add_argument("--sinks", type=types.sinks, default=0, metavar="S",
                   help="with --window: also keep the first S positions forever (StreamingLLM)")
    g.add_argument("--kv-positions", choices=["cache", "original"], default=None,
                   help="RoPE positions once positions are evicted: within the cache (StreamingLLM, the "
                        "default for Llama) or the original ones (the only choice for GPT-2)")


def kv_options(args: argparse.Namespace) -> dict[str, Any]:
    """The compressed-cache fields of a ``CacheSpec`` (and ``KVSpec``); errors are tracked whenever the
    rows are quantized."""
    return dict(kv_dtype=args.kv_dtype, window=args.window, sinks=args.sinks, group_size=args.kv_group_size,
                zero_point=args.kv_zero_point, fp8_scale=args.fp8_scale, positions=args.kv_positions,
                track_errors=args.kv_dtype is not None)


def asked(args: argparse.Namespace) -> bool:
    return args.kv_dtype is not None or args.window is not None or bool(args.sinks)


def cache_report(stream: Any) -> dict[str, Any]:
    """The cache a generate run ended with: what it keeps, its bytes, and the measured error."""
    cache = stream.cache
    if cache is None:
        return {}
    errors = getattr(cache, "errors", None)
    return {"kind": stream.cache_label, "positions_held": cache.held, "bytes": cache.bytes_used,
            "bytes_allocated": cache.bytes_allocated, "full_precision_bytes": cache.pos * _full_bytes(stream),
            "kv_error": errors.summary() if errors is not None else {}}


def _full_bytes(stream: Any) -> int:
    c, m = stream.model.config, stream.model
    return 2 * c.n_layer * c.kv_heads * c.head_dim * m.dtype.itemsize * stream.batch_size


def cache_text(rep: dict[str, Any]) -> str:
    err = rep.get("kv_error") or {}
    e = (f", K max |err| {err['k_max_abs_error']:.4g}, V max |err| {err['v_max_abs_error']:.4g}" if err else "")
    return (f"[{rep['kind']}: {rep['positions_held']} positions held, {fmt_bytes(rep['bytes'])} "
            f"(full precision: {fmt_bytes(rep['full_precision_bytes'])}){e}]")


def eval_text(s: dict[str, Any]) -> str:
    first = s["first_top1_disagreement"]
    return (f"{s['kv']}: perplexity {s['perplexity']:.3f} vs {s['perplexity_full']:.3f} full precision over "
            f"{s['tokens_scored']} tokens (teacher-forced through the cache); logit KL mean {s['mean_logit_kl']:.3g}, "
            f"top-1 agreement {s['top1_agreement']:.1%}"
            + ("" if first is None else f" (first disagreement at token {first})")
            + f"; cache {fmt_bytes(s['cache_bytes'])} vs {fmt_bytes(s['full_cache_bytes'])}")


def add_curves_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=types.token_count, default=1024, help="held-out tokens to score")
    p.add_argument("--window", type=types.token_count, default=128)
    p.add_argument("--sinks", type=types.sinks, default=4)
    p.add_argument("--bins", type=types.bins, default=16)
    p.add_argument("--out", type=types.out_file, default=None, help="also write the JSON here")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json", action="store_true")


def run_curves(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import json

    from kvviz.engine.loaded import load_model
    from kvviz.measure.kv_curves import measure  # imported when run: the measurement needs torch
    from kvviz.safeio import prepare_out, save_results

    if args.out is not None:
        prepare_out(args.out)
    model = load_model(args.model, device=args.device)
    res = measure(model, args.tokens, args.window, args.sinks, args.bins)
    if args.out is not None:
        save_results(args.out, json.dumps(res, indent=1) + "\n")
    lines = [f"{k}: perplexity {v:.3f}" for k, v in res["perplexity"].items()]
    lines += [f"{k} KV: perplexity {v['perplexity']:.3f}, top-1 agreement {v['top1_agreement']:.1%}"
              for k, v in res["kv_dtypes"].items()]
    return res, "\n".join(lines)
