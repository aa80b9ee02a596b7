"""The calculator beside a live server: what its pool holds in tokens, and what "usage %" means.

vLLM reports its pool in blocks (``cache_config_info``: ``num_gpu_blocks``, ``block_size``). kvviz's
vLLM rules (``kvviz.calculator.server_vllm``) turn blocks into KV tokens and a maximum concurrency for
the served ``max_model_len`` from the model's config: the memory that gives exactly that many blocks is
blocks x page x layers per group, so the sizing is the engine's own arithmetic, not an estimate.
SGLang and llama.cpp report their pool in tokens; the concurrency is then tokens // max_model_len.

The served model is found by name among the calculator's presets (``HuggingFaceTB/SmolLM2-135M-Instruct``
is the preset ``smollm2-135m``), or given by the user as a config.json; an unknown model gets no
figures and a sentence saying why.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvviz.calculator.server_vllm import VLLMSettings, vllm_sizing
from kvviz.calculator.spec import CalcError, ModelSpec
from kvviz.watch.server_metrics import Reading

_SUFFIXES = ("-instruct", "-it", "-chat", "-base", "-hf")
_KV_DTYPES = ("fp32", "fp16", "bf16", "fp8")  # cache_dtype labels kvviz sizes as they are


def _norm(name: str) -> str:
    base = re.split(r"[\\/]", name.strip().rstrip("/\\"))[-1].lower()
    for suffix in _SUFFIXES:
        base = base.removesuffix(suffix)
    return base.replace("_", "-")


def match_preset(served: str | None, presets: Mapping[str, ModelSpec]) -> ModelSpec | None:
    """The preset whose key or name is the served model's (its last path part, without -Instruct and kin)."""
    if not served:
        return None
    want = _norm(served)
    for key, spec in presets.items():
        if want and want in (_norm(key), _norm(spec.name)):
            return spec
    return None


@dataclass(frozen=True)
class ServerCalc:
    """kvviz's figures for the served pool, or why there are none."""

    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    kv_cache_bytes: int | None = None
    used_tokens: float | None = None  # usage x tokens: what the usage % means
    model: str | None = None  # the spec the figures used
    why_not: str | None = None
    formula: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"kv_cache_tokens": self.kv_cache_tokens, "max_concurrency": self.max_concurrency,
                "kv_cache_bytes": self.kv_cache_bytes, "used_tokens": self.used_tokens, "model": self.model,
                "why_not": self.why_not, "formula": list(self.formula)}


def _vllm_kv_dtype(cache_dtype: str | None) -> str:
    """vLLM's ``cache_dtype`` label; "auto" is the served dtype (``--dtype``), which the metrics do not
    name: bf16, the usual one, unless the caller says (``dtype``)."""
    c = (cache_dtype or "auto").lower()
    if c.startswith("fp8"):
        return "fp8"
    if c in _KV_DTYPES:
        return c
    if c in ("bfloat16", "float16", "float32", "half", "float"):
        return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}[c]
    return "bf16"


def server_calc(r: Reading, spec: ModelSpec | None, dtype: str | None = None, device: str = "cuda") -> ServerCalc:
    """The calculator's figures for the pool this reading describes, on ``spec`` (None: unknown model).
    ``device``: where the vLLM server runs ("cpu": its CPU backend schedules one step at a time, so a
    sliding layer holds one batch in flight, not two); its metrics do not say, so the caller does."""
    if spec is None:
        return ServerCalc(why_not=f"kvviz does not know the served model {r.model or '(unnamed)'}: "
                                  "give its config.json (--config) or a preset (--preset)")
    L = r.max_model_len
    if r.engine == "vllm":
        if not r.num_blocks or not r.block_size:
            return ServerCalc(model=spec.name, why_not="the server's cache_config_info gives no block count")
        if not L:
            return ServerCalc(model=spec.name, why_not="the server did not say its max_model_len (/v1/models)")
        kv_dtype = dtype or _vllm_kv_dtype(r.cache_config.get("cache_dtype"))
        try:
            probe = vllm_sizing(spec, VLLMSettings(kv_memory_bytes=1 << 40, max_model_len=L, block_size=r.block_size,
                                                   kv_dtype=kv_dtype, device=device))
            # The memory that yields exactly the server's blocks: the engine's own division, reversed.
            memory = r.num_blocks * probe.page_bytes * probe.group_size
            s = vllm_sizing(spec, VLLMSettings(kv_memory_bytes=memory, max_model_len=L, block_size=r.block_size,
                                               kv_dtype=kv_dtype, device=device))
        except CalcError as e:
            return ServerCalc(model=spec.name, why_not="; ".join(e.problems))
        used = None if r.kv_cache_usage is None else r.kv_cache_usage * s.kv_cache_tokens
        return ServerCalc(s.kv_cache_tokens, s.max_concurrency, memory, used, spec.name, None, s.formula)
    if r.kv_tokens_capacity is None:
        return ServerCalc(model=spec.name, why_not=f"{r.engine} did not say how many tokens its pool holds")
    used = r.kv_tokens_used if r.kv_tokens_used is not None else (
        None if r.kv_cache_usage is None else r.kv_cache_usage * r.kv_tokens_capacity)
    conc = r.kv_tokens_capacity / L if L else None
    return ServerCalc(r.kv_tokens_capacity, conc, None, used, spec.name, None,
                      (f"pool = {r.kv_tokens_capacity:,} tokens (the server's own figure)",))
