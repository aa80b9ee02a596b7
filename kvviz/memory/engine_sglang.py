"""SGLang's token pool: how many tokens ``--mem-fraction-static`` leaves room for, in SGLang's
"KV Cache is allocated" line.

Followed from SGLang (python/sglang/srt/model_executor/model_runner.py profile_max_num_token,
python/sglang/srt/mem_cache/memory_pool.py MHATokenToKVPool / MLATokenToKVPool):

- cell = KV heads per GPU (max(1, KV heads // TP)) x head_dim x layers x 2 x dtype bytes; under MLA
  (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes;
- rest = the GPU memory free after loading the weights - total x (1 - mem_fraction_static);
  #tokens = rest // cell, rounded down to the page size;
- the pool allocates #tokens + page_size cells (slot 0 is a padding token); "K size" is those cells'
  K buffers in GiB (SGLang's GB is 2^30 bytes).
Unlike vLLM, SGLang sizes the pool before any profiling run: the activations must fit in the
1 - mem_fraction_static left over.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvviz.memory.spec import CalcError, ModelSpec
from kvviz.units import GIB

SGLANG_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
SOURCES = ("python/sglang/srt/model_executor/model_runner.py", "python/sglang/srt/mem_cache/memory_pool.py")


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

    def to_dict(self) -> dict[str, Any]:
        return {"name": "sglang", "rest_bytes": self.rest_bytes, "cell_bytes": self.cell_bytes,
                "max_total_num_tokens": self.tokens, "page_size": self.page_size, "k_bytes": self.k_bytes,
                "v_bytes": self.v_bytes, "log_line": self.line, "formula": list(self.formula),
                "exact": self.exact, "notes": list(self.notes), "sources": list(SOURCES)}


def sglang_sizing(spec: ModelSpec, rest_bytes: int, tp: int = 1, kv_dtype: str = "bf16", page_size: int = 1,
                  exact: bool = True, how: str = "") -> SGLangSizing:
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
    formula = (f"cell = {what} = {cell:,} B per token",
               f"rest = {how or f'{rest_bytes:,} B'}",
               f"#tokens = {rest_bytes:,} // {cell:,}" + (f" // {page_size} x {page_size}" if page_size > 1 else "")
               + f" = {tokens:,}")
    notes = ()
    if spec.has_windows:
        notes = ("this model has sliding-window or chunked layers: SGLang's hybrid SWA pool "
                 "(--swa-full-tokens-ratio) gives them a smaller pool of their own, which kvviz does not model; "
                 "the figure counts every layer at full size (as with --disable-hybrid-swa-memory)",)
    return SGLangSizing(rest_bytes, cell, tokens, page_size, k, v, line, formula, exact, notes)


def sglang_rest(gpu_bytes: int, weights_per_gpu: int, mem_fraction_static: float) -> tuple[int, str]:
    """SGLang's rest_memory estimated from the GPU and the weights: (total - weights) - total x (1 - f).
    The CUDA context and NCCL buffers (a few hundred MiB) also come out of the free memory in a real run."""
    rest = int((gpu_bytes - weights_per_gpu) - gpu_bytes * (1 - mem_fraction_static))
    how = (f"({gpu_bytes / GIB:,.2f} GiB - {weights_per_gpu / GIB:,.2f} GiB weights) - {gpu_bytes / GIB:,.2f} GiB x "
           f"(1 - {mem_fraction_static:g}) = {rest / GIB:,.2f} GiB (estimate: the CUDA context is not counted)")
    return rest, how
