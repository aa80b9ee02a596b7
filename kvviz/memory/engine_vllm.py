"""vLLM V1's KV-cache sizing, reproduced from the config: blocks, "GPU KV cache size", the
"Maximum concurrency" line and the too-long error, before the engine is started.

Followed from vLLM's own code (vllm/v1/kv_cache_interface.py, vllm/v1/core/kv_cache_utils.py,
vllm/distributed/utils.py), rule by rule:

- page: each attention layer's block of ``block_size`` tokens holds
  ``block x KV heads per GPU x head_dim x 2 (K, V) x dtype bytes`` (AttentionSpec.page_size_bytes);
  MLA keeps one latent of (kv_lora_rank + qk_rope_head_dim) per token, no K/V pair (MLAAttentionSpec).
  KV heads per GPU are max(1, KV heads // TP); fp8 is one byte a value.
- groups: layers of one spec (full, or sliding with window W, or chunked with chunk C) are grouped;
  with several specs every group holds the same number of layers: the smallest type's count (or
  the largest when it is under 1.5x the smallest), the other types split into
  ceil(n / group_size) groups, layer i::n_groups each (_get_kv_cache_groups_uniform_page_size).
- blocks: ``available // page // group_size`` (get_num_blocks), per pipeline stage with the
  stage's own share of each group, then the smallest over the stages.
- "GPU KV cache size" = blocks // groups x block_size (_report_kv_cache_config). Older vLLM
  printed blocks x block_size; the newest prints int(concurrency x max_model_len); the three agree
  for one group and a max_model_len that is a multiple of the block.
- a request's blocks: full ``ceil(L / block)``, sliding ``ceil(min(W - 1 + batched, L) / block) + 1``,
  chunked ``ceil(min(C + batched, L) / block)`` (each spec's max_memory_usage_bytes, ``batched`` =
  max_num_batched_tokens); concurrency = blocks / the sum over groups.
- too long: a stage needs group_size x page x that sum (_max_memory_usage_bytes_from_groups); more
  than it has raises vLLM's error, with the longest L that fits (a binary search up to L).

Linear-attention and Mamba layers (vLLM's MambaSpec pads pages to the attention page) are not
modelled: such models are refused with a sentence saying so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvviz.memory.spec import CalcError, Layer, ModelSpec
from kvviz.units import GIB

VLLM_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}  # torch.uint8 holds fp8 in vLLM's cache
DEFAULT_BATCHED_TOKENS = 2048  # `vllm serve`'s max_num_batched_tokens on most GPUs (8192 on >= 70 GiB ones)


def default_batched_tokens(gpu_gib: float | None, gpu_name: str = "") -> int:
    """`vllm serve`'s default max_num_batched_tokens (vllm/engine/arg_utils.py get_batch_defaults):
    8,192 on a GPU of >= 70 GiB that is not an A100, else 2,048."""
    return 8192 if gpu_gib is not None and gpu_gib >= 70 and "a100" not in gpu_name.lower() else DEFAULT_BATCHED_TOKENS
SOURCES = ("vllm/v1/kv_cache_interface.py", "vllm/v1/core/kv_cache_utils.py", "vllm/distributed/utils.py")


@dataclass(frozen=True)
class VLLMSettings:
    """The serve flags that decide the sizing."""

    kv_memory_bytes: int  # "Available KV cache memory", per GPU
    max_model_len: int
    block_size: int = 16
    tp: int = 1
    pp: int = 1
    kv_dtype: str = "bf16"
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS
    hybrid: bool = True  # False: --disable-hybrid-kv-cache-manager (every layer kept as full attention)


@dataclass(frozen=True)
class VLLMGroup:
    """One KV-cache group: its spec, its layers and what one max-length request takes from it."""

    kind: str  # full, sliding, chunked, mla
    span: int | None
    layers: tuple[int, ...]  # layer indices (whole model)
    page_bytes: int  # per layer and block
    blocks_per_request: int

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "span": self.span, "layers": list(self.layers), "n_layers": len(self.layers),
                "page_size_bytes": self.page_bytes, "blocks_per_request": self.blocks_per_request}


@dataclass(frozen=True)
class VLLMSizing:
    settings: VLLMSettings
    kv_heads_per_gpu: int | None  # None under MLA
    page_bytes: int
    group_size: int  # layers per group (padding included)
    groups: tuple[VLLMGroup, ...]
    stages: tuple[tuple[int, int], ...]  # pipeline stages' [start, end) layers
    num_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    fits: bool
    needed_bytes: int  # one max-length request, on the stage that needs most
    estimated_max_model_len: int | None  # only when it does not fit (vLLM's estimate)
    lines: tuple[str, ...]  # what vLLM would log
    formula: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def tokens_legacy(self) -> int:
        return self.num_blocks * self.settings.block_size

    @property
    def tokens_newest(self) -> int:
        return int(self.max_concurrency * self.settings.max_model_len)

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "name": "vllm", "block_size": s.block_size, "kv_dtype": s.kv_dtype, "tp": s.tp, "pp": s.pp,
            "available_kv_bytes": s.kv_memory_bytes, "max_model_len": s.max_model_len,
            "max_num_batched_tokens": s.max_num_batched_tokens, "hybrid_kv_cache_manager": s.hybrid,
            "kv_heads_per_gpu": self.kv_heads_per_gpu, "page_size_bytes": self.page_bytes,
            "group_size": self.group_size, "groups": [g.to_dict() for g in self.groups],
            "pp_stages": [list(st) for st in self.stages], "num_blocks": self.num_blocks,
            "kv_cache_tokens": self.kv_cache_tokens, "max_concurrency": self.max_concurrency,
            "fits": self.fits, "needed_bytes": self.needed_bytes,
            "estimated_max_model_len": self.estimated_max_model_len, "log_lines": list(self.lines),
            "formula": list(self.formula), "notes": list(self.notes), "sources": list(SOURCES),
        }


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def format_gib(n: int) -> str:
    """vLLM's GiB in its messages: two decimals."""
    return f"{n / GIB:.2f}"


def pp_partition(n_layers: int, pp: int) -> list[tuple[int, int]]:
    """vLLM's get_pp_indices without VLLM_PP_LAYER_PARTITION: even shares, the remainder one layer
    each to the stages before the last (from the second-to-last backwards)."""
    parts = [n_layers // pp] * pp
    for i in range(2, n_layers % pp + 2):
        parts[-i] += 1
    out, start = [], 0
    for p in parts:
        out.append((start, start + p))
        start += p
    return out


def vllm_problems(spec: ModelSpec, s: VLLMSettings) -> list[str]:
    out: list[str] = []
    if s.kv_dtype not in VLLM_DTYPE_BYTES:
        out.append(f"vLLM's KV cache is fp16, bf16, fp32 or fp8 (--kv-cache-dtype); {s.kv_dtype} is not one of them")
    if spec.n_heads % s.tp:
        out.append(f"Total number of attention heads ({spec.n_heads}) must be divisible by tensor parallel size "
                   f"({s.tp}) (vLLM refuses this TP)")
    if spec.linear_layers:
        out.append(f"{spec.linear_layers} linear-attention / Mamba layers: vLLM pads their state pages to the "
                   "attention page, which kvviz does not model yet; size this model without --engine vllm")
    if not spec.kv_layers:
        out.append("no layer keeps K/V: vLLM allocates no KV blocks for this model")
    if s.pp > spec.n_layers:
        out.append(f"pp {s.pp} is more than the {spec.n_layers} layers")
    for name, v in (("block size", s.block_size), ("max_model_len", s.max_model_len),
                    ("max_num_batched_tokens", s.max_num_batched_tokens), ("pp", s.pp), ("tp", s.tp)):
        if v < 1:
            out.append(f"{name} must be positive (got {v})")
    if s.kv_memory_bytes < 0:
        out.append("the available KV memory cannot be negative")
    return out


def _layer_key(spec: ModelSpec, layer: Layer, hybrid: bool) -> tuple[str, int | None]:
    if spec.mla is not None:
        return "mla", None
    if not hybrid or not layer.caps:
        return "full", None
    return layer.kind, layer.span


def _groups(keys: list[tuple[str, int | None]]) -> tuple[int, list[tuple[tuple[str, int | None], tuple[int, ...]]]]:
    """(group_size, [(spec key, layer indices)]) as _get_kv_cache_groups_uniform_page_size builds them."""
    by_key: dict[tuple[str, int | None], list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    if len(by_key) == 1:
        ((k, idx),) = by_key.items()
        return len(idx), [(k, tuple(idx))]
    sizes = [len(v) for v in by_key.values()]
    group_size = min(sizes)
    if max(sizes) < min(sizes) * 1.5:
        group_size = max(sizes)
    out = []
    for k, idx in by_key.items():
        n = cdiv(len(idx), group_size)
        out += [(k, tuple(idx[i::n])) for i in range(n)]
    return group_size, out


def _request_blocks(key: tuple[str, int | None], s: VLLMSettings, max_len: int) -> int:
    """Blocks one request of ``max_len`` tokens can hold in a group of this spec (max_memory_usage_bytes / page)."""
    kind, span = key
    bs = s.block_size
    if kind == "sliding":
        return cdiv(min((span or 0) - 1 + s.max_num_batched_tokens, max_len), bs) + 1
    if kind == "chunked":
        return cdiv(min((span or 0) + s.max_num_batched_tokens, max_len), bs)
    return cdiv(max_len, bs)


def _request_blocks_text(key: tuple[str, int | None], s: VLLMSettings, max_len: int) -> str:
    """How ``_request_blocks`` counts a group's blocks, in words and numbers (the formula shows it)."""
    kind, span = key
    bs, n = s.block_size, _request_blocks(key, s, max_len)
    if kind == "sliding":
        return (f"{kind} {span or 0:,}: ceil(min({span or 0:,} - 1 + {s.max_num_batched_tokens:,}, {max_len:,}) / {bs})"
                f" + 1 = {n:,}")
    if kind == "chunked":
        return f"{kind} {span or 0:,}: ceil(min({span or 0:,} + {s.max_num_batched_tokens:,}, {max_len:,}) / {bs}) = {n:,}"
    return f"{kind}: ceil({max_len:,} / {bs}) = {n:,}"


def _longest(fits: Callable[[int], bool], upto: int) -> int:
    """vLLM's binary search for the estimated maximum model length: 0 when one token does not fit."""
    if not fits(1):
        return 0
    lo, hi, best = 1, upto, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def vllm_sizing(spec: ModelSpec, s: VLLMSettings) -> VLLMSizing:
    """What vLLM V1 allocates and logs for this model and these flags; CalcError for what vLLM refuses."""
    problems = vllm_problems(spec, s)
    if problems:
        raise CalcError(problems)
    nbytes, bs = VLLM_DTYPE_BYTES[s.kv_dtype], s.block_size
    if spec.mla is not None:
        heads, width = None, spec.mla.latent_dim
        page = bs * width * nbytes
        page_text = f"{bs} tokens x {width} latent x {nbytes} B"
    else:
        heads = max(1, spec.n_kv_heads // s.tp)
        page = bs * heads * spec.head_dim * 2 * nbytes
        page_text = f"{bs} tokens x {heads} KV heads x {spec.head_dim} head_dim x 2 (K, V) x {nbytes} B"
    keys = [_layer_key(spec, spec.layer(i), s.hybrid) for i in range(spec.n_layers)]
    group_size, raw = _groups(keys)
    stages = pp_partition(spec.n_layers, s.pp)
    avail, L = s.kv_memory_bytes, s.max_model_len

    def stage_need(lo: int, hi: int, max_len: int) -> tuple[int, int]:
        """(layers per group on this stage, bytes one request of max_len needs there)."""
        gs = max(sum(1 for i in idx if lo <= i < hi) for _, idx in raw)
        return gs, gs * page * sum(_request_blocks(k, s, max_len) for k, _ in raw)

    blocks, needed, estimate, fits = None, 0, None, True
    for lo, hi in stages:
        gs, need = stage_need(lo, hi, L)
        needed = max(needed, need)
        if fits and need > avail:
            fits = False
            estimate = _longest(lambda t, lo=lo, hi=hi: stage_need(lo, hi, t)[1] <= avail, L)
        if gs:
            b = avail // page // gs
            blocks = b if blocks is None else min(blocks, b)
    num_blocks = blocks or 0
    groups = tuple(VLLMGroup(k[0], k[1], idx, page, _request_blocks(k, s, L)) for k, idx in raw)
    per_request = sum(g.blocks_per_request for g in groups)
    concurrency = num_blocks / per_request
    tokens = num_blocks // len(groups) * bs

    lines = [f"Available KV cache memory: {avail / GIB:.2f} GiB"]
    if fits:
        lines += [f"GPU KV cache size: {tokens:,} tokens",
                  f"Maximum concurrency for {L:,} tokens per request: {concurrency:.2f}x"]
    else:
        est = (f"Based on the available memory, the estimated maximum model length is {estimate}. "
               if estimate else "")
        lines.append(f"ValueError: To serve at least one request with the models's max seq len ({L}), "
                     f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache "
                     f"memory ({format_gib(avail)} GiB). {est}Try increasing `gpu_memory_utilization` or "
                     "decreasing `max_model_len` when initializing the engine.")
    each = " per GPU" if s.tp * s.pp > 1 else ""
    formula = [f"page = {page_text} = {page:,} B per layer and block",
               f"groups: {len(groups)} of {group_size} layers ("
               + ", ".join(f"{g.kind}{'' if g.span is None else ' ' + format(g.span, ',')}" for g in groups) + ")"]
    if s.pp > 1:
        formula.append(f"pipeline stages (layers): {', '.join(f'{a}-{b - 1}' for a, b in stages)}; "
                       "blocks = the smallest over the stages")
    formula += [f"blocks = {avail:,} B{each} // {page:,} B // {max(stage_need(a, b, L)[0] for a, b in stages)} "
                f"layers = {num_blocks:,}",
                f"GPU KV cache size = {num_blocks:,} // {len(groups)} groups x {bs} = {tokens:,} tokens",
                f"one request of {L:,} tokens: " + " + ".join(_request_blocks_text((g.kind, g.span), s, L) for g in groups)
                + (f"; {per_request:,} blocks in all" if len(groups) > 1 else " blocks"),
                f"max concurrency = {num_blocks:,} / {per_request:,} = {concurrency:.4f}"]
    notes = []
    if any(k[0] in ("sliding", "chunked") for k, _ in raw):
        notes.append(f"sliding and chunked groups hold at most window (or chunk) + max_num_batched_tokens "
                     f"({s.max_num_batched_tokens:,}) tokens a request: set --max-num-batched-tokens to the server's")
    if len(groups) > 1 and sum(len(idx) for _, idx in raw) < len(groups) * group_size:
        pad = len(groups) * group_size - spec.kv_layers
        notes.append(f"{pad} padding layer(s): vLLM pads every group to {group_size} layers")
    if s.hybrid and any(k[0] == "chunked" for k, _ in raw):
        notes.append("vLLM turns its hybrid KV-cache manager off for chunked local attention unless "
                     "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 (off by default in most releases): "
                     "without the variable, pass --no-hybrid-kv-cache-manager")
    if spec.mla is not None and bs != 64:
        notes.append("vLLM's MLA backends (FlashMLA, CUTLASS MLA) use 64-token (or larger) blocks: pass the "
                     "server's --block-size")
    if spec.max_positions is not None and L > spec.max_positions:
        notes.append(f"max_model_len {L:,} is beyond max_position_embeddings {spec.max_positions:,}: vLLM refuses it "
                     "unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    return VLLMSizing(s, heads, page, group_size, groups, tuple(stages), num_blocks, tokens, concurrency, fits, needed,
                      estimate, tuple(lines), tuple(formula), tuple(notes))
