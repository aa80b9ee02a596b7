"""Live numbers of a run at its last step, and the cache-size formula with the numbers filled in.

Everything here is read from the Run and its events; nothing is recomputed from the model.
"""
from __future__ import annotations

import streamlit as st

from kvviz import Run
from kvviz.units import dtype_bytes, fmt_bytes, kv_bytes_per_token


def fmt_flops(n: float) -> str:
    """Short enough for a metric tile: '6.6 M' (the label says FLOPs)."""
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:,.1f} {unit}"
    return f"{n:,.0f}"


def fmt_ms(v: float | None) -> str:
    """Short enough for a metric tile at any width: a second or more in seconds ('1.98 s')."""
    if v is None:
        return "–"
    if v >= 1000:
        return f"{v / 1000:,.2f} s"
    return f"{v:,.1f} ms" if v >= 10 else f"{v:,.2f} ms"


def bytes_formula(run: Run) -> str:
    """Markdown (numbers only, no user text): the calculator formula for the cache at the last step."""
    if not run.events:
        return ""
    ev = run.events[-1]
    b = dtype_bytes(run.dtype)
    per_token = kv_bytes_per_token(run.n_layer, run.n_kv_head, run.head_dim, b, run.batch_size)
    factors = (f"2 (K and V) × {run.n_layer} layers × {run.n_kv_head} K/V heads × {run.head_dim} dims × "
               f"{b} B ({run.dtype})" + (f" × batch {run.batch_size}" if run.batch_size > 1 else ""))
    if not run.use_cache:
        would = per_token * ev.position
        return (f"**No cache: 0 B kept.** Keeping these {ev.position:,} tokens would take {factors} × "
                f"{ev.position:,} tokens = {would:,} B ({fmt_bytes(would)}); instead this step recomputed "
                f"K and V for all {ev.input_len:,} tokens.")
    used = per_token * ev.cache_len
    lines = [f"**Bytes used** = {factors} × {ev.cache_len:,} tokens = **{used:,} B** ({fmt_bytes(used)})"]
    # A layer holding fewer positions than the cache's length keeps only its window: Gemma 3's sliding
    # layers beside global ones, or Mistral's every layer (all equal, so only this test tells).
    share = int(per_token) // run.n_layer if run.n_layer else 0
    windowed = run.cache_kind in ("static", "paged") and any(b < share * ev.cache_len for b in ev.cache_layer_bytes)
    mixed = (len(set(ev.cache_layer_bytes)) > 1 or windowed) and run.n_layer
    if mixed and run.cache_kind == "paged":  # per layer: whole blocks, a sliding layer's only its window's
        held = sum(ev.cache_layer_bytes)
        used = ev.cache_bytes_used
        lines = [f"**Bytes held in blocks** = **{held:,} B** ({fmt_bytes(held)}): each layer's blocks × its share "
                 f"of a block; a sliding layer lets go of the blocks its window no longer reaches, a global one "
                 f"keeps every block. The positions they hold take **{used:,} B** ({fmt_bytes(used)})"]
    elif mixed:  # sliding layers hold only their window (Gemma 3): count each layer's own tokens
        layer_token = int(per_token) // run.n_layer
        held = [b // layer_token for b in ev.cache_layer_bytes] if layer_token else []
        groups = sorted({h: held.count(h) for h in held}.items(), reverse=True)
        terms = " + ".join(f"{n} layer{'s' if n != 1 else ''} × {h:,} tokens" for h, n in groups)
        used = layer_token * sum(held)
        lines = [f"**Bytes used** = {factors.replace(f'{run.n_layer} layers × ', '')} per layer and token "
                 f"({layer_token:,} B) × ({terms}) = **{used:,} B** ({fmt_bytes(used)}): a sliding layer "
                 f"keeps only its window, a global one every token"]
    if run.n_kv_head and run.n_kv_head < run.n_head:
        mha = used * run.n_head // run.n_kv_head
        share = (f"**GQA saves**: {run.n_head} query heads share {run.n_kv_head} K/V heads" if run.n_kv_head > 1 else
                 f"**MQA saves**: all {run.n_head} query heads read one K/V head")
        lines.append(f"{share}. With one K/V head per "
                     f"query head (MHA) these tokens would take {mha:,} B ({fmt_bytes(mha)}): "
                     f"{run.n_head // run.n_kv_head}× more, {mha - used:,} B saved.")
    if used != ev.cache_bytes_used:  # would mean the formula or the cache accounting is wrong: show both
        lines.append(f"⚠️ the cache reports {ev.cache_bytes_used:,} B used.")
    kinds = _slots_by_kind(run, ev.cache_bytes_allocated, int(per_token) // run.n_layer if run.n_layer else 0)
    if run.cache_kind == "static" and kinds:
        # Per layer kind, never one average (Gemma 3 270M's would be 1,792, a ring nor a context)
        lines.append(f"**Bytes allocated** = {factors.replace(f'{run.n_layer} layers × ', '')} per layer and slot "
                     f"× ({kinds}) = **{ev.cache_bytes_allocated:,} B** ({fmt_bytes(ev.cache_bytes_allocated)}): "
                     f"a ring of the window per sliding layer, every slot of the context per global layer; "
                     f"{used / max(1, ev.cache_bytes_allocated):.1%} filled")
    elif run.cache_kind == "static" and mixed:
        lines.append(f"**Bytes allocated** = **{ev.cache_bytes_allocated:,} B** "
                     f"({fmt_bytes(ev.cache_bytes_allocated)}): a ring of the window per sliding layer, "
                     f"every slot of the context per global layer; {used / max(1, ev.cache_bytes_allocated):.1%} filled")
    elif run.cache_kind == "static":
        slots = ev.cache_bytes_allocated // per_token if per_token else 0
        lines.append(f"**Bytes allocated** = {factors} × {slots:,} slots = **{ev.cache_bytes_allocated:,} B** "
                     f"({fmt_bytes(ev.cache_bytes_allocated)}), {used / max(1, ev.cache_bytes_allocated):.1%} filled")
    else:
        lines.append(f"**Bytes allocated** = bytes used ({fmt_bytes(ev.cache_bytes_allocated)}): torch.cat has "
                     f"copied {fmt_bytes(ev.cache_bytes_copied)} so far to grow it.")
    return "  \n".join(lines)


def _slots_by_kind(run: Run, allocated: int, layer_slot: int) -> str:
    """'2 sliding layers × 5 slots + 1 global layer × 64 slots' for a static cache over sliding and
    global layers, from its allocated bytes: a global layer holds the context's block_size slots, so
    the rest, split evenly, is each sliding layer's ring. '' when the run has one kind or it does not
    divide evenly (then no per-kind figure is exact)."""
    n_full = run.layer_kinds.count("full")
    n_sliding = run.layer_kinds.count("sliding")
    if not (n_full and n_sliding) or n_full + n_sliding != run.n_layer or layer_slot <= 0 or allocated % layer_slot:
        return ""
    ring, rest = divmod(allocated // layer_slot - n_full * run.block_size, n_sliding)
    if rest or ring <= 0:
        return ""
    def term(n: int, kind: str, slots: int) -> str:
        return f"{n} {kind} layer{'s' if n != 1 else ''} × {slots:,} slots"
    return f"{term(n_sliding, 'sliding', ring)} + {term(n_full, 'global', run.block_size)}"


class _Tiles:
    """``.metric`` into a horizontal row, each tile as wide as its content (the row spreads them)."""

    def __init__(self, row: object) -> None:
        self.row = row

    def metric(self, *args: object, **kw: object) -> None:
        self.row.metric(*args, width="content", **kw)  # type: ignore[attr-defined]


def render(run: Run | None, per_row: int = 6) -> None:
    """Six metrics in a row that wraps, then the formula. ``per_row`` is kept for the callers (the
    compact layout's narrower column holds about 3): each tile is as wide as its value and note, since
    a row of fixed columns cut "42 / 8,192" and "360.0 MiB allocated" at 1366 px."""
    row = st.container(horizontal=True, gap="medium" if per_row > 3 else "small")
    cols = [_Tiles(row)] * 6  # filled in order
    if run is None or not run.events:
        for col, name in zip(cols, ("TTFT", "Mean TPOT", "Decode tokens/s", "Cache length", "Cache bytes", "FLOPs this step")):
            col.metric(name, "–")
        return
    ev = run.events[-1]
    tps = run.decode_tokens_per_s  # decode steps only: a run of one token has none, and shows "–"
    cols[0].metric("TTFT", fmt_ms(run.ttft_ms), help="Time to first token: how long a user waits before the "
                   "first token appears. Here: the prefill forward pass over the whole prompt, plus sampling.")
    cols[1].metric("Mean TPOT", fmt_ms(run.mean_tpot_ms), help="Time per output token: how long each next token "
                   "takes once generation runs. Here: the mean over the decode steps (every step after the prefill).")
    cols[2].metric("Decode tokens/s", f"{tps:,.0f}" if tps else "–", help="Decode speed: 1000 / mean TPOT. "
                   "Forward passes and sampling of the decode steps only: no prefill, and drawing the page is not "
                   "counted. The end-to-end tokens/s under a finished run counts the wall clock of the whole run.")
    if run.use_cache:
        slots = f" / {run.block_size:,}" if run.cache_kind == "static" else ""
        cols[3].metric("Cache length", f"{ev.cache_len:,}{slots}", help="Tokens whose K and V the cache holds "
                       "(static: of the preallocated slots).")
        cols[4].metric("Cache bytes", fmt_bytes(ev.cache_bytes_used), f"{fmt_bytes(ev.cache_bytes_allocated)} "
                       "allocated", delta_color="off", delta_arrow="off",
                       help="Used: the filled positions. Allocated: what the cache's tensors hold.")
    else:
        cols[3].metric("Cache length", "0", help="No cache: nothing is kept between steps.")
        cols[4].metric("Cache bytes", "0 B", "nothing kept", delta_color="off", delta_arrow="off")
    fed = f"{ev.input_len:,} token{'s' if ev.input_len != 1 else ''} fed"
    cols[5].metric("FLOPs this step", fmt_flops(ev.flops), fed, delta_color="off", delta_arrow="off",
                   help="Analytic matmul FLOPs of this step's forward pass (kvviz.engine.generation.flops). Cached decode feeds "
                        "1 token; no cache feeds the whole sequence again.")
    st.markdown(bytes_formula(run))
