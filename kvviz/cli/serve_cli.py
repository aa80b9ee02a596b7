"""``kvviz serve-bench``: a workload through the serving engine (engine/serving), one policy.

    python -m kvviz serve-bench --model smollm2 --workload mixed --policy continuous --json

``--workload`` is a JSON Lines file (engine/serving/workloads.py) or a built-in name; the pool is
``--num-blocks`` blocks or ``--kv-mib`` MiB (whole blocks of the calculator's bytes per token:
``units.kv_bytes_per_token`` of the layers one block holds, times the block size). ``--events``
writes every step's record as JSON Lines (the replay's input).
"""
from __future__ import annotations

import argparse
from typing import Any

import kvviz.cli.argtypes as types
from kvviz.cli.target_cli import add_target_arguments, run_serve_target

DEFAULT_BLOCKS = 1024


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 (default) | gemma3 | default | random:NAME | a folder")
    p.add_argument("--workload", required=True,
                   help="a JSON Lines file (one request a line) or a built-in: mixed, shared-prefix, long-tail")
    p.add_argument("--num-requests", type=types.int_in(1, 10_000), default=64,
                   help="requests of a built-in workload (default 64)")
    p.add_argument("--seed", type=types.seed, default=0, help="a built-in workload's seed (default 0)")
    p.add_argument("--arrival", choices=["steps", "seconds"], default=None,
                   help="what a request's arrival counts: scheduler steps (deterministic; the default) or "
                        "seconds (the default, and the only choice, with --target)")
    p.add_argument("--policy", choices=["continuous", "static", "sequential"], default="continuous")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=types.kv_blocks, default=None,
                      help=f"KV pool size in blocks (default {DEFAULT_BLOCKS})")
    pool.add_argument("--kv-mib", type=types.float_in(0, 1 << 20, "MiB", "512", low_open=True), default=None,
                      help="KV pool size in MiB: the whole blocks that fit")
    p.add_argument("--block-size", type=types.kv_block_size, default=16)
    p.add_argument("--max-num-batched-tokens", type=types.token_count, default=256,
                   help="the token budget of one step (default 256)")
    p.add_argument("--max-num-seqs", type=types.int_in(1, 4096), default=32, help="running requests at most (default 32)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where kvviz's engine runs (cuda: the GPU's clocks are read after a synchronize)")
    p.add_argument("--threads", type=types.threads_or_default, default=0)
    p.add_argument("--events", type=types.out_file, default=None, help="write every step's record here (JSON Lines)")
    p.add_argument("--json", action="store_true")
    add_target_arguments(p)


def pool_blocks(model: Any, args: argparse.Namespace) -> int:
    """--num-blocks, or the whole blocks --kv-mib holds (the calculator's bytes per token)."""
    from kvviz.engine.kvcache.paged_pool import config_groups
    from kvviz.errors import KVVizError
    from kvviz.units import kv_bytes_per_token

    if args.kv_mib is None:
        return args.num_blocks or DEFAULT_BLOCKS
    c = model.config
    per_token = kv_bytes_per_token(config_groups(c).size, c.kv_heads, c.head_dim, model.dtype.itemsize)
    block = per_token * args.block_size  # one block: block_size tokens of one layer group
    n = int(args.kv_mib * (1 << 20) // block)
    if n < 1:
        raise KVVizError(f"--kv-mib {args.kv_mib:g} holds no block of {block:,} bytes "
                         f"({args.block_size} tokens x {per_token:,} bytes)")
    return n


def run_serve(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import torch

    from kvviz.engine.loaded import load_model
    from kvviz.engine.serving.engine import ServeConfig, ServeEngine
    from kvviz.engine.serving.summary import events_jsonl, request_rows, summary
    from kvviz.engine.serving.workloads import BUILTIN, builtin, load_workload
    from kvviz.hostinfo import cpu_name
    from kvviz.safeio import save_results

    if args.target is not None:
        return run_serve_target(args)  # a running server instead of kvviz's engine (kvviz/cli/target_cli.py)
    args.arrival = args.arrival or "steps"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        from kvviz.errors import KVVizError
        raise KVVizError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.workload in BUILTIN:
        requests = builtin(args.workload, model, args.num_requests, args.seed)
    else:
        requests = load_workload(args.workload, model)
    cfg = ServeConfig(num_blocks=pool_blocks(model, args), block_size=args.block_size,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                      policy=args.policy, prefix_caching=not args.no_prefix_caching, arrival=args.arrival)
    res = ServeEngine(model, cfg).run(requests)
    summ = summary(res)
    obj = {"requests": request_rows(res), "summary": summ,
           "settings": {**cfg.settings(), "model": model.name, "dtype": model.dtype_name,
                        "workload": args.workload, "num_requests": len(requests), "engine": "readable",
                        "cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "device": args.device,
                        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}}
    if args.events is not None:
        save_results(args.events, events_jsonl(res), "the events")
    text = (f"{len(requests)} requests, {args.policy}: {summ['output_tokens']} tokens in {summ['wall_s']} s = "
            f"{summ['throughput_tok_s']} tok/s; TTFT p50 {summ['ttft_ms_p50']} ms, TPOT p50 {summ['tpot_ms_p50']} ms; "
            f"{summ['preemptions']} preemptions; prefix hits {summ['prefix_hit_tokens']}/{summ['prefix_query_tokens']} "
            f"tokens; peak running {summ['peak_running']}, peak blocks {summ['peak_blocks_used']}/{cfg.num_blocks}; "
            f"{summ['steps']} steps")
    return obj, text
