"""SGLang's token pool: how many tokens ``--mem-fraction-static`` leaves room for, in SGLang's
"KV Cache is allocated" line.

Followed from SGLang 0.5.23 (the PyPI wheel; paths under python/sglang/srt/):

- rest (the pool's budget) = the GPU memory free after loading the weights - the memory free before
  loading x (1 - mem_fraction_static) - the multimodal reserve, in GB of 2^30, then int(x 2^30)
  (mem_cache/kv_cache_configurator.py:2990-3060 _profile_available_bytes); its log's "Load weight
  begin/end. avail mem=X GB" are the two free figures (--avail-mem-gib BEFORE,AFTER). The reserve is 0 for a
  text model; for a multimodal one SGLANG_VLM_CACHE_SIZE_MB (100) plus, when --mm-feature-transport is
  cuda_ipc or cuda_vmm, SGLANG_MM_FEATURE_CACHE_MB (1024), in MB / 1024 (:202-219 mm_runtime_reservation_gb;
  environ.py:1598, 1622), logged as "Reserving X GB of the KV budget for post-sizing multimodal ...".
  A rest <= 0 is SGLang's "Loaded weights leave no GPU memory for the KV cache" error (:3043-3058).
- cell = KV heads per GPU (max(1, KV heads // TP)) x (head_dim + v_head_dim) x layers x dtype bytes; under
  MLA (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes (model_executor/pool_configurator.py:378-392,
  490-497). With a speculative draft (EAGLE or a draft model: kvviz's --draft-config) the target's cell
  also carries the draft's layers at the target's per-layer size: cell += int(cell x draft layers / layers)
  (:259-320), so the target's pool and the draft's share the budget.
- #tokens = max(rest - the fixed overhead, 0) // cell, rounded down to the page size (:637-647
  DefaultPoolConfigurator.calculate_pool_sizes). The fixed overhead is the page-shard scratch, charged only
  under --enable-kv-cache-sharding (a PD-prefill option: :251-256, mem_cache/page_interleave.py:245-272),
  so it is 0 here.
- hybrid sliding-window models (gpt-oss, Llama 4, MiMo-V2, Step-3.5) have a full pool and a sliding pool of
  swa_full_tokens_ratio (0.8) as many tokens: cell = F x (full + draft full layers) + 0.8 x S x (sliding +
  draft sliding layers), full = int(rest // cell) page-aligned, sliding = int(full x 0.8) page-aligned
  (:656-803, 859-916); a sliding pool that cannot hold window + one page is SGLang's "SWA pool ... cannot
  hold even one request" error (:198-216). No fixed overhead is taken on this path.
- the pool allocates #tokens + page_size cells (slot 0 is a padding token) and logs "KV Cache is allocated.
  dtype: torch.bfloat16, #tokens: N, K size: X GB, V size: Y GB" (MLA: "KV size"), GB = 2^30 bytes
  (mem_cache/memory_pool.py:2083-2100); SGLang before 0.5.x printed the line without the dtype.
- the draft worker takes the target's resolved MemoryPoolConfig (kv_cache_configurator.py:470-476) and
  builds a pool of its own layers of the target's #tokens, which prints its own line.
Unlike vLLM, SGLang sizes the pool before any profiling run: the activations must fit in the
1 - mem_fraction_static left over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvviz.calculator.spec import CalcError, ModelSpec
from kvviz.units import GIB

SGLANG_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
# The pool's torch dtype, as the line prints it (memory_pool.py:2088: f"dtype: {self.dtype}"); kvviz's fp8 is
# --kv-cache-dtype fp8_e4m3 (stored as uint8, but self.dtype stays the fp8 type: memory_pool.py:2027-2033).
SGLANG_TORCH_DTYPES = {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16",
                       "fp8": "torch.float8_e4m3fn"}
SOURCES = ("python/sglang/srt/mem_cache/kv_cache_configurator.py", "python/sglang/srt/model_executor/pool_configurator.py",
           "python/sglang/srt/mem_cache/memory_pool.py", "python/sglang/srt/configs/model_config.py")
# kvviz's model_type for the architectures 0.5.10.post1's model_config.py:1438-1448 named; 0.5.23's
# is_hybrid_swa_model (configs/model_config.py:2651-2697) names these too (Llama 4 as its ConditionalGeneration).
HYBRID_SWA_TYPES = ("gpt_oss", "llama4", "llama4_text", "mimo_v2_flash", "step3p5")
SWA_FULL_TOKENS_RATIO = 0.8  # arg_groups/fields/schedule.py:150-162 (fallback=0.8)
MM_TRANSPORTS = ("cpu", "cuda_ipc", "cuda_vmm")  # arg_groups/fields/mm.py:144-158
VLM_CACHE_SIZE_MB = 100  # SGLANG_VLM_CACHE_SIZE_MB, environ.py:1598
MM_FEATURE_CACHE_MB = 1024  # SGLANG_MM_FEATURE_CACHE_MB, environ.py:1622
FIXED_OVERHEAD_NOTE = ("fixed overhead = 0 B (the page-shard scratch, charged only under --enable-kv-cache-sharding: "
                       "pool_configurator.py:251-256, 640)")


@dataclass(frozen=True)
class SGLangSizing:
    rest_bytes: int
    cell_bytes: int
    tokens: int
    page_size: int
    k_bytes: int
    v_bytes: int  # 0 under MLA (one latent buffer)
    line: str
    formula: tuple[str, ...]
    exact: bool  # True when the rest memory was given, not estimated
    notes: tuple[str, ...] = ()
    swa_tokens: int | None = None  # the sliding pool of a hybrid SWA model (None: one pool)
    draft_layers: int = 0  # a speculative draft's layers, carried in the target's cell (0.5.23)

    def to_dict(self) -> dict[str, Any]:
        return {"name": "sglang", "rest_bytes": self.rest_bytes, "cell_bytes": self.cell_bytes,
                "max_total_num_tokens": self.tokens, "page_size": self.page_size, "k_bytes": self.k_bytes,
                "v_bytes": self.v_bytes, "log_line": self.line, "formula": list(self.formula),
                "exact": self.exact, "notes": list(self.notes), "sources": list(SOURCES),
                "swa_max_total_num_tokens": self.swa_tokens, "fixed_overhead_bytes": 0,
                "draft_layers_in_cell": self.draft_layers}


def pool_line(tokens: int, kv_dtype: str, k: int, v: int, mla: bool) -> str:
    """SGLang's "KV Cache is allocated" line (memory_pool.py:2083-2100), sizes in GB of 2^30."""
    head = f"KV Cache is allocated. dtype: {SGLANG_TORCH_DTYPES[kv_dtype]}, #tokens: {tokens}, "
    return head + (f"KV size: {k / GIB:.2f} GB" if mla else f"K size: {k / GIB:.2f} GB, V size: {v / GIB:.2f} GB")


def sglang_sizing(spec: ModelSpec, rest_bytes: int, tp: int = 1, kv_dtype: str = "bf16", page_size: int = 1,
                  exact: bool = True, how: str = "", hybrid_swa: bool = True,
                  swa_ratio: float = SWA_FULL_TOKENS_RATIO, draft: tuple[int, int] = (0, 0)) -> SGLangSizing:
    """The pool for ``rest_bytes`` of KV memory on each GPU (SGLang's rest_memory). ``draft``: a speculative
    draft's (layers, sliding layers), whose KV the target's cell carries (pool_configurator.py:259-320, 731-763)."""
    problems = []
    if kv_dtype not in SGLANG_DTYPE_BYTES:
        problems.append(f"SGLang's KV cache is fp16, bf16, fp32 or fp8; {kv_dtype} is not one of them")
    if spec.linear_layers:
        problems.append("linear / Mamba layers keep a separate state pool in SGLang, not modelled here")
    if spec.n_heads % tp:
        problems.append(f"tp {tp} does not divide the {spec.n_heads} attention heads")
    if page_size < 1:
        problems.append("the page size must be positive")
    if problems:
        raise CalcError(problems)
    b = SGLANG_DTYPE_BYTES[kv_dtype]
    layers = spec.kv_layers
    d_layers, d_swa = draft
    if spec.mla is not None:
        width = spec.mla.latent_dim
        cell = width * layers * b
        what = f"({spec.mla.kv_lora_rank} + {spec.mla.qk_rope_head_dim}) latent x {layers} layers x {b} B"
    else:
        heads = max(1, spec.n_kv_heads // tp)
        cell = heads * spec.head_dim * layers * 2 * b
        what = f"{heads} KV heads x ({spec.head_dim} + {spec.head_dim}) head_dim x {layers} layers x {b} B"
    formula = [f"cell = {what} = {cell:,} B per token", f"rest = {how or f'{rest_bytes:,} B'}"]
    if spec.has_windows and hybrid_swa and spec.model_type in HYBRID_SWA_TYPES:
        return _hybrid(spec, rest_bytes, cell, page_size, swa_ratio, (d_layers, d_swa), formula, exact, kv_dtype)
    if d_layers:  # pool_configurator.py:311-314: the draft at the target's per-layer size
        extra = int(cell * d_layers / int(layers))
        formula.append(f"+ the draft's {d_layers} layer(s) at the target's per-layer size: int({cell:,} x {d_layers} "
                       f"/ {layers}) = {extra:,} B -> cell {cell + extra:,} B")
        cell += extra
    formula.append(FIXED_OVERHEAD_NOTE)
    tokens = max(0, rest_bytes) // cell // page_size * page_size
    if tokens <= 0:  # MemoryPoolConfig.__post_init__ (pool_configurator.py:94-100) refuses an empty pool
        raise CalcError([f"Not enough memory. Please try to increase --mem-fraction-static. (SGLang's error: "
                         f"{how or f'{rest_bytes:,} B'} of rest memory holds no {cell:,}-byte token)"])
    formula.append(f"#tokens = ({rest_bytes:,} - 0) // {cell:,}"
                   + (f" // {page_size} x {page_size}" if page_size > 1 else "") + f" = {tokens:,}")
    slots = tokens + page_size
    if spec.mla is not None:
        k, v = slots * spec.mla.latent_dim * layers * b, 0
    else:
        k = v = slots * max(1, spec.n_kv_heads // tp) * spec.head_dim * layers * b
    line = pool_line(tokens, kv_dtype, k, v, spec.mla is not None)
    notes: tuple[str, ...] = ()
    if spec.has_windows:
        notes = (("SGLang keeps one pool at full size for this architecture's sliding layers (its hybrid SWA "
                  "pool is for gpt-oss, Llama 4, MiMo-V2 and Step-3.5 only)" if hybrid_swa else
                  "--disable-hybrid-swa-memory: every layer at full size"),)
    return SGLangSizing(rest_bytes, cell, tokens, page_size, k, v, line, tuple(formula), exact, notes, None, d_layers)


def _hybrid(spec: ModelSpec, rest: int, cell: int, page: int, ratio: float, draft: tuple[int, int],
            formula: list[str], exact: bool, kv_dtype: str) -> SGLangSizing:
    """HybridSWAPoolConfigurator (pool_configurator.py:656-916). kvviz's layers share one KV shape, so a
    full layer's bytes a token F equal a sliding layer's S (the cell over the layers)."""
    n_swa = sum(1 for i in range(spec.n_layers) if spec.layer(i).caps)
    n_full = spec.kv_layers - n_swa
    per = cell // spec.kv_layers  # one layer's K + V a token
    d_layers, d_swa = draft
    d_full = d_layers - d_swa
    if n_full == 0:  # all SWA: no ratio (_recompute_cell_size, :786-796)
        hcell: float = per * n_swa + per * d_full + per * d_swa
    else:  # :797-803: F x (full + draft full) + ratio x S x (sliding + draft sliding)
        hcell = per * (n_full + d_full) + ratio * (per * (n_swa + d_swa))
    max_tokens = int(rest // hcell)  # :915
    full = max_tokens // page * page
    swa = full if n_full == 0 else int(full * ratio) // page * page  # _solve_pool_sizes, :859-905
    formula.append(f"cell = {per:,} B x {n_full} full" + (f" (+ {d_full} draft)" if d_full else "")
                   + (f" + {ratio:g} x {per:,} B x {n_swa} sliding" if n_full else f" x {n_swa} sliding")
                   + (f" (+ {d_swa} draft)" if d_swa else "") + f" = {hcell:,.1f} B")
    formula.append(f"full = int({rest:,} // {hcell:,.1f}) = {max_tokens:,}" + (f" -> {full:,} (pages)" if page > 1 else "")
                   + ("" if n_full == 0 else f"; sliding = int({full:,} x {ratio:g}) = {swa:,}"))
    if full <= 0:
        raise CalcError(["Not enough memory. Please try to increase --mem-fraction-static. (SGLang's error: "
                         f"{rest:,} B of rest memory holds no token of the full and sliding pools)"])
    window = max((spec.layer(i).span or 0) for i in range(spec.n_layers) if spec.layer(i).caps)
    if n_full and window + page >= swa:  # validate_swa_pool_size, :198-216
        raise CalcError([f"SWA pool ({swa} tokens) cannot hold even one request: the prefill admission floor is "
                         f"sliding_window_size ({window}) + page_size ({page}). Increase --swa-full-tokens-ratio or "
                         "the total KV budget. (SGLang's error)"])
    line = (f"Use sliding window memory pool (all SWA). swa_layer_tokens={swa}" if n_full == 0 else
            f"Use sliding window memory pool. full_layer_tokens={full}, swa_layer_tokens={swa}")
    half = per // 2  # one layer's K (or V) bytes a token
    k = v = ((full + page) * n_full + (swa + page) * n_swa) * half
    return SGLangSizing(rest, cell, full, page, k, v, line, tuple(formula), exact, (), swa, d_layers)


def mm_reserve_gib(multimodal: bool, transport: str = "cpu", vlm_cache_mb: int = VLM_CACHE_SIZE_MB,
                   feature_cache_mb: int = MM_FEATURE_CACHE_MB) -> tuple[float, str]:
    """(GB of 2^30, SGLang's log line or ""): mm_runtime_reservation_gb (kv_cache_configurator.py:202-219)."""
    if not multimodal:
        return 0.0, ""
    mb = vlm_cache_mb + (feature_cache_mb if transport in ("cuda_ipc", "cuda_vmm") else 0)
    if mb <= 0:
        return 0.0, ""
    return mb / 1024, (f"Reserving {mb / 1024:.2f} GB of the KV budget for post-sizing multimodal allocations "
                       "(feature-transport pools + embedding cache).")


def sglang_rest_logged(before_gib: float, after_gib: float, mem_fraction_static: float,
                       mm_gib: float = 0.0) -> tuple[int, str]:
    """rest_memory from SGLang's own "avail mem" figures before and after loading the weights (GB of 2^30),
    as _profile_available_bytes computes it (kv_cache_configurator.py:3007, 3038, 3060): after - before x
    (1 - f) - the multimodal reserve, then int(x 2^30)."""
    slack = before_gib * (1 - mem_fraction_static)
    rest = after_gib - slack - mm_gib
    how = (f"{after_gib:g} GiB free after loading - {before_gib:g} GiB free before x (1 - {mem_fraction_static:g}) "
           + (f"- {mm_gib:g} GiB multimodal reserve " if mm_gib else "")
           + f"= {rest:,.4f} GiB (SGLang's 'avail mem' lines)")
    return int(rest * (1 << 30)), how


def rest_parts(before_gib: float, after_gib: float, mem_fraction_static: float, mm_gib: float) -> list[dict[str, Any]]:
    """The parts of the pool's budget, each in GiB (what the page and --json show)."""
    slack = before_gib * (1 - mem_fraction_static)
    return [{"what": "free after loading the weights", "gib": after_gib},
            {"what": f"- free before loading x (1 - mem_fraction_static {mem_fraction_static:g})", "gib": -slack},
            {"what": "- multimodal reserve", "gib": -mm_gib},
            {"what": "= the pool's budget (rest_memory)", "gib": after_gib - slack - mm_gib}]


def no_room_error(before_gib: float, after_gib: float, mem_fraction_static: float) -> str:
    """SGLang's refusal when the weights leave no budget (kv_cache_configurator.py:3043-3058)."""
    minimum = 1 - after_gib / before_gib if before_gib > 0 else 1.0
    return (f"Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static={mem_fraction_static}. "
            f"Raise --mem-fraction-static above {math.ceil(minimum * 1000) / 1000:.3f} (minimum viable = 1 - "
            f"available/pre = {minimum:.4f}). If using speculative decoding, draft weights are now counted.")


def sglang_rest(gpu_bytes: int, weights_per_gpu: int, mem_fraction_static: float,
                mm_gib: float = 0.0) -> tuple[int, str]:
    """SGLang's rest_memory estimated from the GPU and the weights: (total - weights) - total x (1 - f) - the
    multimodal reserve. The CUDA context and NCCL buffers (a few hundred MiB) also come out of the free memory
    in a real run."""
    rest = int((gpu_bytes - weights_per_gpu) - gpu_bytes * (1 - mem_fraction_static) - mm_gib * GIB)
    how = (f"({gpu_bytes / GIB:,.2f} GiB - {weights_per_gpu / GIB:,.2f} GiB weights) - {gpu_bytes / GIB:,.2f} GiB x "
           f"(1 - {mem_fraction_static:g})" + (f" - {mm_gib:g} GiB multimodal reserve" if mm_gib else "")
           + f" = {rest / GIB:,.2f} GiB (estimate: the CUDA context is not counted)")
    return rest, how


def draft_layers(draft: ModelSpec) -> tuple[int, int]:
    """(layers, sliding layers) of a draft as SGLang counts them for the target's cell: the draft config's
    max(num_hidden_layers, num_attention_layers); its sliding layers when it is a hybrid SWA model
    (model_runner_components/spec_aux_hidden_state.py:158-182)."""
    swa = sum(1 for i in range(draft.n_layers) if draft.layer(i).caps) if draft.model_type in HYBRID_SWA_TYPES else 0
    return draft.n_layers, swa


def sglang_draft_pool(draft: ModelSpec, tokens: int, tp: int = 1, kv_dtype: str = "bf16",
                      page_size: int = 1) -> tuple[int, int, str]:
    """(K bytes, V bytes, the draft worker's line): its pool holds the target's #tokens (+ the page of
    padding slots, as the target's) for the draft's own layers: the draft worker takes the target's
    MemoryPoolConfig (kv_cache_configurator.py:470-476) and logs its own line (memory_pool.py:2083-2100)."""
    if draft.linear_layers:
        raise CalcError(["the draft has linear / Mamba layers: SGLang keeps their state in a separate pool, not "
                         "modelled here"])
    if draft.n_heads % tp:
        raise CalcError([f"tp {tp} does not divide the draft's {draft.n_heads} attention heads"])
    b = SGLANG_DTYPE_BYTES[kv_dtype]
    slots = tokens + page_size
    if draft.mla is not None:
        kv = slots * draft.mla.latent_dim * draft.kv_layers * b
        return kv, 0, pool_line(tokens, kv_dtype, kv, 0, True)
    k = slots * max(1, draft.n_kv_heads // tp) * draft.head_dim * draft.kv_layers * b
    return k, k, pool_line(tokens, kv_dtype, k, k, False)
