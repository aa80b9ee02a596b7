"""One entry to the three engines' sizings, for the CLI and the page: the settings in, the JSON
``engine`` object and the text out. The available KV memory is either given (what vLLM logs; exact)
or estimated from a GPU and the weights (each part shown, with its uncertainty).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvviz.calculator.server_llamacpp import llamacpp_sizing
from kvviz.calculator.server_mix import length_mix
from kvviz.calculator.server_sglang import (
    MM_FEATURE_CACHE_MB, MM_TRANSPORTS, VLM_CACHE_SIZE_MB, draft_layers, mm_reserve_gib, no_room_error, rest_parts,
    sglang_draft_pool, sglang_rest, sglang_rest_logged, sglang_sizing,
)
from kvviz.calculator.server_vllm import VLLMSettings, vllm_sizing
from kvviz.calculator.server_vllm_defaults import default_batched_tokens
from kvviz.calculator.formulas import weight_bytes
from kvviz.calculator.spec import CalcError, ModelSpec
from kvviz.units import GIB

ENGINES = ("vllm", "llama.cpp", "sglang")
KV_DTYPE_NAMES = {"fp16": "f16", "bf16": "bf16", "fp32": "f32", "int8": "q8_0", "int4": "q4_0"}  # -> llama.cpp's
# The parts of vLLM's budget the config cannot give, with the spread seen in logs: (GiB, +- GiB).
NON_TORCH_GIB = (0.5, 0.4)  # CUDA context, NCCL buffers: the "non_torch_memory" of vLLM's profiling line
CUDA_GRAPHS_GIB = (0.5, 0.5)  # captured graphs, subtracted only with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1
# Peak activation bytes per batched token per hidden unit, +- half of it. vllm#10517's profiles of
# Llama-3.1-8B (hidden 4,096) give 27: 17.06 - 14.99 = 2.07 GiB at 20,000 tokens, 2.99 GiB at 29,000.
ACTIVATION_FACTOR = (27, 14)


@dataclass(frozen=True)
class EngineRequest:
    engine: str
    max_model_len: int
    kv_dtype: str = "bf16"
    kv_memory_gib: float | None = None  # vLLM: "Available KV cache memory"; SGLang: its rest memory
    gpu_gib: float | None = None  # for the estimate when kv_memory_gib is None
    weight_dtype: str = "bf16"
    params: int | None = None
    tp: int = 1
    pp: int = 1
    block_size: int = 16
    max_num_batched_tokens: int | None = None  # None: `vllm serve`'s default for the GPU
    gpu_name: str = ""  # the preset's name, for vLLM's A100 exception
    gpu_memory_utilization: float = 0.9
    hybrid: bool = True
    n_seq: int = 1  # llama.cpp -np
    type_k: str | None = None  # llama.cpp -ctk (default: from kv_dtype)
    type_v: str | None = None
    swa_full: bool = False
    kv_unified: bool = False
    mem_fraction_static: float = 0.9
    page_size: int = 1  # SGLang
    lengths: tuple[int, ...] = ()  # vLLM: real requests' prompt + output lengths, to size from the mix
    device: str = "cuda"  # vLLM --device cpu: the CPU backend (block 128, VLLM_CPU_KVCACHE_SPACE)
    async_scheduling: bool = True  # vLLM --no-async-scheduling: False
    draft: ModelSpec | None = None  # vLLM --speculative-config's draft model (kvviz: --draft-config FILE)
    n_ubatch: int = 512  # llama.cpp -ub
    n_batch: int = 2048  # llama.cpp -b
    flash_attn: bool = True  # llama.cpp -fa (auto: on where the backend supports it)
    cudagraph_estimate: bool = False  # vLLM: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 (and graphs captured)
    pp_layers: tuple[int, ...] = ()  # vLLM: VLLM_PP_LAYER_PARTITION
    stage_memory_gib: tuple[float, ...] = ()  # vLLM: each pipeline stage's available KV memory
    avail_mem_gib: tuple[float, float] | None = None  # SGLang's "avail mem" before and after loading the weights
    kv_cache_layout: str | None = None  # vLLM: VLLM_KV_CACHE_LAYOUT (None: the backend's default)
    multimodal: bool = False  # SGLang: model_config.is_multimodal (a vision/audio tower): the reserve applies
    mm_feature_transport: str = "cpu"  # SGLang --mm-feature-transport (single node: cpu unless asked)
    vlm_cache_size_mb: int = VLM_CACHE_SIZE_MB  # SGLANG_VLM_CACHE_SIZE_MB
    mm_feature_cache_mb: int = MM_FEATURE_CACHE_MB  # SGLANG_MM_FEATURE_CACHE_MB


@dataclass(frozen=True)
class Estimate:
    """vLLM's available KV memory estimated from the GPU: each part, the total and its spread."""

    parts: tuple[tuple[str, int, int], ...]  # (what, bytes, +- bytes)
    available: int
    spread: int

    def to_dict(self) -> dict[str, Any]:
        return {"parts": [{"what": w, "bytes": b, "uncertainty_bytes": u} for w, b, u in self.parts],
                "available_bytes": self.available, "uncertainty_bytes": self.spread,
                "kind": "estimate: only the tokens from a logged available memory are exact"}


def estimate_parts(spec: ModelSpec, r: EngineRequest) -> dict[str, tuple[int, int]]:
    """The estimate's parts the profiling line measures: (bytes, +- bytes) for the activation peak and
    the non-torch memory, per GPU."""
    f, df = ACTIVATION_FACTOR
    n = batched_tokens(r) * spec.hidden // max(1, r.tp)
    nt, dnt = (int(x * GIB) for x in NON_TORCH_GIB)
    return {"activation": (n * f, n * df), "non_torch": (nt, dnt)}


def batched_tokens(r: EngineRequest) -> int:
    return r.max_num_batched_tokens or default_batched_tokens(r.gpu_gib, r.gpu_name, r.device, r.tp * r.pp)


def vllm_estimate(spec: ModelSpec, r: EngineRequest) -> Estimate:
    """ceil(GPU x utilization) - the profiled non-KV memory (weights, activation peak, non-torch), per GPU
    (vLLM 0.33 v1/worker/utils.py:716-726 request_memory; v1/worker/gpu_worker.py:702-757). The CUDA
    graphs' memory is subtracted only when VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is set (an opt-in,
    gpu_worker.py:717-722); the profiled parts are estimated here, each with its spread."""
    if r.gpu_gib is None:
        raise CalcError(["give --kv-memory-gib (vLLM's 'Available KV cache memory' line) or a GPU (--gpu-model or "
                         "--gpu) to estimate it"])
    params = r.params if r.params is not None else spec.params
    if params is None:
        raise CalcError(["the weights are unknown for this config: give --params to estimate the available memory"])
    gpu = int(r.gpu_gib * GIB)
    budget = math.ceil(gpu * r.gpu_memory_utilization)
    weights = -(-weight_bytes(params, r.weight_dtype) // (r.tp * r.pp))
    f, df = ACTIVATION_FACTOR
    act = batched_tokens(r) * spec.hidden * f // max(1, r.tp)
    dact = batched_tokens(r) * spec.hidden * df // max(1, r.tp)
    nt, dnt = (int(x * GIB) for x in NON_TORCH_GIB)
    cg, dcg = (int(x * GIB) for x in CUDA_GRAPHS_GIB) if r.cudagraph_estimate else (0, 0)
    parts = (("ceil(GPU memory x gpu_memory_utilization)", budget, 0),
             ("- weights (per GPU, split evenly)", -weights, 0),
             (f"- activation peak for {batched_tokens(r):,} batched tokens", -act, dact),
             ("- non-torch memory (CUDA context, NCCL)", -nt, dnt),
             ("- CUDA graphs (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1)" if r.cudagraph_estimate else
              "- CUDA graphs: not subtracted (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is off by default)", -cg, dcg))
    return Estimate(parts, sum(b for _, b, _ in parts), sum(u for _, _, u in parts))


def engine_provenance(spec: ModelSpec, r: EngineRequest) -> dict[str, str]:
    """Where each input of the engine's figures came from: the config (via the model's own provenance)
    or the flag, with the engine's default named."""
    p = dict(spec.provenance)
    out = {"layers": p.get("n_layers", "config"), "head_dim": p.get("head_dim", "config"),
           "max_model_len": f"{r.max_model_len:,}: --max-model-len (or --seq-len)",
           "kv_dtype": f"{r.kv_dtype}: --kv-cache-dtype (or --dtype)",
           "tp": f"{r.tp}: --tp"}
    if spec.mla is None:
        out["kv_heads_per_gpu"] = f"max(1, n_kv_heads // tp {r.tp}); n_kv_heads: {p.get('n_kv_heads', 'config')}"
    else:
        out["latent"] = f"kv_lora_rank: {p.get('kv_lora_rank')}; qk_rope_head_dim: {p.get('qk_rope_head_dim')}"
    for key in ("sliding_window", "attention_chunk_size", "layer kinds"):
        if key in p:
            out[key] = p[key]
    if r.engine == "vllm":
        out["block_size"] = f"{r.block_size}: --block-size (vLLM's default 16)"
        out["max_num_batched_tokens"] = (f"{batched_tokens(r):,}: --max-num-batched-tokens" if r.max_num_batched_tokens
                                         else f"{batched_tokens(r):,}: `vllm serve`'s default for this device (16,384 "
                                              "on >= 160 GiB GPUs, 8,192 on >= 70 GiB ones but the A100 and GB10, "
                                              "2,048 on others, without a GPU and per CPU worker)")
        out["device"] = f"{r.device}: --device" + (" (block 128, VLLM_CPU_KVCACHE_SPACE)" if r.device == "cpu" else "")
        if r.draft is not None:
            out["draft"] = f"{r.draft.name}: --draft-config ({r.draft.kv_layers} layers with KV)"
        out["available_kv_bytes"] = ("--kv-memory-gib: vLLM's 'Available KV cache memory' line"
                                     if r.kv_memory_gib is not None else
                                     "estimated: GPU x --gpu-memory-utilization - weights - activations - overheads")
    return out


MAX_KV_GIB = 1_000_000  # as the calculator's gpu_gib: beyond it a GiB figure is a typo (and 1e300 overflows int)


def engine_request_problems(r: EngineRequest) -> list[str]:
    """What no engine could be given: checked before any float becomes a byte count."""
    for g in (r.kv_memory_gib, *r.stage_memory_gib):
        if g is not None and (not isinstance(g, (int, float)) or not math.isfinite(g) or not 0 < g <= MAX_KV_GIB):
            return [f"the KV memory must be a positive number of GiB up to {MAX_KV_GIB:,} (got {g!r})"]
    if r.mm_feature_transport not in MM_TRANSPORTS:
        return [f"--mm-feature-transport is one of {', '.join(MM_TRANSPORTS)} (got {r.mm_feature_transport!r})"]
    for name, mb in (("SGLANG_VLM_CACHE_SIZE_MB", r.vlm_cache_size_mb), ("SGLANG_MM_FEATURE_CACHE_MB", r.mm_feature_cache_mb)):
        if not isinstance(mb, int) or not 0 <= mb <= MAX_KV_GIB * 1024:
            return [f"{name} must be a whole number of MiB (SGLang's MB) from 0 to {MAX_KV_GIB * 1024:,} (got {mb!r})"]
    return []


def engine_report(spec: ModelSpec, r: EngineRequest) -> tuple[dict[str, Any], str]:
    """(the JSON ``engine`` object, the text) for one engine, with where its inputs came from."""
    problems = engine_request_problems(r)
    if problems:
        raise CalcError(problems)
    d, text = _engine_report(spec, r)
    d["provenance"] = engine_provenance(spec, r)
    return d, text


def _engine_report(spec: ModelSpec, r: EngineRequest) -> tuple[dict[str, Any], str]:
    if r.engine == "vllm":
        return _vllm(spec, r)
    if r.engine == "llama.cpp" and r.draft is not None:
        raise CalcError(["--draft-config is sized for vLLM and SGLang only: llama.cpp keeps a draft's cache in a "
                         "separate context, which kvviz does not model yet"])
    if r.engine == "llama.cpp":
        tk = r.type_k or KV_DTYPE_NAMES.get(r.kv_dtype)
        tv = r.type_v or KV_DTYPE_NAMES.get(r.kv_dtype)
        if tk is None or tv is None:
            raise CalcError([f"llama.cpp has no {r.kv_dtype} cache type: use -ctk/-ctv (--cache-type-k/v)"])
        ll = llamacpp_sizing(spec, r.max_model_len, r.n_seq, tk, tv, r.swa_full, r.kv_unified, r.n_ubatch,
                             r.flash_attn, r.n_batch)
        text = [f"llama.cpp: -c {r.max_model_len:,} -np {r.n_seq} -ub {r.n_ubatch} -fa {'on' if r.flash_attn else 'off'}, "
                f"K {tk}, V {tv}: {ll.total_bytes:,} B = "
                f"{ll.total_bytes / GIB:,.2f} GiB", *ll.lines, *(f"note: {n}" for n in ll.notes)]
        return ll.to_dict(), "\n".join(text)
    if r.engine == "sglang":
        return _sglang(spec, r)
    raise CalcError([f"unknown engine {r.engine!r}; choose one of {', '.join(ENGINES)}"])


def _sglang(spec: ModelSpec, r: EngineRequest) -> tuple[dict[str, Any], str]:
    """SGLang 0.5.23's pool (server_sglang): the budget given, from the log's avail mem, or estimated."""
    mm, mm_line = mm_reserve_gib(r.multimodal, r.mm_feature_transport, r.vlm_cache_size_mb, r.mm_feature_cache_mb)
    parts = None
    if r.kv_memory_gib is not None:
        rest, how, exact = int(r.kv_memory_gib * GIB), f"{r.kv_memory_gib:g} GiB (given)", True
    else:
        if r.avail_mem_gib is not None:
            before, after = r.avail_mem_gib
            (rest, how), exact = sglang_rest_logged(before, after, r.mem_fraction_static, mm), True
        else:
            if r.gpu_gib is None:
                raise CalcError(["give --kv-memory-gib (SGLang's rest memory) or a GPU to estimate it"])
            params = r.params if r.params is not None else spec.params
            if params is None:
                raise CalcError(["the weights are unknown for this config: give --params"])
            w = -(-weight_bytes(params, r.weight_dtype) // r.tp)
            if w >= int(r.gpu_gib * GIB):
                raise CalcError([f"the weights ({w / GIB:,.2f} GiB a GPU) do not fit in the GPU's {r.gpu_gib:g} GiB: "
                                 "SGLang fails while loading them, before it sizes any pool"])
            before, after = r.gpu_gib, (int(r.gpu_gib * GIB) - w) / GIB
            rest, how = sglang_rest(int(r.gpu_gib * GIB), w, r.mem_fraction_static, mm)
            exact = False
        parts = rest_parts(before, after, r.mem_fraction_static, mm)
        if rest <= 0:  # kv_cache_configurator.py:3043-3058
            raise CalcError([no_room_error(before, after, r.mem_fraction_static) + f" (SGLang's error: {how})"])
    dl = draft_layers(r.draft) if r.draft is not None else (0, 0)
    sg = sglang_sizing(spec, rest, r.tp, r.kv_dtype, r.page_size, exact, how, r.hybrid, draft=dl)
    d = sg.to_dict()
    d["mem_fraction_static"] = r.mem_fraction_static
    d["rest_parts"] = parts
    d["mm_reserve_bytes"] = int(mm * GIB)
    lines = ([mm_line] if mm_line else []) + [sg.line]
    d["draft"] = None
    if r.draft is not None:  # the draft worker's own pool of the target's #tokens
        dk, dv, dline = sglang_draft_pool(r.draft, sg.tokens, r.tp, r.kv_dtype, r.page_size)
        d["draft"] = {"k_bytes": dk, "v_bytes": dv, "log_line": dline, "layers": r.draft.kv_layers}
        lines += [f"the draft worker's pool ({r.draft.kv_layers} layer(s), the target's #tokens):", dline]
    shown = [f"  {p['what']}: {p['gib']:+,.4f} GiB" for p in parts] if parts else []
    return d, "\n".join(["SGLang 0.5.23:", *shown, *sg.formula, *lines, *(f"note: {n}" for n in sg.notes)])


def _vllm(spec: ModelSpec, r: EngineRequest) -> tuple[dict[str, Any], str]:
    est = None
    if r.device == "cpu":
        # platforms/cpu.py:341-344: the budget is int(VLLM_CPU_KVCACHE_SPACE) GiB; nothing is profiled
        g = r.kv_memory_gib
        if g is None or g != int(g):
            raise CalcError(["the CPU backend's KV budget is VLLM_CPU_KVCACHE_SPACE, a whole number of GiB: give "
                             f"--kv-memory-gib N (got {g!r})"])
    if r.kv_memory_gib is not None:
        avail = int(r.kv_memory_gib * GIB)
    elif r.stage_memory_gib:  # each stage's own memory given: the first is the line's figure
        avail = int(r.stage_memory_gib[0] * GIB)
    else:
        est = vllm_estimate(spec, r)
        avail = est.available
        if avail <= 0:
            raise CalcError([f"the estimate leaves no memory for the KV cache ({avail / GIB:,.2f} GiB): vLLM would "
                             "say 'No available memory for the cache blocks'"])
    v = vllm_sizing(spec, VLLMSettings(avail, r.max_model_len, r.block_size, r.tp, r.pp, r.kv_dtype,
                                       batched_tokens(r), r.hybrid, r.device, r.async_scheduling, r.draft,
                                       pp_layers=r.pp_layers, stage_memory=tuple(int(g * GIB)
                                                                                 for g in r.stage_memory_gib),
                                       kv_cache_layout=r.kv_cache_layout))
    d = v.to_dict()
    mix = length_mix(v, r.lengths) if r.lengths else None
    d["length_mix"] = None if mix is None else mix.to_dict()
    d["available_kv_source"] = "given (exact)" if est is None else "estimated from the GPU"
    d["estimate"] = None if est is None else est.to_dict()
    text = [f"vLLM ({'CPU backend, ' if r.device == 'cpu' else ''}block {r.block_size}, KV {r.kv_dtype}, tp {r.tp}, "
            f"pp {r.pp}{', draft ' + r.draft.name if r.draft is not None else ''}):"]
    if est is not None:
        text += [f"  {w}: {b / GIB:+,.2f} GiB" + (f" (+- {u / GIB:.2f})" if u else "") for w, b, u in est.parts]
        text.append(f"  = available {avail / GIB:,.2f} GiB +- {est.spread / GIB:.2f} (an estimate; give "
                    "--kv-memory-gib from the log for exact blocks)")
    text += [f"  {ln}" for ln in v.formula]
    text += v.lines
    if mix is not None:
        text.append(mix.text())
    text += [f"note: {n}" for n in v.notes]
    return d, "\n".join(text)
