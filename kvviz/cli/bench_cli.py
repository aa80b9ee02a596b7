"""The ``bench`` and ``bench-spec`` subcommands: their arguments, the run, the JSON file and the table.

What they measure is ``kvviz.measure`` (``bench.py``: tokens/s of kvviz cached, uncached and
transformers; ``spec_bench.py``: speculative decoding against plain greedy), a library below the
command line; this module reads the options, picks the cases, writes the results file
(``safeio.save_results``: a full disk never loses them) and formats the text.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import kvviz.cli.argtypes as types
from kvviz.engine.loaded import load_model
from kvviz.engine.loading.gemma3_package import INSTALL as GEMMA3_INSTALL, part_paths as gemma3_parts
from kvviz.engine.loading.llama_loader import SMOLLM2_INSTALL, smollm2_path
from kvviz.engine.loading.loader import resolve_device
from kvviz.errors import KVVizError
from kvviz.fast.heap import freeze_long_lived
from kvviz.hostinfo import cpu_name
from kvviz.measure.bench import CASES, bench_case, machine_info
from kvviz.measure.cpu_load import others_busy_cores, read_cpu
from kvviz.measure.spec_bench import PROMPTS, compare
from kvviz.measure.sweeps import DOCUMENT
from kvviz.safeio import prepare_out, save_results
from kvviz.units import fmt_bytes

DEFAULT_OUT = Path("bench-results") / "bench.json"
SPEC_DEFAULT_OUT = Path("bench-results") / "spec.json"
# The named models a plain `bench` skips, with a line saying how to install them, when absent.
INSTALLS = {"smollm2": SMOLLM2_INSTALL, "gemma3": GEMMA3_INSTALL}


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=["tiny", "gpt2-small", "smollm2", "gemma3"],
                   help="run only the cases of this model (smollm2 and gemma3 need their packages installed)")
    p.add_argument("--repeats", type=types.repeats, default=5, help="timed runs per variant (after one warm-up)")
    p.add_argument("--prompt-len", type=types.token_count, default=16)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="short runs (for smoke tests): 16 new tokens, 2 repeats")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--out", type=types.out_file, default=DEFAULT_OUT, help="where to write the JSON results")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cache-sweep", metavar="NS", help="instead: cache vs no cache total time at these new-token "
                   "counts (e.g. 16,64,256) on --model, against the seeds' claimed speedups")


def run_bench(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    prepare_out(args.out, DEFAULT_OUT)  # before minutes of measuring, not after
    if args.cache_sweep:
        return _run_cache_sweep(args)
    cases = [c for c in CASES if args.model in (None, c.shape)]
    skipped = []
    for name, how in INSTALLS.items():
        if args.model is None and not _installed(name):  # asked for by name, it fails loudly instead
            cases = [c for c in cases if c.model != name]
            skipped.append(f"{name} (not installed: {how})")
    repeats = 2 if args.quick else args.repeats
    results = [bench_case(c, repeats, args.prompt_len, args.device, not args.no_hf,
                          16 if args.quick else None) for c in cases]
    dev = resolve_device(args.device)
    obj = {"machine": machine_info(dev), "repeats": repeats, "results": results, "skipped": skipped,
           "method": "wall-clock tokens/s, median of interleaved runs after one warm-up; greedy, batch 1"}
    save_results(args.out, json.dumps(obj, indent=2) + "\n")
    obj["out"] = str(args.out)
    return obj, format_table(obj)


def _run_cache_sweep(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from kvviz.measure.cache_sweep import cache_sweep, format_sweep, parse_ns

    ns = parse_ns(args.cache_sweep)
    case = next(c for c in CASES if c.shape == (args.model or "smollm2"))
    model = load_model(case.model or f"random:{case.shape}", device=args.device)
    res = cache_sweep(model, DOCUMENT, ns, 2 if args.quick else args.repeats)
    obj = {"machine": machine_info(resolve_device(args.device)), "cache_sweep": res}
    save_results(args.out, json.dumps(obj, indent=2) + "\n")
    obj["out"] = str(args.out)
    m = obj["machine"]
    head = f"machine: {m['cpu']} · {m['cores']} cores · torch {m['torch']} ({m['torch_threads']} threads)\n"
    return obj, head + format_sweep(res)


def _installed(model: str) -> bool:
    """Whether a named model's packages are there (found, not joined or loaded)."""
    try:
        gemma3_parts() if model == "gemma3" else smollm2_path()
    except KVVizError:
        return False
    return True


def format_table(obj: dict[str, Any]) -> str:
    m = obj["machine"]
    lines = [f"machine: {m['cpu']} · {m['cores']} cores · torch {m['torch']} ({m['torch_threads']} threads)"
             f" · device {m['device']}{' · ' + m['gpu'] if 'gpu' in m else ''}",
             f"one-row kernel: {m.get('row_kernel', 'n/a')}",
             f"median of {obj['repeats']} interleaved runs (min-max), greedy, batch 1", ""]
    lines.append(f"{'shape':<11} {'new':>4}  {'variant':<19} {'tok/s':>9}  {'min-max':>17}  same tokens")
    for r in obj["results"]:
        for v, d in r["variants"].items():
            same = {True: "yes", False: "NO", None: "-"}[d["tokens_match"]]
            lines.append(f"{r['shape']:<11} {r['new_tokens']:>4}  {v:<19} {d['tok_s_median']:>9.1f}  "
                         f"{d['tok_s_min']:>8.1f}-{d['tok_s_max']:<8.1f}  {same}")
        if not r.get("accelerator", True):
            lines.append(f"{'':<11} {'':>4}  kvviz_static = the readable model: kvviz.fast has no {r['shape']} step")
        for v, d in r["variants"].items():
            if "weight_bytes" in d:
                lines.append(f"{'':<11} {'':>4}  {v} = weight matmuls only: {fmt_bytes(d['weight_bytes'])} per "
                             f"token at {d['GB_s_median']:.1f} GB/s")
            if v == "kvviz_static_decode":
                lines.append(f"{'':<11} {'':>4}  {v} = kvviz_static's decode: its tokens after the first over "
                             "the run's time after the prefill")
            if "same_tokens_before_divergence" in d:
                lines.append(f"{'':<11} {'':>4}  {v}: other weights ({d['dtype']}); the first "
                             f"{d['same_tokens_before_divergence']} tokens equal kvviz_static's")
        if "quoted" in r:
            q = r["quoted"]
            lines.append(f"{'':<11} {'':>4}  quoted, not measured: llama.cpp Q4_1 at {q['threads']} thread(s) "
                         f"{q['llama_cpp_q4_1_tok_s']:.0f} tok/s (issue 17)")
        if "others_busy_cores" in r:
            lines.append(f"{'':<11} {'':>4}  other processes kept {r['others_busy_cores']:.2f} cores busy meanwhile")
        for k, val in r["ratios"].items():
            spread = r["ratio_spread"][k]
            lines.append(f"{'':<11} {'':>4}  ratio {k}: {val:.2f}x "
                         f"(repeat by repeat {spread['min']:.2f}-{spread['max']:.2f}x)")
        lines.append("")
    for s in obj.get("skipped", []):
        lines.append(f"skipped: {s}")
    lines.append(f"JSON written to {obj.get('out', '')}")
    return "\n".join(lines)


def add_spec_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="default | smollm2 | random:NAME | a folder")
    p.add_argument("--repeats", type=types.repeats, default=5, help="timed runs of each (after one warm-up)")
    p.add_argument("--max-new-tokens", type=types.token_count, default=64)
    p.add_argument("--draft-tokens", type=types.draft_tokens, default=10)
    p.add_argument("--ngram", type=types.ngram, default=2)
    p.add_argument("--ignore-eos", action="store_true",
                   help="run both to --max-new-tokens through EOS (every run the same length)")
    p.add_argument("--threads", type=types.threads, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", type=types.out_file, default=SPEC_DEFAULT_OUT, help="where to write the JSON results")
    p.add_argument("--json", action="store_true")


def run_spec_bench(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import torch

    prepare_out(args.out, SPEC_DEFAULT_OUT)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu")
    freeze_long_lived()
    before = read_cpu()
    results = {name: compare(model, text, args.max_new_tokens, args.repeats, args.draft_tokens, args.ngram,
                             ignore_eos=args.ignore_eos)
               for name, text in PROMPTS.items()}
    after = read_cpu()
    busy = None if before is None or after is None else round(others_busy_cores(before, after,
                                                                                os.sysconf("SC_CLK_TCK")), 2)
    obj = {"model": model.name, "cpu": cpu_name(), "torch_threads": torch.get_num_threads(),
           "others_busy_cores": busy, "repeats": args.repeats,
           "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
           "draft_tokens": args.draft_tokens, "ngram": args.ngram,
           "results": {k: v.to_dict() for k, v in results.items()}, "out": str(args.out)}
    save_results(args.out, json.dumps(obj, indent=1) + "\n")
    lines = [f"{model.name}: plain greedy vs prompt-lookup speculation ({args.draft_tokens} drafts, n-gram "
             f"{args.ngram}), medians of {args.repeats}, {obj['torch_threads']} threads; other processes kept "
             f"{busy} cores busy meanwhile"]
    for name, r in obj["results"].items():
        rate = "n/a" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        lines.append(f"  {name:10s} plain {r['plain_tok_s']:6.1f} tok/s  speculative {r['spec_tok_s']:6.1f} tok/s  "
                     f"x{r['speedup']:.2f}  accepted {r['accepted']}/{r['drafted']} ({rate})  "
                     f"forwards {r['forwards']} for {r['tokens']} tokens ({r['fed_per_decode_forward']:.1f} fed per decode "
                     f"forward)  same tokens: {r['same_tokens']}")
    return obj, "\n".join(lines)
