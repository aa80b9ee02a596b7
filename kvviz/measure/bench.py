"""``python -m kvviz bench``: tokens/s of kvviz cached, kvviz uncached and transformers, side by side.

Every variant runs in this one process on the same random weights (kvviz's model exported to a
Hugging Face GPT-2 folder and loaded back with ``from_pretrained``), greedy, batch 1, with a
16-token prompt. Runs are interleaved (variant A, B, C, then A, B, C again ...) so drift in the
machine's load hits all of them alike; each figure is the median of the repeats, with min and
max. Ratios are taken between medians of the same run. The first run of each variant is a
warm-up and is discarded. Throughput is wall-clock: prefill + every decode step + the event
bookkeeping for kvviz, ``generate()`` for transformers (CUDA synchronized before reading clocks).

``kvviz_static`` runs the accelerator (``kvviz.fast``); ``readable_static`` the same cached
generation through the readable model alone (``fast=False``), so both engines are measured.

The ``floor`` variant runs only a decode step's weight matmuls (every layer's, then the LM head,
one row each, prepared exactly as kvviz's decode step runs them) once per token: no attention,
no norms, no model code. It is what one decode step cannot go below with these kernels at this
precision, so ``floor / hf`` bounds the speed-up any implementation could show over
transformers here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch

from kvviz.fast import rowops
from kvviz.engine.load import LoadedModel, export_hf_gpt2, load_model, resolve_device
from kvviz.fast.gpt2 import Matmul
from kvviz.errors import KVVizError
from kvviz.engine.generate import generate
from kvviz.fast.heap import freeze_long_lived
from kvviz.measure.machine import cpu_name

DEFAULT_OUT = Path("bench-results") / "bench.json"


@dataclass(frozen=True)
class Case:
    shape: str  # a kvviz.engine.load.RANDOM_SHAPES name
    new_tokens: int
    variants: tuple[str, ...]  # kvviz_static, readable_static, kvviz_concat, kvviz_uncached, hf, floor


CASES = (
    Case("tiny", 256, ("kvviz_static", "readable_static", "kvviz_uncached", "hf", "floor")),
    Case("gpt2-small", 64, ("kvviz_static", "readable_static", "kvviz_uncached", "hf", "floor")),
    Case("tiny", 512, ("kvviz_static", "kvviz_concat")),
)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=["tiny", "gpt2-small"], help="run only the cases of this random shape")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (after one warm-up)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="short runs (for smoke tests): 16 new tokens, 2 repeats")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON results")
    p.add_argument("--json", action="store_true")


def machine_info(device: torch.device) -> dict[str, Any]:
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "row_kernel": rowops.status()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _hf_model(model: LoadedModel, folder: Path) -> Any:
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise KVVizError("the transformers baseline needs `pip install -r requirements-dev.txt` "
                         "(or run with --no-hf)") from None

    export_hf_gpt2(model.gpt, folder)
    hf = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).to(model.device).eval()
    hf.generation_config.eos_token_id = None  # run exactly new_tokens steps, like kvviz
    hf.generation_config.pad_token_id = 0
    return hf


def weight_matmuls(model: LoadedModel) -> list[Matmul]:
    """Every matmul of a decode step, in order (each layer's four, then the LM head), prepared
    as the flat decode step runs them for the current thread count."""
    return model.fast.plan().matmuls()


def _floor_runner(model: LoadedModel, n: int) -> Callable[[], list[int]]:
    plan = model.fast.plan()
    dev, dt = model.device, model.dtype
    calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = []
    for m in plan.matmuls():
        one = rowops.row_linear(m.w, m.bias, plan.threads) if plan.rows is not None else None
        if one is not None:  # the C kernel the step runs, without its fused LayerNorm/GELU/residual
            calls.append((one, torch.randn(m.w.shape[0], device=dev, dtype=dt)))
        else:
            calls.append((m.rows, torch.randn(1, 1, m.w.shape[0], device=dev, dtype=dt)))

    def run_floor() -> list[int]:
        with torch.inference_mode():
            for _ in range(n):  # one pass over the weights per generated token
                for fn, x in calls:
                    fn(x)
        return []
    return run_floor


def _runner(variant: str, model: LoadedModel, hf: Any, prompt: list[int], n: int) -> Callable[[], list[int]]:
    if variant == "floor":
        return _floor_runner(model, n)
    if variant == "hf":
        ids = torch.tensor([prompt], device=model.device)

        def run_hf() -> list[int]:
            with torch.inference_mode():
                out = hf.generate(ids, max_new_tokens=n, do_sample=False, use_cache=True)
            return out[0, len(prompt):].tolist()
        return run_hf
    use_cache = variant != "kvviz_uncached"
    kind = "concat" if variant == "kvviz_concat" else "static"
    fast = variant != "readable_static"  # the readable engine: the model's own forward, no kvviz.fast
    return lambda: generate(model, prompt_ids=prompt, max_new_tokens=n, use_cache=use_cache,
                            cache_kind=kind, fast=fast).generated_ids


def _timed(fn: Callable[[], list[int]], device: torch.device) -> tuple[float, list[int]]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    ids = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, ids


def bench_case(case: Case, repeats: int, prompt_len: int, device: str, with_hf: bool,
               new_tokens: int | None = None) -> dict[str, Any]:
    model = load_model(f"random:{case.shape}", device=device)
    n = new_tokens or case.new_tokens
    prompt = [(7 * i + 3) % 256 for i in range(prompt_len)]  # fixed bytes: same input every run
    variants = [v for v in case.variants if with_hf or v != "hf"]
    with tempfile.TemporaryDirectory() as tmp:
        hf = _hf_model(model, Path(tmp) / "hf") if "hf" in variants else None
        runners = {v: _runner(v, model, hf, prompt, n) for v in variants}
        freeze_long_lived()  # for every variant alike: no full-heap GC pauses while timing
        times: dict[str, list[float]] = {v: [] for v in variants}
        tokens: dict[str, list[int]] = {}
        for r in range(repeats + 1):
            for v in variants:
                dt, ids = _timed(runners[v], model.device)
                tokens[v] = ids
                if r > 0:  # run 0 warms caches and allocators
                    times[v].append(dt)
    ref = tokens[variants[0]]
    res: dict[str, Any] = {"shape": case.shape, "new_tokens": n, "prompt_len": prompt_len,
                           "params": model.num_params, "dtype": model.dtype_name, "variants": {}}
    for v in variants:
        runs = [n / t for t in times[v]]  # in run order: repeat r of every variant ran back to back
        tps = sorted(runs)
        res["variants"][v] = {"tok_s_median": median(tps), "tok_s_min": tps[0], "tok_s_max": tps[-1],
                              "runs": len(tps), "runs_tok_s": runs,
                              "tokens_match": None if v == "floor" else tokens[v] == ref}
    if "floor" in variants:
        nbytes = sum(m.w.nbytes + (m.bias.nbytes if m.bias is not None else 0) for m in weight_matmuls(model))
        res["weight_bytes"] = nbytes  # streamed once per floor step
        res["variants"]["floor"]["GB_s_median"] = nbytes * res["variants"]["floor"]["tok_s_median"] / 1e9
    vs = res["variants"]
    pairs = [(f"{a}_vs_{b}" if name is None else name, a, b) for name, a, b in RATIOS if a in vs and b in vs]
    # The ratio of the medians, and the spread of the same ratio taken repeat by repeat (the two
    # runs of a pair were seconds apart, so it shows how far the machine's drift moves it).
    res["ratios"] = {k: vs[a]["tok_s_median"] / vs[b]["tok_s_median"] for k, a, b in pairs}
    res["ratio_spread"] = {}
    for k, a, b in pairs:
        per_repeat = sorted(x / y for x, y in zip(vs[a]["runs_tok_s"], vs[b]["runs_tok_s"]))
        res["ratio_spread"][k] = {"min": per_repeat[0], "max": per_repeat[-1]}
    return res


# (name or None for "a_vs_b", numerator, denominator); floor / hf bounds what any implementation could gain.
RATIOS = (
    (None, "kvviz_static", "hf"),
    (None, "readable_static", "hf"),
    ("fast_vs_readable", "kvviz_static", "readable_static"),
    ("cached_vs_uncached", "kvviz_static", "kvviz_uncached"),
    (None, "kvviz_static", "floor"),
    (None, "floor", "hf"),
    ("static_vs_concat", "kvviz_static", "kvviz_concat"),
)


def run_bench(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.repeats < 1 or args.prompt_len < 1:
        raise KVVizError("--repeats and --prompt-len must be at least 1")
    try:  # checked before minutes of measuring, not after
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.touch()
    except OSError as e:
        raise KVVizError(f"cannot write the results to {args.out}: {e.strerror}") from None
    cases = [c for c in CASES if args.model in (None, c.shape)]
    repeats = 2 if args.quick else args.repeats
    results = [bench_case(c, repeats, args.prompt_len, args.device, not args.no_hf,
                          16 if args.quick else None) for c in cases]
    dev = resolve_device(args.device)
    obj = {"machine": machine_info(dev), "repeats": repeats, "results": results,
           "method": "wall-clock tokens/s, median of interleaved runs after one warm-up; greedy, batch 1"}
    args.out.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    obj["out"] = str(args.out)
    return obj, format_table(obj)


def format_table(obj: dict[str, Any]) -> str:
    m = obj["machine"]
    lines = [f"machine: {m['cpu']} · {m['cores']} cores · torch {m['torch']} ({m['torch_threads']} threads)"
             f" · device {m['device']}{' · ' + m['gpu'] if 'gpu' in m else ''}",
             f"one-row kernel: {m.get('row_kernel', 'n/a')}",
             f"median of {obj['repeats']} interleaved runs (min-max), greedy, batch 1", ""]
    lines.append(f"{'shape':<11} {'new':>4}  {'variant':<15} {'tok/s':>9}  {'min-max':>17}  same tokens")
    for r in obj["results"]:
        for v, d in r["variants"].items():
            same = {True: "yes", False: "NO", None: "-"}[d["tokens_match"]]
            lines.append(f"{r['shape']:<11} {r['new_tokens']:>4}  {v:<15} {d['tok_s_median']:>9.1f}  "
                         f"{d['tok_s_min']:>8.1f}-{d['tok_s_max']:<8.1f}  {same}")
        if "weight_bytes" in r:
            lines.append(f"{'':<11} {'':>4}  floor = weight matmuls only: {r['weight_bytes'] / 1e6:.1f} MB per "
                         f"token at {r['variants']['floor']['GB_s_median']:.1f} GB/s")
        for k, val in r["ratios"].items():
            spread = r["ratio_spread"][k]
            lines.append(f"{'':<11} {'':>4}  ratio {k}: {val:.2f}x "
                         f"(repeat by repeat {spread['min']:.2f}-{spread['max']:.2f}x)")
        lines.append("")
    lines.append(f"JSON written to {obj.get('out', '')}")
    return "\n".join(lines)
