"""The paged KV cache's views, pure Plotly from plain data (``PagedKVCache.snapshot()`` dicts and
turn dicts): the physical pool as a grid coloured by owner, the block table of each sequence,
and the per-turn reuse bars. No torch, no streamlit.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

FREE, CACHED, SHARED = "#e9ecef", "#adb5bd", "#7048e8"
OWNERS = ("#1c7ed6", "#f08c00", "#2f9e44", "#e03131", "#0c8599", "#d6336c", "#5c940d", "#9c36b5")
NEW_SLOT = "#e03131"
COLUMNS = 16  # blocks per grid row
CELL = 31  # px: 16 cells fit the half-width column of a 1400 px window without overlapping


def _owner_colour(r: int) -> str:
    return OWNERS[r % len(OWNERS)]


def block_category(snap: Mapping[str, Any], b: int, names: Sequence[str] | None = None) -> tuple[str, str]:
    """(legend label, colour) of physical block b; ``names`` names the sequences (default "seq r")."""
    owners = snap["owners"][b]
    if len(owners) > 1 or (owners and snap["ref_count"][b] > 1):
        return "shared", SHARED
    if owners:
        return (names[owners[0]] if names and owners[0] < len(names) else f"seq {owners[0]}"), _owner_colour(owners[0])
    if snap["state"][b] == "cached":
        return "cached (ref 0, evictable)", CACHED
    if snap["state"][b] == "used":
        return "another sequence", "#495057"
    return "free", FREE


def _name(names: Sequence[str] | None, r: int) -> str:
    return names[r] if names and r < len(names) else f"seq {r}"


def written_slots(new_slots: Sequence[Sequence[int]]) -> dict[int, str]:
    """Block -> the slots a step wrote in it, as text ("slot 5", "slots 0-15"); new_slots holds
    (row, block, slot) triples. A decode step writes one slot per row: the cell's ring says which
    block, this says where in it."""
    by: dict[int, set[int]] = {}
    for _, b, o in new_slots:
        by.setdefault(int(b), set()).add(int(o))
    out = {}
    for b, offs in by.items():
        lo, hi = min(offs), max(offs)
        if len(offs) == 1:
            out[b] = f"slot {lo}"
        elif hi - lo + 1 == len(offs):
            out[b] = f"slots {lo}-{hi}"
        else:
            out[b] = "slots " + ", ".join(str(o) for o in sorted(offs))
    return out


def pool_grid(snap: Mapping[str, Any], names: Sequence[str] | None = None, title: str = "Physical pool",
              columns: int = COLUMNS) -> go.Figure:
    """Every block of the pool as a cell: colour = owner (shared, cached, free), text = block id,
    fill and ref count; the blocks this step wrote are ringed in red."""
    n, bs = snap["num_blocks"], snap["block_size"]
    written = {b for _, b, _ in snap["new_slots"]}
    groups: dict[str, tuple[str, list[int]]] = {}
    for b in range(n):
        label, colour = block_category(snap, b, names)
        groups.setdefault(label, (colour, []))[1].append(b)
    fig = go.Figure()
    for label, (colour, blocks) in groups.items():
        text, hover = [], []
        for b in blocks:
            ref, fill = snap["ref_count"][b], snap["fill"][b]
            # Two short lines fit a cell: the block id, then its ref count when shared, else its fill.
            text.append(f"{b}<br>×{ref}" if ref > 1 else (f"{b}<br>{fill}/{bs}" if fill else f"{b}"))
            h = snap["hash"][b]
            hover.append(f"block {b}: {label}<br>ref count {ref}<br>{fill}/{bs} slots filled"
                         + (f"<br>hash {h}…" if h else "<br>no hash (not full, or a duplicate)")
                         + (f"<br>owners: {', '.join(_name(names, r) for r in snap['owners'][b])}"
                            if snap["owners"][b] else ""))
        fig.add_trace(go.Scatter(
            x=[b % columns for b in blocks], y=[b // columns for b in blocks], mode="markers+text", name=label,
            marker=dict(symbol="square", size=CELL, color=colour, line=dict(width=1, color="#868e96")),
            text=text, textfont=dict(size=9, color="#212529" if colour in (FREE, CACHED) else "white"),
            hovertext=hover, hoverinfo="text",
        ))
    slots = written_slots(snap["new_slots"])
    if written:  # drawn last, so no neighbouring cell covers the ring
        ring = sorted(written)
        fig.add_trace(go.Scatter(x=[b % columns for b in ring], y=[b // columns for b in ring], mode="markers",
                                 name="written this step", hoverinfo="text",
                                 hovertext=[f"block {b}: this step wrote {slots[b]}" for b in ring],
                                 marker=dict(symbol="square-open", size=CELL, color=NEW_SLOT, line=dict(width=3))))
    rows = -(-n // columns)
    where = "; ".join(f"block {b} {slots[b]}" for b in sorted(slots)[:3]) + ("; …" if len(slots) > 3 else "")
    fig.update_layout(
        title=dict(text=title, subtitle=dict(text=f"{n} blocks of {bs} tokens · ringed red: written this step"
                                                  + (f" ({where})" if where else ""))),
        xaxis=dict(visible=False, range=[-0.6, columns - 0.4]),
        yaxis=dict(visible=False, autorange="reversed", range=[rows - 0.5, -0.5]),
        height=130 + 36 * rows, margin=dict(l=10, r=10, t=80, b=10), plot_bgcolor="white",
        legend=dict(orientation="h", y=-0.02, yanchor="top", x=0), showlegend=True,
    )
    return fig


def block_tables(snap: Mapping[str, Any], names: Sequence[str] | None = None) -> go.Figure:
    """Each sequence's block table: logical block j -> physical block, coloured as in the pool. A model
    with per-layer kinds (Gemma 3) has one table per layer group and sequence; a sliding group's
    blocks wholly out of its window are let go (-1 in the snapshot), drawn as grey dashes."""
    names = list(names) if names is not None else [f"seq {r}" for r in range(len(snap["tables"]))]
    groups = snap.get("groups") or []
    if len(groups) > 1:
        def kind(g: Mapping[str, Any]) -> str:
            layers = ",".join(str(i) for i in g["layers"])
            return f"global L{layers}" if g["window"] is None else f"sliding L{layers}"
        rows = [(f"{names[r]} · {kind(g)}", t) for g in groups for r, t in enumerate(g["tables"])]
    else:
        rows = list(zip(names, snap["tables"]))
    tables = [t for _, t in rows]
    fig = go.Figure()
    xs, ys, text, colours, hover = [], [], [], [], []
    for name, t in rows:
        for j, b in enumerate(t):
            where = f"{name}: logical block {j} (positions {j * snap['block_size']}–{(j + 1) * snap['block_size'] - 1})"
            xs.append(j)
            ys.append(name)
            if b < 0:  # a sliding group let it go: out of every later query's window
                text.append("–")
                colours.append("#dee2e6")
                hover.append(f"{where}: out of the window, block let go")
                continue
            label, colour = block_category(snap, b, names)
            text.append(str(b))
            colours.append(colour)
            hover.append(f"{where} → physical block {b} ({label})")
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers+text", text=text, hovertext=hover, hoverinfo="text",
                             marker=dict(symbol="square", size=34, color=colours, line=dict(width=1, color="#495057")),
                             textfont=dict(color="white", size=12), showlegend=False))
    width = max((len(t) for t in tables), default=1)
    fig.update_layout(
        title=dict(text="Block tables", subtitle=dict(text="logical block → physical block (purple: shared)")),
        xaxis=dict(title="logical block", range=[-0.6, max(width, 8) - 0.4], dtick=1, showgrid=False),
        yaxis=dict(autorange="reversed", type="category", showgrid=False, automargin=True),
        height=140 + 44 * max(len(tables), 1), margin=dict(l=110, r=10, t=80, b=50), plot_bgcolor="white",
    )
    return fig


# Below the axis, anchored to the figure's bottom edge: a legend at y=-0.12 of the plot, on one
# row (a 1920 px screen), covered the "turn 1" tick label.
LEGEND_BELOW = dict(orientation="h", yref="container", y=0.0, yanchor="bottom", x=0)


def reuse_bars(turns: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Per turn: prompt tokens reused from the cache vs prefilled, and tokens generated. The counts
    are written level (textangle 0) at a legible minimum size: Plotly would turn a label sideways
    to fit a thin segment (issue 36's rotated "8")."""
    x = [f"turn {i + 1}" for i in range(len(turns))]
    fig = go.Figure()
    for key, name, colour in (("reused_tokens", "reused (no compute)", "#2f9e44"),
                              ("prefilled_tokens", "prefilled", "#1c7ed6"),
                              ("generated_tokens", "generated", "#f08c00")):
        fig.add_trace(go.Bar(x=x, y=[t[key] for t in turns], name=name, marker_color=colour,
                             text=[t[key] for t in turns], textposition="inside", textangle=0,
                             insidetextanchor="middle"))
    fig.update_layout(barmode="stack", title="Tokens per turn", yaxis_title="tokens", height=400,
                      uniformtext=dict(minsize=11, mode="show"),
                      margin=dict(l=70, r=10, t=50, b=90), legend=LEGEND_BELOW)
    return fig


def ttft_bars(turns: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Per turn, TTFT with the cache kept beside the same prompt prefilled with nothing reused:
    ``no_reuse_ttft_ms`` (timed right after the turn), else ``recompute_ttft_ms`` (the check's)."""
    x = [f"turn {i + 1}" for i in range(len(turns))]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=[t["ttft_ms"] for t in turns], name="with reuse (the cache kept)",
                         marker_color="#2f9e44", text=[f"{t['ttft_ms']:.0f}" for t in turns],
                         textposition="outside", textangle=0))
    re = [t.get("no_reuse_ttft_ms") if t.get("no_reuse_ttft_ms") is not None else t.get("recompute_ttft_ms")
          for t in turns]
    if any(v is not None for v in re):
        fig.add_trace(go.Bar(x=x, y=re, name="without reuse (all prefilled)", marker_color="#868e96",
                             text=[f"{v:.0f}" if v is not None else "" for v in re],
                             textposition="outside", textangle=0))
    top = max([t["ttft_ms"] for t in turns] + [v for v in re if v is not None], default=1.0)
    fig.update_layout(barmode="group", yaxis_title="ms", height=400, showlegend=True,
                      title=dict(text="Time to first token", subtitle=dict(text="both measured on each turn")),
                      yaxis=dict(range=[0, top * 1.18]),  # room for the labels above the bars
                      margin=dict(l=70, r=10, t=70, b=90), legend=LEGEND_BELOW)
    return fig
