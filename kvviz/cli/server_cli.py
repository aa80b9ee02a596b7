"""``export`` (a model as a transformers/vLLM folder) and ``watch`` (a running server's KV cache, live).

``watch URL`` reads the server's /metrics with prometheus_client's parser (kvviz/watch/), once
(``--once``) or every ``--interval`` seconds until Ctrl-C or ``--count`` readings; ``--json`` prints one
object per reading (one line each). Every failure to read a server is one ``error:`` line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import kvviz.cli.argtypes as types
from kvviz.errors import KVVizError


# ----------------------------------------------------------------------------- export
def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="default | smollm2 | gemma3 | shakespeare | random:NAME | a model folder | a .gguf file")
    p.add_argument("--format", choices=["hf"], default="hf",
                   help="hf: config.json + model.safetensors + tokenizer.json + tokenizer_config.json, "
                        "what transformers' from_pretrained and vLLM's --model load")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="the weights' dtype in the folder (auto: as loaded, fp32 for a GGUF)")
    p.add_argument("--overwrite", action="store_true", help="write into a folder that already holds files")
    p.add_argument("out", help="the folder to write (created; must be empty unless --overwrite)")
    p.add_argument("--json", action="store_true")


def _export_folder_problem(out: Path, overwrite: bool) -> str | None:
    if out.exists() and not out.is_dir():
        return "it exists and is not a folder"
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        return "the folder is not empty (pass --overwrite to replace the model files in it)"
    parent = out.resolve().parent
    if not parent.is_dir():
        return f"{parent} does not exist"
    return None


def run_export(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from kvviz.engine.loaded import load_model
    from kvviz.engine.loading.save import export_hf

    out = Path(args.out)
    problem = _export_folder_problem(out, args.overwrite)
    if problem:
        raise KVVizError(f"cannot export to {out}: {problem}")
    t0 = time.perf_counter()
    model = load_model(args.model, device="cpu", dtype=args.dtype)
    files = export_hf(model, out)
    size = sum((out / f).stat().st_size for f in files)
    obj = {"model": model.name, "format": args.format, "folder": str(out), "dtype": model.dtype_name,
           "files": files, "bytes": size, "seconds": round(time.perf_counter() - t0, 3)}
    return obj, (f"wrote {model.name} ({model.dtype_name}) to {out}/: {', '.join(files)} "
                 f"({size / 2**20:,.1f} MiB). Load it with transformers' from_pretrained('{out}') "
                 f"or serve it with vLLM: --model {out}")


# ----------------------------------------------------------------------------- watch
def add_watch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000 (vLLM, SGLang or llama.cpp's server)")
    p.add_argument("--once", action="store_true", help="read once and exit")
    p.add_argument("--interval", type=types.float_in(0.2, 3600, "seconds", "2"), default=2.0,
                   help="seconds between readings (default 2)")
    p.add_argument("--count", type=types.int_in(1, 1_000_000), default=None, help="stop after this many readings")
    p.add_argument("--timeout", type=types.float_in(0.1, 120, "seconds", "5"), default=5.0,
                   help="seconds to wait for each answer (default 5)")
    p.add_argument("--header", action="append", default=[], metavar="'Name: value'",
                   help="an HTTP header to send, e.g. 'Authorization: Bearer KEY' (repeatable)")
    spec = p.add_mutually_exclusive_group()
    spec.add_argument("--preset", help="the served model as a calculator preset (default: found by its name)")
    spec.add_argument("--config", help="the served model's config.json (default: a preset found by its name)")
    p.add_argument("--kv-dtype", choices=["fp32", "fp16", "bf16", "fp8"], default=None,
                   help="the server's KV dtype when its cache_dtype is 'auto' (default bf16)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="where the vLLM server runs: its CPU backend keeps one batch in flight, a GPU two "
                        "(the sliding-window share of the calculator's figures; the metrics do not say)")
    p.add_argument("--json", action="store_true", help="one JSON object per reading")


def _spec(args: argparse.Namespace) -> Any:
    from kvviz.calculator.hf_config import load_config_file
    from kvviz.calculator.presets import find_preset, load_presets
    from kvviz.calculator.spec import CalcError

    try:
        if args.config:
            return load_config_file(args.config)
        if args.preset:
            return find_preset(args.preset, load_presets())
    except CalcError as e:
        raise KVVizError(str(e)) from None
    return None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ",.0f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)


def describe(snap: Any, rates: Any = None) -> str:
    """One reading as a few lines of text."""
    r, c = snap.reading, snap.calc
    kv = f"KV {_pct(r.kv_cache_usage)}"
    if c.used_tokens is not None and c.kv_cache_tokens:
        kv += f" (~{c.used_tokens:,.0f} of {c.kv_cache_tokens:,} tokens)"
    lines = [f"{r.engine} {r.model or '(model not named)'} | {kv} | running {_num(r.requests_running)} "
             f"waiting {_num(r.requests_waiting)} | preemptions {_num(r.preemptions)} | "
             f"generated {_num(r.generation_tokens)} tokens"]
    if r.prefix_cache_queries is not None:
        rate = (r.prefix_cache_hits or 0) / r.prefix_cache_queries if r.prefix_cache_queries else None
        lines.append(f"prefix cache: {_num(r.prefix_cache_hits)} of {_num(r.prefix_cache_queries)} tokens hit "
                     f"({_pct(rate)} since start)")
    if rates is not None:
        lines.append(f"last {rates.seconds:.1f} s: {_num(rates.generation_tok_s, ',.1f')} tok/s, prefix hit rate "
                     f"{_pct(rates.prefix_hit_rate)}, preemptions {_num(rates.preemptions)}")
    for name, h in (("TTFT", r.ttft), ("inter-token", r.itl)):
        if h is not None and h.count:
            q = [h.quantile(x) for x in (0.5, 0.9, 0.99)]
            lines.append(f"{name} since start: p50 {_num(q[0] * 1000, ',.1f')} ms, p90 {_num(q[1] * 1000, ',.1f')} ms, "
                         f"p99 {_num(q[2] * 1000, ',.1f')} ms over {h.count:,.0f}")
    if c.kv_cache_tokens is not None:
        conc = "" if c.max_concurrency is None else f", maximum concurrency {c.max_concurrency:.2f}x at " \
                                                     f"{r.max_model_len:,} tokens"
        lines.append(f"kvviz ({c.model}): the pool holds {c.kv_cache_tokens:,} tokens{conc}")
    elif c.why_not:
        lines.append(f"kvviz: {c.why_not}")
    return "\n".join(lines)


def run_watch(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from kvviz.calculator.presets import load_presets
    from kvviz.watch.scrape import parse_target
    from kvviz.watch.server_metrics import rates
    from kvviz.watch.watch import read_server

    target = parse_target(args.url, args.header)
    spec, presets = _spec(args), load_presets()
    read = lambda: read_server(target, presets, spec, args.timeout, args.kv_dtype, args.device)  # noqa: E731
    snap = read()
    if args.once or args.count == 1:
        return snap.to_json(), describe(snap)
    n, before = 1, snap
    _print(args, snap.to_json(), describe(snap))
    while True:  # until --count readings, or Ctrl-C (main() prints "interrupted", exit 130)
        time.sleep(args.interval)
        snap = read()  # a failure mid-watch is an error line; what was printed stays printed
        n += 1
        rt = rates(snap.reading, before.reading, snap.at - before.at)
        obj = snap.to_json()
        obj["interval"] = {"seconds": rt.seconds, "generation_tok_s": rt.generation_tok_s,
                           "prefix_hit_rate": rt.prefix_hit_rate, "preemptions": rt.preemptions}
        if n == args.count:
            return obj, describe(snap, rt)  # the last reading, printed by main like any subcommand's
        _print(args, obj, describe(snap, rt))
        before = snap


def _print(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    print(json.dumps(obj, ensure_ascii=False) if args.json else text + "\n", flush=True)
