"""vLLM V1's KV-cache sizing, reproduced from the config: blocks, the "GPU KV cache size" /
"Maximum concurrency" line and the too-long error, before the engine is started.

Followed from the vLLM 0.33.0 sdist (line numbers of that version), rule by rule:

- page (v1/kv_cache_interface.py:585-602): each attention layer's block of ``block_size`` tokens
  holds ``block x KV heads per GPU x head_dim x 2 (K, V) x dtype bytes``; MLA keeps one latent of
  (kv_lora_rank + qk_rope_head_dim) per token. KV heads per GPU are max(1, KV heads // TP); fp8 is
  one byte a value. A speculative draft's layers (--draft-config) get their own pages beside the
  target's: vLLM allocates KV for EAGLE and draft-model layers like any other attention layer.
- groups (v1/core/kv_cache_planning.py:1113-1200): one spec everywhere -> one group; one kind of
  attention with different pages (a draft with other KV heads) -> one group of all layers
  (UniformTypeKVCacheSpecs); several kinds with one page size -> groups of equal size: the smallest
  kind's count (the largest when under 1.5x the smallest), each kind split into ceil(n / size)
  groups, layer i::n (_get_kv_cache_groups_uniform_page_size, :416-560). Several kinds with mixed page
  sizes are first unified (:346-410): smaller pages take more tokens a block, or are padded
  (server_vllm_groups); with a block-outermost VLLM_KV_CACHE_LAYOUT mixed pages are packed side by
  side instead (:914-1043, server_vllm_groups.pack_layers).
- bytes per block (:574-605): the largest group's pages, each rounded up to the block-stride alignment,
  summed; blocks = available // that
  (get_kv_cache_config_from_groups, :642-681); per pipeline stage with the stage's own share of
  each group, then the smallest over the stages (:1461-1590).
- a request's blocks (kv_cache_interface.py:640-646, 917-955): full ceil(L / block); sliding
  ceil(min(W - 1 + in flight, L) / block) + 1; chunked ceil(min(C + in flight, L) / block), in
  flight = max_concurrent_batches x max_num_batched_tokens (server_vllm_defaults);
  concurrency = blocks / the sum over groups (kv_cache_utils.py:1061-1093).
- the line (kv_cache_utils.py:1120-1153): "GPU KV cache size: int(concurrency x max_model_len)
  tokens, Maximum concurrency for L tokens per request: Cx", one line ("CPU" on the CPU backend).
  Older vLLM printed blocks // groups x block size (or blocks x block size), on two lines.
- too long (kv_cache_planning.py:50-86, 1528-1559): a stage needs bytes per block x that sum; it is
  checked against the available memory less the one null block the block pool holds back; more
  raises vLLM's error, with the longest L that fits (a binary search up to L).

Linear-attention and Mamba layers (vLLM's MambaSpec pads pages to the attention page) and layers
sharing another layer's cache are not modelled: such models are refused with a sentence saying so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvviz.calculator.server_vllm_defaults import (
    DEFAULT_BATCHED_TOKENS, DEVICES, VLLMSettings, default_batched_tokens, device_label,
)
from kvviz.calculator.server_vllm_groups import (
    BLOCK_OUTERMOST_NOTE, KV_CACHE_LAYOUTS, LEGACY_LAYOUT_NAMES, LayerSpec, block_outermost, bytes_per_block,
    group_layers, pack_layers,
)
from kvviz.calculator.server_vllm_kv import kv_dtype_problem, slot_bytes
from kvviz.calculator.server_vllm_notes import DOCS_URL, format_gib, sizing_notes, too_long_text
from kvviz.calculator.spec import CalcError, Layer, ModelSpec
from kvviz.units import GIB

__all__ = ["DEFAULT_BATCHED_TOKENS", "VLLMSettings", "VLLMSizing", "default_batched_tokens", "vllm_sizing"]

SOURCES = ("vllm/v1/kv_cache_interface.py", "vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/kv_cache_planning.py",
           "vllm/config/vllm.py", "vllm/engine/arg_utils.py", "vllm/platforms/cpu.py", "vllm/distributed/utils.py")


@dataclass(frozen=True)
class VLLMGroup:
    """One KV-cache group: its spec, its layers and what one max-length request takes from it."""

    kind: str  # full, sliding, chunked, mla
    span: int | None
    layers: tuple[int, ...]  # layer indices (the target's; the draft's numbered from the target's n_layers)
    page_bytes: int  # per layer and block (the largest, when a uniform-type group mixes pages)
    blocks_per_request: int
    block_size: int = 0  # tokens a block: --block-size, or more where unify rescaled the group's pages

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "span": self.span, "layers": list(self.layers), "n_layers": len(self.layers),
                "page_size_bytes": self.page_bytes, "blocks_per_request": self.blocks_per_request,
                "block_size": self.block_size}


@dataclass(frozen=True)
class VLLMSizing:
    settings: VLLMSettings
    kv_heads_per_gpu: int | None  # None under MLA
    page_bytes: int
    group_size: int  # layers per group (padding included)
    groups: tuple[VLLMGroup, ...]
    stages: tuple[tuple[int, int], ...]  # pipeline stages' [start, end) layers
    num_blocks: int
    kv_cache_tokens: int  # what vLLM 0.33 prints: int(concurrency x max_model_len)
    max_concurrency: float
    fits: bool
    needed_bytes: int  # one max-length request, on the stage that needs most
    estimated_max_model_len: int | None  # only when it does not fit (vLLM's estimate)
    lines: tuple[str, ...]  # what vLLM would log
    formula: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    bytes_per_block: int = 0  # the largest stage group's pages summed (kv_cache_planning.py:574-605)
    draft_layers: int = 0

    @property
    def tokens_legacy(self) -> int:
        """vLLM before the group-aware line: blocks x block size."""
        return self.num_blocks * self.settings.block_size

    @property
    def tokens_by_groups(self) -> int:
        """vLLM 0.9-0.11's line: blocks // groups x block size."""
        return self.num_blocks // len(self.groups) * self.settings.block_size

    @property
    def tokens_newest(self) -> int:
        return self.kv_cache_tokens

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "name": "vllm", "device": s.device, "block_size": s.block_size, "kv_dtype": s.kv_dtype, "tp": s.tp,
            "pp": s.pp, "available_kv_bytes": s.kv_memory_bytes, "max_model_len": s.max_model_len,
            "max_num_batched_tokens": s.max_num_batched_tokens, "async_scheduling": s.async_scheduling
            and s.device != "cpu", "tokens_in_flight": s.in_flight, "hybrid_kv_cache_manager": s.hybrid,
            "draft_layers": self.draft_layers, "pp_layer_partition": list(s.pp_layers) or None,
            "stage_available_kv_bytes": list(s.stage_memory) or None, "kv_cache_layout": resolved_layout(s),
            "kv_heads_per_gpu": self.kv_heads_per_gpu,
            "page_size_bytes": self.page_bytes, "bytes_per_block": self.bytes_per_block,
            "group_size": self.group_size, "groups": [g.to_dict() for g in self.groups],
            "pp_stages": [list(st) for st in self.stages], "num_blocks": self.num_blocks,
            "kv_cache_tokens": self.kv_cache_tokens, "kv_cache_tokens_by_groups": self.tokens_by_groups,
            "max_concurrency": self.max_concurrency,
            "fits": self.fits, "needed_bytes": self.needed_bytes,
            "estimated_max_model_len": self.estimated_max_model_len, "log_lines": list(self.lines),
            "formula": list(self.formula), "notes": list(self.notes), "sources": list(SOURCES),
        }


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pp_partition(n_layers: int, pp: int, layers: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """vLLM's get_pp_indices (vllm/distributed/utils.py:198-241): VLLM_PP_LAYER_PARTITION's layers per
    stage when given, else even shares with the remainder one layer each to the stages before the last
    (from the second-to-last backwards)."""
    if layers:
        parts = list(layers)
    else:
        parts = [n_layers // pp] * pp
        for i in range(2, n_layers % pp + 2):
            parts[-i] += 1
    out, start = [], 0
    for p in parts:
        out.append((start, start + p))
        start += p
    return out


def _model_problems(spec: ModelSpec, s: VLLMSettings, what: str) -> list[str]:
    out: list[str] = []
    if spec.n_heads % s.tp:
        out.append(f"Total number of attention heads ({spec.n_heads}) must be divisible by tensor parallel size "
                   f"({s.tp}) (vLLM refuses this TP{what})")
    if spec.linear_layers:
        out.append(f"{spec.linear_layers} linear-attention / Mamba layers{what}: vLLM pads their state pages to the "
                   "attention page, which kvviz does not model yet; size this model without --engine vllm")
    if not spec.kv_layers:
        out.append(f"no layer keeps K/V{what}: vLLM allocates no KV blocks for this model")
    return out


def vllm_problems(spec: ModelSpec, s: VLLMSettings) -> list[str]:
    out: list[str] = []
    for model in (spec, s.draft):
        problem = None if model is None else kv_dtype_problem(s.kv_dtype, model.mla is not None)
        if problem and problem not in out:
            out.append(problem)
    if s.device not in DEVICES:
        out.append(f"the vLLM device is {' or '.join(DEVICES)} (got {s.device!r})")
    out += _model_problems(spec, s, "")
    if s.draft is not None:
        out += _model_problems(s.draft, s, " in the draft")
    if s.pp > spec.n_layers:
        out.append(f"pp {s.pp} is more than the {spec.n_layers} layers")
    for name, v in (("block size", s.block_size), ("max_model_len", s.max_model_len),
                    ("max_num_batched_tokens", s.max_num_batched_tokens), ("pp", s.pp), ("tp", s.tp)):
        if v < 1:
            out.append(f"{name} must be positive (got {v})")
    if s.kv_memory_bytes < 0 or any(m < 0 for m in s.stage_memory):
        out.append("the available KV memory cannot be negative")
    if s.pp_layers and len(s.pp_layers) != s.pp:  # distributed/utils.py:220-223, vLLM's own words
        out.append(f"len(partitions)={len(s.pp_layers)} does not match pp_size={s.pp} (VLLM_PP_LAYER_PARTITION)")
    elif s.pp_layers and sum(s.pp_layers) != spec.n_layers:
        out.append(f"sum(partitions)={sum(s.pp_layers)} does not match num_hidden_layers={spec.n_layers} "
                   "(VLLM_PP_LAYER_PARTITION)")
    if s.pp_layers and min(s.pp_layers) < 1:
        out.append("every stage of VLLM_PP_LAYER_PARTITION needs at least one layer")
    if s.stage_memory and len(s.stage_memory) != s.pp:
        out.append(f"{len(s.stage_memory)} per-stage memories for {s.pp} pipeline stages")
    return out + _layout_problems(s)


def resolved_layout(s: VLLMSettings) -> str:
    """The KV-cache layout vLLM resolves (backends/utils.py:293-380): VLLM_KV_CACHE_LAYOUT when set (NHD / HND
    as aliases, config/cache.py:33-41), else the first the backends support: the CPU backend's LBHNC
    (cpu_attn.py:82-84), LBNHC for backends that declare none (FlashAttention; utils.py:227-236)."""
    if s.kv_cache_layout is not None:
        return LEGACY_LAYOUT_NAMES.get(s.kv_cache_layout, s.kv_cache_layout)
    return "LBHNC" if s.device == "cpu" else "LBNHC"


def _layout_problems(s: VLLMSettings) -> list[str]:
    """vLLM's own refusals of VLLM_KV_CACHE_LAYOUT (config/cache.py:38-41; backends/utils.py:362-368)."""
    if s.kv_cache_layout is None:
        return []
    name = resolved_layout(s)
    if name not in KV_CACHE_LAYOUTS:
        return [f"Unknown KV cache layout {name!r}. Valid layouts: {list(KV_CACHE_LAYOUTS)} (VLLM_KV_CACHE_LAYOUT)"]
    if s.device == "cpu" and name != "LBHNC":
        return [f"VLLM_KV_CACHE_LAYOUT={s.kv_cache_layout} does not satisfy every supported set; valid layouts: "
                "['LBHNC'] (the CPU backend reads head-major blocks only, cpu_attn.py:82-84)"]
    return []


def _layout_refusal(layout: str, pages: set[int], n_groups: int) -> str | None:
    """validate_kv_cache_layout (kv_cache_planning.py:608-639): mixed pages need a block-compact layout (L and B
    the two outer dimensions) and, with several groups, the layer inside the block."""
    if len(pages) == 1:
        return None
    compact, layer_outer = layout[:2] in ("LB", "BL"), layout.startswith("L")
    if compact and not (n_groups > 1 and layer_outer):
        return None
    return (f"KV cache layout {layout} cannot express this model's mixed page sizes ({sorted(pages)}); a backend "
            "should declare block-outermost supported layouts (e.g. BLHNC), or set VLLM_KV_CACHE_LAYOUT=BLHNC.")


def _page(spec: ModelSpec, s: VLLMSettings) -> tuple[int, int | None, str]:
    """(page bytes, KV heads per GPU, how) of one of this model's layers (AttentionSpec.page_size_bytes)."""
    bs = s.block_size
    if spec.mla is not None:  # one latent "head", never split by TP
        content, how = slot_bytes(s.kv_dtype, spec.mla.latent_dim, 0)
        return bs * content, None, f"{bs} tokens x {how}"
    heads = max(1, spec.n_kv_heads // s.tp)
    content, how = slot_bytes(s.kv_dtype, spec.head_dim, spec.head_dim)
    return bs * heads * content, heads, f"{bs} tokens x {heads} KV heads x {how}"


def _layer_key(spec: ModelSpec, layer: Layer, hybrid: bool) -> tuple[str, int | None]:
    if spec.mla is not None:
        return "mla", None
    if not hybrid or not layer.caps:
        return "full", None
    return layer.kind, layer.span


def _layer_specs(spec: ModelSpec, s: VLLMSettings) -> list[LayerSpec]:
    out = []
    for model, first in ((spec, 0), (s.draft, spec.n_layers)):
        if model is None:
            continue
        page, _, how = _page(model, s)
        shape = how.split(" tokens x ", 1)[1]
        for i in range(model.n_layers):
            layer = model.layer(i)
            if model.own_kv(i):  # a layer reading another's cache (kv_sharing_target_layer_name) has no spec
                kind, span = _layer_key(model, layer, s.hybrid)
                out.append(LayerSpec(first + i, kind, span, page, shape, s.block_size))
    return out


Key = tuple[str, "int | None"]


def _request_blocks(key: Key, s: VLLMSettings, max_len: int, block: int | None = None) -> int:
    """Blocks one request of ``max_len`` tokens can hold in a group of this spec (max_memory_usage_bytes / page;
    kv_cache_interface.py:640-646 full, 917-955 sliding, the chunked spec alike without the +1); ``block``: the
    group's own block size when unify rescaled it (kv_cache_planning.py:392-395), else --block-size."""
    kind, span = key
    bs = block or s.block_size
    if kind == "sliding":
        return cdiv(min((span or 0) - 1 + s.in_flight, max_len), bs) + 1
    if kind == "chunked":
        return cdiv(min((span or 0) + s.in_flight, max_len), bs)
    return cdiv(max_len, bs)


def _request_blocks_text(key: tuple[str, int | None], s: VLLMSettings, max_len: int, block: int | None = None) -> str:
    """How ``_request_blocks`` counts a group's blocks, in words and numbers (the formula shows it)."""
    kind, span = key
    bs = block or s.block_size
    n = _request_blocks(key, s, max_len, bs)
    if kind == "sliding":
        return (f"{kind} {span or 0:,}: ceil(min({span or 0:,} - 1 + {s.in_flight:,}, {max_len:,}) / {bs})"
                f" + 1 = {n:,}")
    if kind == "chunked":
        return f"{kind} {span or 0:,}: ceil(min({span or 0:,} + {s.in_flight:,}, {max_len:,}) / {bs}) = {n:,}"
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


def _stage_layers(n_target: int, n_all: int, s: VLLMSettings) -> list[tuple[int, int]]:
    """Each stage's [start, end) over the target's layers; the draft's layers (numbered after them) are
    on the last stage, where the drafter runs beside the target's last layers."""
    stages = pp_partition(n_target, s.pp, s.pp_layers)
    if n_all > n_target:
        a, _ = stages[-1]
        stages[-1] = (a, n_all)
    return stages


def vllm_sizing(spec: ModelSpec, s: VLLMSettings) -> VLLMSizing:
    """What vLLM V1 allocates and logs for this model and these flags; CalcError for what vLLM refuses."""
    problems = vllm_problems(spec, s)
    if problems:
        raise CalcError(problems)
    bs = s.block_size
    page, heads, page_text = _page(spec, s)
    layers = _layer_specs(spec, s)
    layout = resolved_layout(s)
    outer = block_outermost(layout)
    # get_kv_cache_groups (kv_cache_planning.py:1159-1164): a block-outer layout packs mixed pages, unified
    # otherwise; pack_layers says None when the pages are one size
    packed = pack_layers(layers) if outer else None
    grouping = packed or group_layers(layers)
    group_size = grouping.group_size
    pages = {ly.index: ly.page for g in grouping.groups for ly in g}  # after unify: rescaled or padded
    refusal = _layout_refusal(layout, set(pages.values()), len(grouping.groups))
    if refusal:
        raise CalcError([refusal])
    raw = [((g[0].kind, g[0].span), tuple(ly.index for ly in g), g[0].block_size) for g in grouping.groups]
    n_target = sum(1 for i in range(spec.n_layers) if spec.own_kv(i))
    stages = _stage_layers(spec.n_layers, spec.n_layers + (s.draft.n_layers if s.draft else 0), s)
    avail, L = s.kv_memory_bytes, s.max_model_len

    def stage_block(lo: int, hi: int) -> int:
        """Bytes per block on this stage: its largest group's pages, each rounded up to the block-stride
        alignment (1 on the backends kvviz sizes, see server_vllm_groups), summed (kv_cache_planning.py:574-584)."""
        return bytes_per_block([[pages[i] for i in idx if lo <= i < hi] for _, idx, _ in raw], block_outer=outer)

    def stage_need(lo: int, hi: int, max_len: int) -> int:
        """Bytes one request of max_len needs on this stage (_max_memory_usage_bytes_from_groups)."""
        return stage_block(lo, hi) * sum(_request_blocks(k, s, max_len, b) for k, _, b in raw)

    blocks, needed, estimate, fits, bpb_max, check_shown = None, 0, None, True, 0, avail
    for st, (lo, hi) in enumerate(stages):
        avail = s.stage_memory[st] if s.stage_memory else s.kv_memory_bytes  # each worker profiles its own
        bpb = stage_block(lo, hi)
        need = stage_need(lo, hi, L)
        needed = max(needed, need)
        check = avail if s.older else avail - bpb  # less the null block (kv_cache_planning.py:1528-1537)
        if fits and need > check:
            fits, check_shown = False, check
            estimate = _longest(lambda t, lo=lo, hi=hi, c=check: stage_need(lo, hi, t) <= c, L)
        if bpb:
            bpb_max = max(bpb_max, bpb)
            b = avail // bpb
            blocks = b if blocks is None else min(blocks, b)
    num_blocks = blocks or 0
    groups = tuple(VLLMGroup(k[0], k[1], idx, max(pages[i] for i in idx), _request_blocks(k, s, L, b), b)
                   for k, idx, b in raw)
    per_request = sum(g.blocks_per_request for g in groups)
    concurrency = num_blocks / per_request
    tokens = int(concurrency * L)  # get_kv_cache_capacity (kv_cache_utils.py:1120-1128), float as vLLM's
    dev = device_label(s.device)

    lines = ([f"(stage {i}) Available KV cache memory: {m / GIB:.2f} GiB" for i, m in enumerate(s.stage_memory)]
             if s.stage_memory else [f"Available KV cache memory: {s.kv_memory_bytes / GIB:.2f} GiB"])
    if fits:
        lines.append(f"{dev} KV cache size: {tokens:,} tokens, Maximum concurrency for {L:,} tokens per request: "
                     f"{concurrency:.2f}x")
    else:
        lines.append(too_long_text(L, needed, check_shown, estimate, s.older))
    each = " per GPU" if s.tp * s.pp > 1 else ""
    n_draft = len(layers) - n_target
    formula = [f"page = {page_text} = {page:,} B per layer and block"]
    if s.draft is not None:
        dpage = _page(s.draft, s)
        formula.append(f"draft: {n_draft} layer(s), page = {dpage[2]} = {dpage[0]:,} B")
    sizes = (f"packed, of {', '.join(str(len(g.layers)) for g in groups)} layers" if packed
             else f"of {group_size} layers")
    formula.append(f"groups: {len(groups)} {sizes} ("
                   + ", ".join(f"{g.kind}{'' if g.span is None else ' ' + format(g.span, ',')}" for g in groups) + ")")
    if s.pp > 1:
        formula.append(f"pipeline stages (layers): {', '.join(f'{a}-{b - 1}' for a, b in stages)}; "
                       "blocks = the smallest over the stages")
    formula += [f"blocks = {s.kv_memory_bytes:,} B{each} // {bpb_max:,} B a block (the largest group's pages) = "
                f"{num_blocks:,}" if not s.stage_memory else
                "blocks = min over the stages of (the stage's memory // its bytes a block) = " + f"{num_blocks:,}",
                f"one request of {L:,} tokens: " + " + ".join(_request_blocks_text((g.kind, g.span), s, L, g.block_size)
                                                              for g in groups)
                + (f"; {per_request:,} blocks in all" if len(groups) > 1 else " blocks"),
                f"max concurrency = {num_blocks:,} / {per_request:,} = {concurrency:.4f}",
                f"{dev} KV cache size = int({concurrency:.4f} x {L:,}) = {tokens:,} tokens"]
    # packed groups are not padded to one size (kv_cache_planning.py:1026-1039): no padding-layer note for them
    notes = list(grouping.rescaled) + sizing_notes(spec, s, [k for k, _, _ in raw], 1 if packed else len(groups),
                                                   group_size, len(layers))
    if packed:
        notes.append(f"{layout}: block-outermost, each block holds every layer's own page side by side (pages of "
                     + ", ".join(f"{p:,}" for p in sorted({ly.page for ly in layers})) + " B; kv_cache_planning.py:"
                     "914-1043); groups are not padded to one size")
    elif len({ly.page for ly in layers}) > 1 and len(groups) > 1:
        notes.append(BLOCK_OUTERMOST_NOTE)
    return VLLMSizing(s, heads, page, group_size, groups, tuple(stages), num_blocks, tokens, concurrency, fits, needed,
                      estimate, tuple(lines), tuple(formula), tuple(notes), bpb_max, n_draft)
