"""Why a logged vLLM figure differs from kvviz's: the first alternative setting that reproduces it
(another block size, KV dtype, max_num_batched_tokens, a speculative draft's layers, the hybrid manager
off, another vLLM version's token line), for the reconciler in server_log.py.
"""
from __future__ import annotations

from dataclasses import replace

from kvviz.calculator.server_vllm import VLLMSettings, VLLMSizing, vllm_sizing
from kvviz.calculator.spec import CalcError, ModelSpec
from kvviz.units import GIB


def sizes(spec: ModelSpec, s: VLLMSettings, lo: int, hi: int) -> tuple[VLLMSizing, VLLMSizing]:
    return vllm_sizing(spec, replace(s, kv_memory_bytes=lo)), vllm_sizing(spec, replace(s, kv_memory_bytes=hi))


def line_tokens(v: VLLMSizing, one_line: bool) -> int:
    """The token figure a log of that generation prints: 0.33's int(concurrency x max_model_len) on the one
    line, earlier V1's blocks // groups x block size on its own line."""
    return v.kv_cache_tokens if one_line else v.tokens_by_groups


def _one_layer(spec: ModelSpec) -> ModelSpec:
    """A one-layer full-attention copy of the target's shape: what an EAGLE draft head adds."""
    return replace(spec, name=f"{spec.name} + 1 layer", n_layers=1, layers=(), kv_shared_layers=0)


def explain_tokens(spec: ModelSpec, s: VLLMSettings, lo: int, hi: int, logged: int) -> str:
    """Why the logged token count is not in kvviz's range: the first alternative that reproduces it."""
    a, b = sizes(spec, s, lo, hi)
    if a.tokens_legacy <= logged <= b.tokens_legacy and len(a.groups) > 1:
        return (f"older vLLM printed blocks x block size ({a.tokens_legacy:,}-{b.tokens_legacy:,}) without dividing "
                f"by the {len(a.groups)} groups: the same blocks, another version's line")
    if a.tokens_newest <= logged <= b.tokens_newest:
        return ("vLLM 0.33 prints int(concurrency x max_model_len) on one line with the concurrency: the same "
                "blocks, another version's line")
    if a.tokens_by_groups <= logged <= b.tokens_by_groups:
        return ("vLLM 0.9-0.11 printed blocks // groups x block size on a line of its own: the same blocks, "
                "another version's line")
    trials: list[tuple[str, VLLMSettings]] = []
    for bs in (16, 32, 64, 128, 256):
        if bs != s.block_size:
            trials.append((f"a block size of {bs} (attention backends choose their own: FlashMLA and some "
                           f"hybrid models use 64 or more): pass --block-size {bs}", replace(s, block_size=bs)))
    for dt in ("fp8", "bf16", "fp32"):
        if dt != s.kv_dtype:
            trials.append((f"a {dt} KV cache: pass --kv-cache-dtype {dt}", replace(s, kv_dtype=dt)))
    if s.draft is None:  # an EAGLE head is one layer of the target's shape (vllm#19996: 33 layers' blocks)
        trials.append(("one more layer of the target's shape: a speculative draft (EAGLE) holds KV beside the "
                       "target's; pass its config.json as --draft-config",
                       replace(s, draft=_one_layer(spec))))
    if s.hybrid and spec.has_windows:
        trials.append(("the hybrid KV-cache manager off (--disable-hybrid-kv-cache-manager, or a model vLLM does not "
                       "group): every layer keeps every token", replace(s, hybrid=False)))
    for why, alt in trials:
        try:
            x, y = sizes(spec, alt, lo, hi)
        except CalcError:
            continue
        if any(lo_t <= logged <= hi_t for lo_t, hi_t in ((x.kv_cache_tokens, y.kv_cache_tokens),
                                                          (x.tokens_legacy, y.tokens_legacy),
                                                          (x.tokens_by_groups, y.tokens_by_groups))):
            return f"reproduced with {why}"
    if logged < a.kv_cache_tokens and s.tp * s.pp > 1:
        return ("fewer than predicted: vLLM keeps the smallest block count over all GPUs, and the logged "
                "'Available KV cache memory' is one GPU's; another GPU of the group had less free memory")
    implied = lo / logged if logged else 0
    per_token = (b.kv_cache_tokens and hi / b.kv_cache_tokens) or 0
    return (f"not explained: the log implies {implied:,.0f} B of KV per token, kvviz computes {per_token:,.0f} B; "
            "check the config (layers, KV heads, head_dim), the KV dtype, TP and the block size")


def explain_needed(spec: ModelSpec, s: VLLMSettings, need_gib: float) -> str:
    """Why the error's needed GiB differs: the first alternative setting that reproduces it."""
    trials: list[tuple[str, VLLMSettings]] = []
    if s.pp > 1:
        trials.append(("the whole model's layers checked against one GPU, as vLLM did before it projected the check "
                       "onto each pipeline stage (vllm#34076)", replace(s, pp=1)))
    for n in (1024, 2048, 4096, 8192, 16384):
        if n != s.max_num_batched_tokens and spec.has_windows:
            trials.append((f"--max-num-batched-tokens {n} (the sliding groups hold window + that)",
                           replace(s, max_num_batched_tokens=n)))
    for dt in ("fp8", "bf16", "fp32"):
        if dt != s.kv_dtype:
            trials.append((f"a {dt} KV cache: pass --kv-cache-dtype {dt}", replace(s, kv_dtype=dt)))
    for bs in (16, 32, 64, 128):
        if bs != s.block_size:
            trials.append((f"a block size of {bs}: pass --block-size {bs}", replace(s, block_size=bs)))
    for why, alt in trials:
        try:
            if round(vllm_sizing(spec, replace(alt, kv_memory_bytes=0)).needed_bytes / GIB, 2) == round(need_gib, 2):
                return f"reproduced with {why}"
        except CalcError:
            continue
    return "differs: check the KV dtype, TP/PP, the block size and max_num_batched_tokens"
