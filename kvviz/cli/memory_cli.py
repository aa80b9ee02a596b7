"""``python -m kvviz memory``: argparse glue around the torch-free calculator in kvviz.calculator.

This layer may import the engine; kvviz.calculator may not. So kvviz's own model shapes are read
here (``engine.loading.loader.builtin_shapes``) and handed to ``kvviz.calculator.builtin_specs``; the page does the same.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import kvviz.cli.argtypes as types
from kvviz.cli.argtypes import int_in
from kvviz.errors import KVVizError
from kvviz.calculator.server_llamacpp import CACHE_TYPES
from kvviz.calculator.server_log_engines import (
    parse_llamacpp_log, parse_sglang_log, reconcile_llamacpp, reconcile_sglang,
)
from kvviz.calculator.server_sglang import MM_FEATURE_CACHE_MB, MM_TRANSPORTS, VLM_CACHE_SIZE_MB
from kvviz.calculator.server_mix import lengths_from_percentiles, parse_lengths_csv, parse_percentiles
from kvviz.calculator.server_log import (
    MAX_LOG_CHARS, parse_vllm_log, profile_rows, reconcile, reconcile_text, settings_from_log,
)
from kvviz.calculator.formulas import weight_bytes
from kvviz.calculator.server_vllm import DEFAULT_BATCHED_TOKENS, VLLMSettings
from kvviz.calculator.server_vllm_defaults import DEVICES, default_block_size
from kvviz.calculator.server_vllm_groups import KV_CACHE_LAYOUTS, LEGACY_LAYOUT_NAMES
from kvviz.calculator.server_vllm_kv import KV_DTYPES as VLLM_KV_DTYPES
from kvviz.calculator.servers import ENGINES, EngineRequest, engine_report, estimate_parts
from kvviz.calculator import (
    DEFAULT_BLOCK_SIZE, DEFAULT_EFFICIENCY, DEFAULT_GROUP_SIZE, DEFAULT_RESERVE, DTYPES, GPU_PRESETS_GIB, MAX_BATCH,
    MAX_SEQ_LEN, MAX_TP, SCALE_DTYPE_BYTES, STATE_DTYPES, CalcError, MemoryRequest, ModelSpec, builtin_specs,
    cache_window_problems, calculate, find_preset, load_config_file, load_gpus, summary_text, with_builtins,
    with_cache_window,
)
from kvviz.calculator.spec import MAX_BEAMS, MAX_BLOCK_SIZE, MAX_GROUP_SIZE

def all_presets() -> dict[str, ModelSpec]:
    """Published presets first, then kvviz's own models."""
    from kvviz.engine.loading.loader import builtin_shapes  # torch: imported only when the presets are asked for

    shapes, shipped = builtin_shapes()
    return with_builtins(builtin_specs(shapes, shipped, "kvviz/engine/loading/loader.py RANDOM_SHAPES"))


_tp = int_in(1, MAX_TP, "GPUs")


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", metavar="NAME", help="a preset key or name (see --list-presets)")
    src.add_argument("--config", type=Path, metavar="config.json", help="a Hugging Face or kvviz config.json")
    src.add_argument("--list-presets", action="store_true", help="list the presets with their sources")
    src.add_argument("--list-gpus", action="store_true", help="list the GPU presets with their sources")
    p.add_argument("--seq-len", type=int_in(1, MAX_SEQ_LEN), metavar="N",
                   help="tokens per sequence: prompt + output (required)")
    p.add_argument("--batch", type=int_in(1, MAX_BATCH), default=1, help="concurrent requests (default 1)")
    p.add_argument("--beams", type=int_in(1, MAX_BEAMS), default=1,
                   help="parallel samples / beams per request (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="fp16", help="KV-cache dtype (default fp16)")
    p.add_argument("--weight-dtype", choices=DTYPES,
                   help="weight dtype (default: the KV dtype when it is fp32, fp16 or bf16, else fp16)")
    p.add_argument("--group-size", type=int_in(1, MAX_GROUP_SIZE), default=DEFAULT_GROUP_SIZE,
                   help=f"int8/int4: values per scale (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--scale-dtype", choices=tuple(SCALE_DTYPE_BYTES), default="fp16",
                   help="int8/int4: scale dtype (default fp16)")
    p.add_argument("--zero-point", action="store_true", help="int8/int4: count a zero point per group too")
    p.add_argument("--paged", action="store_true", help="vLLM-style paging: round tokens up to whole blocks")
    p.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=None,
                   help=f"paging block size in tokens (default {DEFAULT_BLOCK_SIZE}; vLLM's CPU backend: 128)")
    p.add_argument("--no-windows", action="store_true", help="ignore sliding windows: every layer keeps every token")
    p.add_argument("--window", type=int_in(1, MAX_SEQ_LEN), metavar="W",
                   help="a run-time cache window on every layer: keep the last W positions (kvviz's --window)")
    p.add_argument("--sinks", type=types.sinks, default=0, metavar="S",
                   help="with --window: also keep the first S positions forever (StreamingLLM keeps 4; default 0)")
    p.add_argument("--params", type=types.param_count, metavar="COUNT",
                   help="parameter count (e.g. 6.7B); overrides the config's, needed when it is unknown")
    p.add_argument("--gpu", type=types.gib, metavar="GIB",
                   help=f"GPU memory in GiB for the fit check ({', '.join(map(str, GPU_PRESETS_GIB))} or any)")
    p.add_argument("--reserve", type=types.fraction, default=DEFAULT_RESERVE,
                   help=f"fraction of the GPU kept free for activations and the CUDA context (default {DEFAULT_RESERVE})")
    p.add_argument("--tp", type=_tp, default=1, metavar="N",
                   help="tensor-parallel GPUs: per-GPU KV and weights, KV heads replicated when N > KV heads")
    p.add_argument("--state-dtype", choices=STATE_DTYPES, default="auto",
                   help="linear-attention / Mamba state dtype (default auto: the weight dtype when it is a float)")
    p.add_argument("--gpu-model", choices=tuple(load_gpus()), metavar="GPU",
                   help=f"a GPU preset ({', '.join(load_gpus())}): its memory (unless --gpu), bandwidth and price")
    p.add_argument("--bandwidth", type=types.bandwidth, metavar="GB/S",
                   help="peak memory bandwidth of one GPU in GB/s: adds the decode roofline's tokens/s")
    p.add_argument("--price", type=types.price, metavar="USD",
                   help="dollars per GPU-hour: adds the cost per 1M output tokens")
    p.add_argument("--efficiency", type=types.efficiency, default=DEFAULT_EFFICIENCY,
                   help=f"achieved / peak bandwidth for the roofline (default {DEFAULT_EFFICIENCY})")
    add_engine_arguments(p)
    p.add_argument("--json", action="store_true")


def _int_list(text: str) -> tuple[int, ...]:
    """'20,12' -> (20, 12), as vLLM reads VLLM_PP_LAYER_PARTITION (positive layer counts)."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"Invalid partition string: {text[:80]!r} (give layer counts, e.g. 20,12)")
    if not out or len(out) > MAX_TP or min(out) < 1:
        raise argparse.ArgumentTypeError(f"give 1 to {MAX_TP} positive layer counts, e.g. 20,12 (got {text[:80]!r})")
    return out


def _gib_list(text: str) -> tuple[float, ...]:
    """'10,6.5' -> (10.0, 6.5): each pipeline stage's available KV memory in GiB."""
    parts = text.split(",")
    if len(parts) > MAX_TP:
        raise argparse.ArgumentTypeError(f"at most {MAX_TP} stages")
    return tuple(types.gib(x) for x in parts)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--engine and the serve flags that decide each engine's sizing (see kvviz.calculator.servers)."""
    g = p.add_argument_group("engine sizing (vLLM, llama.cpp, SGLang)")
    g.add_argument("--engine", choices=ENGINES, help="size the KV cache as this engine allocates it")
    g.add_argument("--kv-cache-dtype", choices=tuple(dict.fromkeys((*DTYPES, *VLLM_KV_DTYPES))), metavar="DTYPE",
                   help="the engine's KV dtype (vLLM's --kv-cache-dtype; default --dtype; fp8 = 1 byte a value; "
                        "vLLM's scaled formats: " + ", ".join(VLLM_KV_DTYPES[6:]) + ")")
    g.add_argument("--kv-memory-gib", type=types.gib, metavar="GIB",
                   help="vLLM: its 'Available KV cache memory' (exact blocks); SGLang: the memory left for the pool")
    g.add_argument("--max-model-len", type=int_in(1, MAX_SEQ_LEN), metavar="L",
                   help="vLLM --max-model-len / llama.cpp -c (default: --seq-len)")
    g.add_argument("--max-num-batched-tokens", type=int_in(1, MAX_SEQ_LEN), metavar="N",
                   help="vLLM: tokens per scheduler step (the sliding groups' share; default `vllm serve`'s: "
                        "8192 on >= 70 GiB GPUs but the A100, else 2048)")
    g.add_argument("--pp", type=_tp, default=None, metavar="N", help="vLLM pipeline-parallel stages (default 1)")
    g.add_argument("--pp-layer-partition", type=_int_list, metavar="N,N,...",
                   help="vLLM's VLLM_PP_LAYER_PARTITION: layers per pipeline stage (default: even shares)")
    g.add_argument("--stage-kv-memory-gib", type=_gib_list, metavar="G,G,...",
                   help="vLLM: each pipeline stage's 'Available KV cache memory' (default --kv-memory-gib on every "
                        "stage)")
    g.add_argument("--kv-cache-layout", choices=(*KV_CACHE_LAYOUTS, *LEGACY_LAYOUT_NAMES), metavar="LAYOUT",
                   help="vLLM's VLLM_KV_CACHE_LAYOUT: " + ", ".join(KV_CACHE_LAYOUTS) + " (NHD = LBNHC, HND = LBHNC); "
                        "BL*/BH*: block-outermost, mixed pages packed side by side (default: the backend's, LBNHC)")
    g.add_argument("--gpu-memory-utilization", type=types.efficiency, default=0.9, metavar="F",
                   help="vLLM: share of the GPU it may use, for the estimate without --kv-memory-gib (default 0.9)")
    g.add_argument("--no-hybrid-kv-cache-manager", action="store_true",
                   help="vLLM --disable-hybrid-kv-cache-manager: sliding layers keep every token")
    g.add_argument("--device", choices=DEVICES, default="cuda",
                   help="vLLM: cuda (default) or cpu, the CPU backend: block 128, --kv-memory-gib is "
                        "VLLM_CPU_KVCACHE_SPACE, no async scheduling, 'CPU KV cache size'")
    g.add_argument("--estimate-cudagraphs", action="store_true",
                   help="vLLM's VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1: the estimate subtracts CUDA graphs' memory")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="vLLM --no-async-scheduling: one batch in flight (PP batches under PP) instead of two")
    g.add_argument("--draft-config", type=Path, metavar="FILE",
                   help="vLLM and SGLang: a speculative draft model's config.json (EAGLE or a draft model): its "
                        "layers hold KV beside the target's (SGLang: a pool of its own, of the target's #tokens)")
    g.add_argument("--reconcile", metavar="LOG",
                   help="a startup log ('-' reads stdin): each KV line beside kvviz's (vLLM; llama.cpp or SGLang with "
                        "--engine llama.cpp / sglang)")
    g.add_argument("--lengths", metavar="CSV", help="vLLM: real requests' lengths (one a row, or a 'length' / "
                   "'prompt_tokens' + 'output_tokens' column): how many such requests the blocks hold at once")
    g.add_argument("--length-percentiles", metavar="P:T,...", help="vLLM: lengths as percentiles, e.g. 50:2000,90:8000")
    g.add_argument("--parallel", "-np", type=int_in(1, 256, "llama.cpp's n_seq_max"), default=1, metavar="S", help="llama.cpp -np (default 1)")
    g.add_argument("--cache-type-k", "-ctk", choices=tuple(CACHE_TYPES), help="llama.cpp -ctk (default from --dtype)")
    g.add_argument("--cache-type-v", "-ctv", choices=tuple(CACHE_TYPES), help="llama.cpp -ctv (default from --dtype)")
    g.add_argument("--swa-full", action="store_true",
                   help="llama.cpp --swa-full: sliding layers keep the whole context")
    g.add_argument("--kv-unified", action="store_true", help="llama.cpp --kv-unified: one cache shared by the -np seqs")
    g.add_argument("--ubatch-size", "-ub", type=int_in(1, MAX_SEQ_LEN), default=512, metavar="N",
                   help="llama.cpp -ub (n_ubatch, default 512): the sliding-window cache keeps window + N cells")
    g.add_argument("--batch-size", "-b", type=int_in(1, MAX_SEQ_LEN), default=2048, metavar="N",
                   help="llama.cpp -b (n_batch, default 2048): n_ubatch is at most this")
    g.add_argument("--flash-attn", "-fa", choices=("on", "off", "auto"), default="auto",
                   help="llama.cpp -fa (default auto: on where supported): off pads V rows and refuses a quantized V")
    g.add_argument("--mem-fraction-static", type=types.efficiency, default=0.9, metavar="F",
                   help="SGLang --mem-fraction-static (default 0.9)")
    g.add_argument("--avail-mem-gib", type=_gib_list, metavar="BEFORE,AFTER",
                   help="SGLang: its log's 'avail mem' figures at 'Load weight begin' and 'end' (GiB): "
                        "the pool's memory is AFTER - BEFORE x (1 - --mem-fraction-static)")
    g.add_argument("--page-size", type=int_in(1, MAX_BLOCK_SIZE), default=1, metavar="N",
                   help="SGLang --page-size (default 1): the pool is rounded down to whole pages")
    g.add_argument("--multimodal", action="store_true",
                   help="SGLang: the model has a vision/audio tower (its is_multimodal): SGLANG_VLM_CACHE_SIZE_MB "
                        "comes out of the pool's budget (SGLang 0.5.23)")
    g.add_argument("--mm-feature-transport", choices=MM_TRANSPORTS, default="cpu",
                   help="SGLang --mm-feature-transport (default cpu on one node): cuda_ipc / cuda_vmm also reserve "
                        "SGLANG_MM_FEATURE_CACHE_MB for a multimodal model")
    g.add_argument("--vlm-cache-size-mb", type=int_in(0, 1 << 30), default=VLM_CACHE_SIZE_MB, metavar="MIB",
                   help=f"SGLang's SGLANG_VLM_CACHE_SIZE_MB (default {VLM_CACHE_SIZE_MB})")
    g.add_argument("--mm-feature-cache-mb", type=int_in(0, 1 << 30), default=MM_FEATURE_CACHE_MB, metavar="MIB",
                   help=f"SGLang's SGLANG_MM_FEATURE_CACHE_MB (default {MM_FEATURE_CACHE_MB})")


def _list(presets: dict[str, ModelSpec]) -> tuple[dict[str, Any], str]:
    rows = [{"key": k, "name": s.name, "attention": s.attention, "n_layers": s.n_layers, "n_heads": s.n_heads,
             "n_kv_heads": None if s.mla else s.n_kv_heads, "head_dim": s.head_dim, "params": s.params,
             "max_position_embeddings": s.max_positions, "source": s.source} for k, s in presets.items()]
    text = "\n".join(f"{r['key']:24} {r['attention']:4} {r['name']}  <{r['source']}>" for r in rows)
    return {"presets": rows}, text


def _list_gpus() -> tuple[dict[str, Any], str]:
    rows = [{"key": g.key, "name": g.name, "memory_gib": g.memory_gib, "usable_mib": g.usable_mib,
             "bandwidth_gbs": g.bandwidth_gbs,
             "price_per_hour": g.price_per_hour, "source": g.source} for g in load_gpus().values()]
    text = "\n".join(f"{r['key']:10} {r['memory_gib']:>4} GiB "
                     f"({format(r['usable_mib'], ',') if r['usable_mib'] else '?':>7} MiB usable) "
                     f"{r['bandwidth_gbs']:>6,.0f} GB/s "
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
    engine = getattr(args, "engine", None)
    if args.seq_len is None and engine is not None and args.max_model_len is not None:
        args.seq_len = args.max_model_len
    if args.seq_len is None and getattr(args, "reconcile", None) is None:
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
        if getattr(args, "reconcile", None) is not None:
            return _reconcile(args, spec)
        req = MemoryRequest(
            seq_len=args.seq_len, batch=args.batch, beams=args.beams, kv_dtype=args.dtype,
            weight_dtype=weight_dtype(args), group_size=args.group_size, scale_dtype=args.scale_dtype,
            zero_point=args.zero_point, paged=args.paged, block_size=args.block_size or DEFAULT_BLOCK_SIZE,
            use_windows=not args.no_windows, params=args.params, reserve=args.reserve, tp=args.tp,
            state_dtype=args.state_dtype, efficiency=args.efficiency, **_gpu_settings(args),
        )
        res = calculate(spec, req)
        engine_out = _engine(args, spec, res.params) if engine else None
    except CalcError as e:
        raise KVVizError(str(e)) from None
    out = res.to_dict()
    out["engine"] = None if engine_out is None else engine_out[0]
    out["cache_window"] = None if args.window is None else {"window": args.window, "sinks": args.sinks,
                                                            "positions_held": args.window + args.sinks}
    return out, summary_text(res) + ("" if engine_out is None else "\n" + engine_out[1])


def _engine_request(args: argparse.Namespace, params: int | None) -> EngineRequest:
    gpu = _gpu_settings(args)["gpu_gib"]
    if args.gpu is None and args.gpu_model is not None:
        gpu = load_gpus()[args.gpu_model].usable_gib  # an engine sizes against what nvidia-smi reports
    return EngineRequest(
        engine=args.engine, max_model_len=args.max_model_len or args.seq_len,
        kv_dtype=args.kv_cache_dtype or args.dtype,
        kv_memory_gib=args.kv_memory_gib, gpu_gib=gpu, weight_dtype=weight_dtype(args), params=params, tp=args.tp,
        pp=args.pp or len(args.pp_layer_partition or args.stage_kv_memory_gib or (1,)), block_size=args.block_size or default_block_size(args.device),
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_name=load_gpus()[args.gpu_model].name if args.gpu_model else "",
        gpu_memory_utilization=args.gpu_memory_utilization, hybrid=not args.no_hybrid_kv_cache_manager,
        n_seq=args.parallel, type_k=args.cache_type_k, type_v=args.cache_type_v, swa_full=args.swa_full,
        kv_unified=args.kv_unified, mem_fraction_static=args.mem_fraction_static, lengths=_lengths(args),
        device=args.device, async_scheduling=not args.no_async_scheduling, draft=_draft(args),
        n_ubatch=args.ubatch_size, n_batch=args.batch_size, flash_attn=args.flash_attn != "off",
        cudagraph_estimate=args.estimate_cudagraphs, pp_layers=args.pp_layer_partition or (),
        stage_memory_gib=args.stage_kv_memory_gib or (), avail_mem_gib=_before_after(args.avail_mem_gib),
        page_size=args.page_size, kv_cache_layout=args.kv_cache_layout, multimodal=args.multimodal,
        mm_feature_transport=args.mm_feature_transport, vlm_cache_size_mb=args.vlm_cache_size_mb,
        mm_feature_cache_mb=args.mm_feature_cache_mb)


def _before_after(v: tuple[float, ...] | None) -> tuple[float, float] | None:
    if v is not None and len(v) != 2:
        raise CalcError([f"--avail-mem-gib takes two figures, BEFORE,AFTER loading the weights (got {len(v)})"])
    return None if v is None else (v[0], v[1])


def _draft(args: argparse.Namespace) -> ModelSpec | None:
    """--draft-config FILE: the draft's shape, read like any config.json (errors name the file)."""
    return None if args.draft_config is None else load_config_file(args.draft_config)


def _lengths(args: argparse.Namespace) -> tuple[int, ...]:
    if args.lengths is not None and args.length_percentiles is not None:
        raise CalcError(["give --lengths or --length-percentiles, not both"])
    if args.lengths is not None:
        from kvviz.safeio import read_bounded

        return tuple(parse_lengths_csv(read_bounded(args.lengths, 50_000_000, "the lengths file")
                                       .decode("utf-8", errors="replace")))
    if args.length_percentiles is not None:
        return tuple(lengths_from_percentiles(parse_percentiles(args.length_percentiles)))
    return ()


def _engine(args: argparse.Namespace, spec: ModelSpec, params: int | None) -> tuple[dict[str, Any], str]:
    return engine_report(spec, _engine_request(args, params))


def _read_log(where: str) -> str:
    import sys

    from kvviz.safeio import read_bounded

    if where == "-":
        text = sys.stdin.read(MAX_LOG_CHARS + 1)
    else:
        text = read_bounded(where, MAX_LOG_CHARS, "the log").decode("utf-8", errors="replace")
    return text


def _reconcile_other(args: argparse.Namespace, spec: ModelSpec, text: str) -> tuple[dict[str, Any], str]:
    """--engine llama.cpp / sglang --reconcile LOG (server_log_engines): the log's cache lines beside kvviz's."""
    if args.engine == "llama.cpp":
        rows, notes = reconcile_llamacpp(spec, parse_llamacpp_log(text), args.max_model_len)
    else:
        rows, notes = reconcile_sglang(spec, parse_sglang_log(text), args.tp if args.tp != 1 else None,
                                       args.kv_cache_dtype)
    out = {"model": spec.name, "engine": args.engine, "rows": [r.to_dict() for r in rows],
           "agrees": all(r.agrees for r in rows), "notes": notes}
    return out, f"{spec.name} vs the {args.engine} log:\n" + reconcile_text(rows, notes)


def _reconcile(args: argparse.Namespace, spec: ModelSpec) -> tuple[dict[str, Any], str]:
    """--reconcile LOG: the log's KV lines beside kvviz's prediction (vLLM; llama.cpp or SGLang with --engine)."""
    if args.engine in ("llama.cpp", "sglang"):
        return _reconcile_other(args, spec, _read_log(args.reconcile))
    log = parse_vllm_log(_read_log(args.reconcile))
    given = {"max_model_len": args.max_model_len, "tp": args.tp if args.tp != 1 else None, "pp": args.pp,
             "block_size": args.block_size,
             "max_num_batched_tokens": args.max_num_batched_tokens,
             "kv_dtype": args.kv_cache_dtype}
    flags, said = settings_from_log(log, given)
    if not log.found:
        reconcile(spec, log, VLLMSettings(0, 1))  # raises the sentence for a log without a KV line
    if flags.get("max_model_len") is None:
        raise KVVizError("the log does not say max_model_len: give --max-model-len")
    device = "cpu" if log.device == "CPU" else args.device
    s = VLLMSettings(0, flags["max_model_len"], flags.get("block_size") or default_block_size(device),
                     flags.get("tp") or 1, flags.get("pp") or 1, flags.get("kv_dtype") or "bf16",
                     flags.get("max_num_batched_tokens") or DEFAULT_BATCHED_TOKENS, not args.no_hybrid_kv_cache_manager,
                     device, not args.no_async_scheduling, _draft(args))
    rows, notes = reconcile(spec, log, s)
    params = args.params if args.params is not None else spec.params
    weights = None if params is None else -(-weight_bytes(params, weight_dtype(args)) // (s.tp * s.pp))
    rows += profile_rows(log, weights, estimate_parts(spec, EngineRequest(
        "vllm", s.max_model_len, tp=s.tp, max_num_batched_tokens=s.max_num_batched_tokens)))
    notes = said + notes
    out = {"model": spec.name, "engine": "vllm", "settings": {"max_model_len": s.max_model_len,
           "block_size": s.block_size, "tp": s.tp, "pp": s.pp, "kv_dtype": s.kv_dtype,
           "max_num_batched_tokens": s.max_num_batched_tokens}, "rows": [r.to_dict() for r in rows],
           "agrees": all(r.agrees for r in rows), "notes": notes}
    return out, f"{spec.name} vs the vLLM log:\n" + reconcile_text(rows, notes)
