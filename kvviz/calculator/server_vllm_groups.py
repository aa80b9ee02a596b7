"""vLLM V1's KV-cache groups and bytes per block, from each layer's spec, as vLLM 0.33.0 plans them
(line numbers of that sdist's vllm/v1/core/kv_cache_planning.py unless named otherwise).

- grouping (get_kv_cache_groups, :1113-1200): every layer's spec equal -> one group (:1138); one type
  of attention at one block size (a draft with other KV heads beside the target's full attention)
  -> one UniformTypeKVCacheSpecs group of all layers (:1143); otherwise the pages are unified first
  (unify_kv_cache_spec_page_size, :346-410): a layer whose page divides the largest gets
  ``block_size x ratio`` tokens a block (:392-395), another non-MLA attention layer's page is padded
  to the largest (:396-399), an MLA page that does neither cannot be unified (:400-405); then
  _get_kv_cache_groups_uniform_page_size (:416-560) buckets equal specs (:484-486; specs differing
  only in window or chunk merge, :487-509, which here means the full-attention view kvviz keys
  --no-hybrid-kv-cache-manager's layers by), takes the smallest bucket's count as the group size
  (the largest when under 1.5x the smallest, :519-533) and splits bucket i::n (:534-559).
- bytes per block (_get_kv_cache_bytes_per_block, :574-605) on the layer-outer layouts vLLM resolves
  by default (LBNHC first, vllm/v1/attention/backends/utils.py:229-236; the CPU backend's LBHNC,
  cpu_attn.py:82-84): the largest group's layers, each page rounded up to its block-stride alignment
  (_get_layer_block_stride, :569-571), summed. The alignment is 1 unless the attention backend
  declares only fixed kernel block sizes (v1/worker/utils.py:476-486) and vLLM's block is not that
  kernel block (kv_cache_interface.py:224-235), when it is one kernel block's page: a divisor of the
  page for every attention page kvviz builds, so the rounding leaves those unchanged (it matters for
  DeepSeek-V4's row-aligned pages, which kvviz does not model).

- the block-outermost packing (pack_layers; _get_packed_kv_cache_groups, :914-1043, called before unify at
  :1159-1164): with a layout whose outermost dimension is the block (VLLM_KV_CACHE_LAYOUT=BLHNC, BLNHC or
  BHLNC; vllm/v1/kv_cache_layout.py:23-28, 55-58) and mixed pages, nothing is unified: the layers are bucketed by
  uniform type, each block holds every layer's own page side by side, and the bytes per block are the
  widest group's pages summed, rounded up to the lcm of the alignments (:586-605).

Not modelled, said in one line where it would apply: the DCP case that also selects a block-outer layout
(vllm/v1/attention/backends/utils.py:345-361; kvviz has no DCP), Mamba / linear-attention state pages, and
layers reading another layer's cache (they have no spec).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from kvviz.calculator.spec import CalcError

BLOCK_OUTERMOST_NOTE = ("with a block-outermost KV layout (VLLM_KV_CACHE_LAYOUT=BLHNC/BLNHC/BHLNC) vLLM packs mixed "
                        "pages side by side in one block instead (kv_cache_planning.py:914-1043; `kvviz memory "
                        "--kv-cache-layout BLHNC` sizes that); these figures are for the default layer-outer layout")
# vllm/v1/kv_cache_layout.py:23-28: the physical orders of [L, B, H, N, C]; B first = block-outermost (:55-58)
KV_CACHE_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
LEGACY_LAYOUT_NAMES = {"NHD": "LBNHC", "HND": "LBHNC"}  # config/cache.py:33-41 (_LAYOUT_COMPAT_ALIASES)


@dataclass(frozen=True)
class LayerSpec:
    """One layer's KV-cache spec as vLLM's planner sees it (the fields that make two specs equal)."""

    index: int  # in the whole model: the target's layers, then the draft's
    kind: str  # full, sliding, chunked, mla
    span: int | None
    page: int  # page_size_bytes: padded, when unify padded it
    shape: str  # what else makes the spec (KV heads x head size x dtype): equal specs share it
    block_size: int
    padded_from: int | None = None  # the unpadded page, when unify padded it

    @property
    def key(self) -> tuple:
        return (self.kind, self.span, self.shape, self.block_size, self.page)


@dataclass(frozen=True)
class Grouping:
    group_size: int
    groups: tuple[tuple[LayerSpec, ...], ...]  # each group's layers, their specs after unify
    rescaled: tuple[str, ...] = ()  # what unify did, in words


def unify_pages(layers: list[LayerSpec]) -> tuple[list[LayerSpec], list[str]]:
    """unify_kv_cache_spec_page_size (kv_cache_planning.py:346-410): every page made the largest one."""
    top = max(ly.page for ly in layers)
    out, said = [], {}
    for ly in layers:
        if ly.page == top:
            out.append(ly)
        elif top % ly.page == 0:  # :392-395: more tokens a block, the same bytes as the largest page
            ratio = top // ly.page
            out.append(replace(ly, block_size=ly.block_size * ratio, page=top))
            said.setdefault((ly.kind, ly.shape), f"{ly.kind} pages of {ly.page:,} B ({ly.shape}) hold "
                            f"{ly.block_size * ratio} tokens a block ({ratio} x {ly.block_size}) to match "
                            f"{top:,} B (kv_cache_planning.py:392-395)")
        elif ly.kind != "mla":  # :396-399: a strided view over a padded page
            out.append(replace(ly, page=top, padded_from=ly.page))
            said.setdefault((ly.kind, ly.shape), f"{ly.kind} pages of {ly.page:,} B ({ly.shape}) padded to "
                            f"{top:,} B, {top - ly.page:,} B unused a block (kv_cache_planning.py:396-399)")
        else:
            raise CalcError([f"an MLA page of {ly.page:,} B neither divides nor can be padded to {top:,} B: vLLM "
                             "cannot unify these pages (kv_cache_planning.py:400-405) and refuses the model"])
    return out, list(said.values())


def _uniform_type(ly: LayerSpec) -> tuple:
    """What UniformTypeKVCacheSpecs.is_uniform_type compares: the block size and the registered base type
    (MLA is registered under full attention, v1/core/single_type_kv_cache_manager.py:2709), a window's or
    chunk's size (kv_cache_interface.py:959-966 and the chunked spec's alike)."""
    return ("full" if ly.kind == "mla" else ly.kind, ly.span, ly.block_size)


def _full_allocation_fallback(layers: list[LayerSpec]) -> Grouping | None:
    """_try_get_full_allocation_fallback_groups (kv_cache_planning.py:819-850): MLA beside plain sliding-window
    layers (no chunked ones) whose pages cannot be unified: the sliding layers are allocated as full attention
    (_promote_local_kv_cache_specs, :744-816; their compute keeps the window) and all layers form one
    uniform-type group."""
    kinds = {ly.kind for ly in layers}
    if not ("mla" in kinds and "sliding" in kinds) or "chunked" in kinds:
        return None
    promoted = tuple(replace(ly, kind="full", span=None) if ly.kind == "sliding" else ly for ly in layers)
    return Grouping(len(promoted), (promoted,), (
        "KV cache page sizes cannot be unified; treating sliding-window layers as full attention for cache "
        "allocation (vLLM's warning, kv_cache_planning.py:845-849): every layer holds the whole request",))


def group_layers(layers: list[LayerSpec]) -> Grouping:
    """get_kv_cache_groups (kv_cache_planning.py:1113-1200) over kvviz's layer specs."""
    if len({ly.key for ly in layers}) == 1 or len({_uniform_type(ly) for ly in layers}) == 1:
        # :1138 one spec / :1143 one type (UniformTypeKVCacheSpecs, kv_cache_interface.py:1347-1361)
        return Grouping(len(layers), (tuple(layers),))
    rescaled: list[str] = []
    if len({ly.page for ly in layers}) > 1:
        try:
            layers, rescaled = unify_pages(layers)
        except CalcError:
            fallback = _full_allocation_fallback(layers)
            if fallback is None:
                raise
            return fallback
    buckets: dict[tuple, list[LayerSpec]] = {}
    for ly in layers:  # :484-509, in the layers' order
        buckets.setdefault(ly.key, []).append(ly)
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < min(sizes) * 1.5:  # :524-533
        group_size = max(sizes)
    out = []
    for members in buckets.values():
        n = -(-len(members) // group_size)
        out += [tuple(members[i::n]) for i in range(n)]  # :534-559
    return Grouping(group_size, tuple(out), tuple(rescaled))


def stride_alignment(block_size: int, kernel_sizes: tuple[int, ...], page_of: Callable[[int], int]) -> int:
    """KVCacheSpec.get_block_stride_alignment (kv_cache_interface.py:224-235) after customize_attention_spec
    (v1/worker/utils.py:476-486): a backend whose kernel block sizes are all fixed sets MultipleOf(the
    largest); the alignment is then 1 when gcd(that, block) is the block, else one kernel block's page
    (``page_of(tokens)``). Backends that take any multiple (FlashAttention's MultipleOf(16), the CPU
    backend's MultipleOf(32)) set none: 1."""
    if not kernel_sizes:
        return 1
    kernel = math.gcd(max(kernel_sizes), block_size)
    return 1 if kernel == block_size else page_of(kernel)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def bytes_per_block(groups: list[list[int]], alignment: int = 1, block_outer: bool = False) -> int:
    """_get_kv_cache_bytes_per_block (kv_cache_planning.py:574-605) over ``groups`` (the pages of each group's
    layers). Layer-outer (:578-584): the largest group's layers, each page rounded up to the block-stride
    alignment (_get_layer_block_stride, :569-571), summed. Block-outer (:586-605): the largest group's pages
    summed, the sum rounded up to the alignment (the lcm of every layer's, one value here)."""
    if block_outer:
        return round_up(max((sum(pages) for pages in groups), default=0), alignment)
    return max((sum(round_up(p, alignment) for p in pages) for pages in groups), default=0)


def block_outermost(layout: str | None) -> bool:
    """KVCacheLayout.is_block_outermost (vllm/v1/kv_cache_layout.py:55-58): B is the outermost dimension."""
    return layout is not None and LEGACY_LAYOUT_NAMES.get(layout, layout).startswith("B")


def approximate_gcd(values: list[int], lower_bound: int = 1) -> int:
    """_approximate_gcd (kv_cache_planning.py:879-911): the d in [lower_bound, max(values)] that pads the values
    least when each is rounded up to a multiple of d; ties go to the larger d; lower_bound when above the max."""
    lo, hi = max(1, lower_bound), max(values)
    if lo > hi:
        return lo
    best, best_pad = lo, None
    for d in range(lo, hi + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad <= best_pad:  # <=: a tie prefers the larger d (:907)
            best, best_pad = d, pad
    return best


def pack_layers(layers: list[LayerSpec]) -> Grouping | None:
    """_get_packed_kv_cache_groups (kv_cache_planning.py:914-1043) for a block-outermost layout: None when every
    page is one size (:930-932; the usual grouping then applies). Layers are bucketed first-fit by uniform type
    (:934-942); a bucket whose page sizes have equal layer counts is "balanced" (:944-955); balanced buckets
    that mix pages set the floor of pattern repeats per group (:960-967) and _approximate_gcd over every
    balanced bucket's repeats picks the count (:968-979); a balanced bucket is split into ceil(repeats /
    that) groups (:981-984). A sliding bucket when no repeat count was picked is a "state" bucket (:995-1000):
    it is split so that each group fits the widest bucket's block (:1002-1024). Pages keep their own
    sizes and every layer its --block-size: nothing is unified."""
    if len({ly.page for ly in layers}) <= 1:
        return None
    buckets: dict[tuple, list[LayerSpec]] = {}
    for ly in layers:  # first fit; is_uniform_type is an equivalence on kvviz's specs (_uniform_type)
        buckets.setdefault(_uniform_type(ly), []).append(ly)
    shaped = []  # (bucket, its layers by page size, balanced)
    for members in buckets.values():
        by_page: dict[int, list[LayerSpec]] = {}
        for ly in members:
            by_page.setdefault(ly.page, []).append(ly)
        shaped.append((members, by_page, len({len(v) for v in by_page.values()}) == 1))

    def most(by_page: dict[int, list[LayerSpec]]) -> int:  # get_max_layers_per_page_size (kv_cache_interface.py:1374-1379)
        return max(len(v) for v in by_page.values())

    floor = max((most(bp) for _, bp, bal in shaped if bal and len(bp) > 1), default=0)
    repeats = approximate_gcd([most(bp) for _, bp, bal in shaped if bal], floor) if floor else None

    def n_groups(by_page: dict[int, list[LayerSpec]], balanced: bool) -> int:
        return -(-most(by_page) // repeats) if balanced and repeats is not None else 1

    def is_state(members: list[LayerSpec]) -> bool:  # no Mamba / ring specs in kvviz: only the sliding case
        return repeats is None and members[0].kind == "sliding"

    def widest(by_page: dict[int, list[LayerSpec]], n: int) -> int:
        return sum(-(-len(v) // n) * page for page, v in by_page.items())

    anchor = max(widest(bp, len(m) if is_state(m) else n_groups(bp, bal)) for m, bp, bal in shaped)
    groups: list[tuple[LayerSpec, ...]] = []
    for members, by_page, balanced in shaped:
        n = n_groups(by_page, balanced)
        if anchor and is_state(members):
            per_block = max(anchor // members[0].page, 1)
            n = max(n, -(-len(members) // per_block))
        if n == 1:
            groups.append(tuple(members))
            continue
        pattern = list(zip(*by_page.values()))  # one layer of each page size a repeat (zip stops at the shortest)
        if len(pattern) * len(by_page) != len(members):
            raise CalcError([f"vLLM's block-outermost packing splits a bucket of {len(members)} {members[0].kind} "
                             "layers with unequal page-size counts by repeats and would leave layers out "
                             "(kv_cache_planning.py:1029-1039): kvviz does not size this case"])
        groups += [tuple(ly for rep in pattern[i::n] for ly in rep) for i in range(n)]
    return Grouping(max(len(g) for g in groups), tuple(groups))
