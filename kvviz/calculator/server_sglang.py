"""SGLang's token pool: how many tokens ``--mem-fraction-static`` leaves room for, in SGLang's
"KV Cache is allocated" line.

Followed from SGLang (python/sglang/srt/model_executor/model_runner.py profile_max_num_token,
python/sglang/srt/mem_cache/memory_pool.py MHATokenToKVPool / MLATokenToKVPool):

- cell = KV heads per GPU (max(1, KV heads // TP)) x head_dim x layers x 2 x dtype bytes; under MLA
  (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes;
- rest = the GPU memory free after loading the weights - the memory free before loading x
  (1 - mem_fraction_static), in GB of 2^30 (SGLang 0.5.10.post1, the nearest sdist on PyPI to 0.5.23:
  model_executor/model_runner_kv_cache_mixin.py:144-172 profile_max_num_token); its log's "Load weight
  begin/end. avail mem=X GB" are those two figures (--avail-mem-gib BEFORE,AFTER);
  #tokens = int(rest x 2^30) // cell, rounded down to the page size (:808-838);
- hybrid sliding-window models (gpt-oss, Llama 4, MiMo-V2, Step-3.5: configs/model_config.py:1438-1448)
  split that capacity into a full pool and a sliding pool of swa_full_tokens_ratio (0.8) as many
  tokens: full = int(capacity x cell / (F x full layers + r x S x sliding layers)), sliding = full x r,
  each page-aligned (_resolve_hybrid_swa_tokens, :287-378);
- the pool allocates #tokens + page_size cells (slot 0 is a padding token); "K size" is those cells'
  K buffers in GiB (SGLang's GB is 2^30 bytes).
- a speculative draft (EAGLE, a draft model; kvviz's --draft-config) has its own pool of the target's
  #tokens: the draft worker takes the target's resolved MemoryPoolConfig (init_memory_pool,
  model_runner_kv_cache_mixin.py:893-903) and builds a pool of its own layers, which prints its own
  "KV Cache is allocated" line (mem_cache/memory_pool.py:686-704); that memory is not subtracted before
  the target's pool is profiled, so it must fit in the 1 - mem_fraction_static left over.
Unlike vLLM, SGLang sizes the pool before any profiling run: the activations must fit in the
1 - mem_fraction_static left over. Newer SGLang (0.5.23, not on PyPI: issue 41 cites its
kv_cache_configurator.py and pool_configurator.py) also takes a multimodal reserve from the rest, subtracts a
fixed overhead before dividing and prints the dtype in the line ("KV Cache is allocated. dtype: torch.bfloat16,
#tokens: ...", as sglang#18263's log shows); kvviz follows 0.5.10.post1, the newest sdist on PyPI, which does
none of these, so a 0.5.23 pool holds fewer tokens than kvviz says (by an amount kvviz cannot state).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvviz.calculator.spec import CalcError, ModelSpec
from kvviz.units import GIB

SGLANG_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
SOURCES = ("python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py", "python/sglang/srt/mem_cache/memory_pool.py",
           "python/sglang/srt/configs/model_config.py")
HYBRID_SWA_TYPES = ("gpt_oss", "llama4", "llama4_text", "mimo_v2_flash", "step3p5")  # model_config.py:1438-1448
SWA_FULL_TOKENS_RATIO = 0.8  # server_args.py:360


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

    def to_dict(self) -> dict[str, Any]:
        return {"name": "sglang", "rest_bytes": self.rest_bytes, "cell_bytes": self.cell_bytes,
                "max_total_num_tokens": self.tokens, "page_size": self.page_size, "k_bytes": self.k_bytes,
                "v_bytes": self.v_bytes, "log_line": self.line, "formula": list(self.formula),
                "exact": self.exact, "notes": list(self.notes), "sources": list(SOURCES),
                "swa_max_total_num_tokens": self.swa_tokens}


def sglang_sizing(spec: ModelSpec, rest_bytes: int, tp: int = 1, kv_dtype: str = "bf16", page_size: int = 1,
                  exact: bool = True, how: str = "", hybrid_swa: bool = True,
                  swa_ratio: float = SWA_FULL_TOKENS_RATIO) -> SGLangSizing:
    """The pool for ``rest_bytes`` of KV memory on each GPU (SGLang's rest_memory)."""
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
    if spec.mla is not None:
        width = spec.mla.latent_dim
        cell = width * layers * b
        what = f"({spec.mla.kv_lora_rank} + {spec.mla.qk_rope_head_dim}) latent x {layers} layers x {b} B"
    else:
        heads = max(1, spec.n_kv_heads // tp)
        cell = heads * spec.head_dim * layers * 2 * b
        what = f"{heads} KV heads x {spec.head_dim} head_dim x {layers} layers x 2 x {b} B"
    tokens = max(0, rest_bytes) // cell // page_size * page_size
    if tokens <= 0:  # model_runner.py init_memory_pool refuses an empty pool
        raise CalcError([f"Not enough memory. Please try to increase --mem-fraction-static. (SGLang's error: "
                         f"{how or f'{rest_bytes:,} B'} of rest memory holds no {cell:,}-byte token)"])
    slots = tokens + page_size
    if spec.mla is not None:
        k, v = slots * spec.mla.latent_dim * layers * b, 0
        line = f"KV Cache is allocated. #tokens: {tokens}, KV size: {k / GIB:.2f} GB"
    else:
        k = v = slots * cell // 2
        line = f"KV Cache is allocated. #tokens: {tokens}, K size: {k / GIB:.2f} GB, V size: {v / GIB:.2f} GB"
    formula = [f"cell = {what} = {cell:,} B per token",
               f"rest = {how or f'{rest_bytes:,} B'}",
               f"#tokens = {rest_bytes:,} // {cell:,}" + (f" // {page_size} x {page_size}" if page_size > 1 else "")
               + f" = {tokens:,}"]
    notes: tuple[str, ...] = ()
    swa = None
    if spec.has_windows and hybrid_swa and spec.model_type in HYBRID_SWA_TYPES:
        full, swa, pool_line = _hybrid_swa(spec, tokens, page_size, swa_ratio)
        formula.append(pool_line)
        n_swa = sum(1 for i in range(spec.n_layers) if spec.layer(i).caps)
        per_layer = cell // layers // 2  # one layer's K (or V) bytes a token
        k = v = ((full + page_size) * (layers - n_swa) + (swa + page_size) * n_swa) * per_layer
        line, tokens = pool_line, full
    elif spec.has_windows:
        notes = (("SGLang keeps one pool at full size for this architecture's sliding layers (its hybrid SWA "
                  "pool is for gpt-oss, Llama 4, MiMo-V2 and Step-3.5 only)" if hybrid_swa else
                  "--disable-hybrid-swa-memory: every layer at full size"),)
    return SGLangSizing(rest_bytes, cell, tokens, page_size, k, v, line, tuple(formula), exact, notes, swa)


def _hybrid_swa(spec: ModelSpec, capacity: int, page: int, ratio: float) -> tuple[int, int, str]:
    """(full tokens, sliding tokens, SGLang's line): _resolve_hybrid_swa_tokens (:287-378). kvviz's layers
    share one KV shape, so F = S."""
    n_swa = sum(1 for i in range(spec.n_layers) if spec.layer(i).caps)
    n_full = spec.kv_layers - n_swa
    if n_full == 0:
        swa = capacity // page * page
        return swa, swa, f"Use sliding window memory pool (all SWA). swa_layer_tokens={swa}"
    per = 1  # F = S: the byte size cancels in full = capacity x (F n_full + S n_swa) / (F n_full + r S n_swa)
    total = capacity * (per * n_full + per * n_swa)
    full = int(total / (per * n_full + ratio * per * n_swa)) // page * page
    swa = int(full * ratio) // page * page
    return full, swa, f"Use sliding window memory pool. full_layer_tokens={full}, swa_layer_tokens={swa}"


def sglang_rest_logged(before_gib: float, after_gib: float, mem_fraction_static: float) -> tuple[int, str]:
    """rest_memory from SGLang's own "avail mem" figures before and after loading the weights (GB of 2^30),
    as profile_max_num_token computes it: after - before x (1 - f), then int(x 2^30)."""
    rest = after_gib - before_gib * (1 - mem_fraction_static)
    how = (f"{after_gib:g} GiB free after loading - {before_gib:g} GiB free before x (1 - {mem_fraction_static:g}) "
           f"= {rest:,.4f} GiB (SGLang's 'avail mem' lines)")
    return int(rest * (1 << 30)), how


def sglang_rest(gpu_bytes: int, weights_per_gpu: int, mem_fraction_static: float) -> tuple[int, str]:
    """SGLang's rest_memory estimated from the GPU and the weights: (total - weights) - total x (1 - f).
    The CUDA context and NCCL buffers (a few hundred MiB) also come out of the free memory in a real run."""
    rest = int((gpu_bytes - weights_per_gpu) - gpu_bytes * (1 - mem_fraction_static))
    how = (f"({gpu_bytes / GIB:,.2f} GiB - {weights_per_gpu / GIB:,.2f} GiB weights) - {gpu_bytes / GIB:,.2f} GiB x "
           f"(1 - {mem_fraction_static:g}) = {rest / GIB:,.2f} GiB (estimate: the CUDA context is not counted)")
    return rest, how


def sglang_draft_pool(draft: ModelSpec, tokens: int, tp: int = 1, kv_dtype: str = "bf16",
                      page_size: int = 1) -> tuple[int, int, str]:
    """(K bytes, V bytes, the draft worker's line): its pool holds the target's #tokens (+ the page of
    padding slots, as the target's) for the draft's own layers (MHATokenToKVPool / MLATokenToKVPool with
    the draft's layer_num; model_runner_kv_cache_mixin.py:893-903, memory_pool.py:686-704)."""
    if draft.linear_layers:
        raise CalcError(["the draft has linear / Mamba layers: SGLang keeps their state in a separate pool, not "
                         "modelled here"])
    if draft.n_heads % tp:
        raise CalcError([f"tp {tp} does not divide the draft's {draft.n_heads} attention heads"])
    b = SGLANG_DTYPE_BYTES[kv_dtype]
    slots = tokens + page_size
    if draft.mla is not None:
        kv = slots * draft.mla.latent_dim * draft.kv_layers * b
        return kv, 0, f"KV Cache is allocated. #tokens: {tokens}, KV size: {kv / GIB:.2f} GB"
    k = slots * max(1, draft.n_kv_heads // tp) * draft.head_dim * draft.kv_layers * b
    return k, k, f"KV Cache is allocated. #tokens: {tokens}, K size: {k / GIB:.2f} GB, V size: {k / GIB:.2f} GB"
