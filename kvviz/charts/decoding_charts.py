"""Decoding strategies that move the cache, drawn from their records (pure Plotly, no torch).

Beam search: the tree of candidates (kept, finished, pruned, with their scores), the cache rows
before and after one step's reorder, and the bytes every reorder moved. Speculative decoding: the
notebook of positions each verify forward wrote (accepted, the model's own token, rolled back),
and drafted vs accepted per forward.
"""
from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go

from kvviz.charts.run_charts import FONT, _layout, _message_figure
from kvviz.charts.tokens import short_label
from kvviz.engine.generation.strategy_events import BeamStep, SpecStep
from kvviz.units import fmt_bytes

KEPT = "#1c7ed6"
FINISHED = "#2b8a3e"
PRUNED = "#adb5bd"
ROLLED = "#e03131"
OWN = "#f08c00"
FED = "#4263eb"
STATUS_COLOR = {"kept": KEPT, "finished": FINISHED, "pruned": PRUNED}
STATUS_LABEL = {"kept": "kept (a running beam)", "finished": "finished (EOS or length)", "pruned": "pruned"}
HEIGHTS = {"tree": 520, "reorder": 420, "bytes": 340, "notebook": 440, "accept": 340}


def _node_ys(steps: Sequence[BeamStep]) -> list[dict[int, int]]:
    """For each step, cache row -> y of the kept candidate that occupies it (its rank at that step)."""
    out = []
    for s in steps:
        out.append({c.row: j for j, c in enumerate(s.candidates) if c.status == "kept" and c.row is not None})
    return out


def beam_tree(steps: Sequence[BeamStep], title: str = "The beam tree", vocab: int | None = None) -> go.Figure:
    """x: generated token index; y: rank among the step's candidates (best on top); a line joins each
    candidate to the running beam it extends. ``vocab`` (V) puts the k x V figure in the subtitle."""
    if not steps:
        return _message_figure(title, "Run beam search to grow the tree here.", HEIGHTS["tree"])
    rows = _node_ys(steps)
    edges: dict[str, tuple[list, list]] = {k: ([], []) for k in STATUS_COLOR}
    nodes: dict[str, dict[str, list]] = {k: {"x": [], "y": [], "text": [], "hover": []} for k in STATUS_COLOR}
    for si, s in enumerate(steps):
        for j, c in enumerate(s.candidates):
            px, py = (0, 0) if si == 0 else (si, rows[si - 1].get(c.parent, 0))
            ex, ey = edges[c.status]
            ex += [px, si + 1, None]
            ey += [py, j, None]
            n = nodes[c.status]
            n["x"].append(si + 1)
            n["y"].append(j)
            label = short_label(c.token_text)
            n["text"].append(label if c.status != "pruned" else "")
            extra = f"<br>final score {c.final_score:.3f}" if c.final_score is not None else ""
            row = f"<br>cache row {c.row}" if c.row is not None else ""
            n["hover"].append(f"step {s.step} · token {label}<br>log p sum {c.score:.3f}{extra}"
                              f"<br>extends row {c.parent}{row}")
    fig = go.Figure()
    for status, (ex, ey) in edges.items():
        fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", hoverinfo="skip", showlegend=False,
                                 line=dict(color=STATUS_COLOR[status], width=2.2 if status != "pruned" else 1)))
    fig.add_trace(go.Scatter(x=[0], y=[0], mode="markers+text", text=["prompt"], textposition="middle left",
                             marker=dict(size=14, color="#495057", symbol="square"), showlegend=False,
                             hoverinfo="skip"))
    for status, n in nodes.items():
        fig.add_trace(go.Scatter(
            x=n["x"], y=n["y"], mode="markers+text", text=n["text"], textposition="top center",
            textfont=dict(size=13, color=STATUS_COLOR[status] if status != "pruned" else "#868e96"),
            marker=dict(size=11 if status != "pruned" else 7, color=STATUS_COLOR[status],
                        symbol="star" if status == "finished" else "circle", line=dict(width=0)),
            hovertext=n["hover"], hoverinfo="text", name=STATUS_LABEL[status]))
    keep = max(len(s.candidates) for s in steps)
    fig.update_yaxes(autorange="reversed", title="rank among the candidates", range=[keep - 0.5, -0.8],
                     dtick=1, zeroline=False)
    fig.update_xaxes(title="generated token", dtick=1 if len(steps) <= 24 else None, range=[-0.9, len(steps) + 0.6])
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.24, x=0.0))
    # Step 0 fans the prompt's row out to k rows, so its reorder index has k entries. Each step ranks
    # all k x V continuations and keeps max(2, 1 + #EOS) x k of them (kvviz.engine.strategy.beam).
    k = max(1, len(steps[0].parents))
    pool = f"k × V = {k} × {vocab:,} = {k * vocab:,}" if vocab else f"k × vocabulary ({k} × V)"
    sub = (f"{len(steps)} steps · each keeps the best {keep} ({keep // k}k, k = {k}) of all {pool} continuations · "
           "blue lines: the beams kept alive")
    fig = _layout(fig, title, sub, HEIGHTS["tree"])
    fig.update_layout(margin_b=120)
    return fig


def reorder_figure(step: BeamStep, num_beams: int) -> go.Figure:
    """Old cache rows (left) copied into new rows (right): row r takes old row parents[r]."""
    title = f"Cache rows at step {step.step}: before and after the reorder"
    fig = go.Figure()
    before = step.rows_before
    for r, p in enumerate(step.parents):
        moved = p != r
        fig.add_trace(go.Scatter(x=[0.04, 0.96], y=[p, r], mode="lines", showlegend=False, hoverinfo="skip",
                                 line=dict(color=ROLLED if moved else KEPT, width=3)))
    kept_by_row = {c.row: c for c in step.candidates if c.status == "kept"}
    lx = [0.0] * before + [1.0] * num_beams
    ly = list(range(before)) + list(range(num_beams))
    texts = [f"old row {i}" for i in range(before)]
    for r in range(num_beams):
        c = kept_by_row.get(r)
        texts.append(f"row {r} ← {step.parents[r]}" + (f" · {short_label(c.token_text)}" if c else ""))
    fig.add_trace(go.Scatter(x=lx, y=ly, mode="markers+text", text=texts,
                             textposition=["middle left"] * before + ["middle right"] * num_beams,
                             marker=dict(size=26, symbol="square", color=["#dee2e6"] * before + [KEPT] * num_beams),
                             hoverinfo="skip", showlegend=False, textfont=dict(size=14)))
    fig.update_xaxes(visible=False, range=[-0.8, 2.4])
    fig.update_yaxes(visible=False, autorange="reversed", range=[max(before, num_beams) - 0.4, -0.6])
    moved_rows = sum(1 for r, p in enumerate(step.parents) if p != r)
    sub = (f"{fmt_bytes(step.bytes_moved)} copied: {step.cache_len} positions x {num_beams} rows, every layer's K and V"
           + (f"<br>{moved_rows} of {num_beams} rows changed parent (red)" if before == num_beams else
              f"<br>the prompt's one row fanned out to {num_beams}") if step.bytes_moved else
           "no reorder: the last step feeds nothing,<br>or there is no cache")
    fig = _layout(fig, title, sub, HEIGHTS["reorder"])
    fig.update_layout(margin_t=118)
    return fig


def bytes_moved_chart(steps: Sequence[BeamStep]) -> go.Figure:
    title = "Bytes each reorder copied"
    if not steps:
        return _message_figure(title, "No beam search yet.", HEIGHTS["bytes"])
    fig = go.Figure(go.Bar(x=[s.step for s in steps], y=[s.bytes_moved for s in steps], marker_color=KEPT,
                           hovertext=[fmt_bytes(s.bytes_moved) for s in steps], hoverinfo="text"))
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="bytes")
    total = sum(s.bytes_moved for s in steps)
    fig = _layout(fig, title, f"{fmt_bytes(total)} in all<br>every filled position of every row, so it grows "
                              "with the context", HEIGHTS["bytes"] + 80)
    fig.update_layout(margin_t=118)
    return fig


def spec_notebook(steps: Sequence[SpecStep], n_prompt: int,
                  title: str = "What each verify forward wrote into the cache") -> go.Figure:
    """One row per forward: the positions it wrote. Fed token (blue), accepted drafts (green),
    rolled-back drafts (red x); the model's own next token (orange) is written by the next forward."""
    decode = [s for s in steps if s.step > 0]
    if not decode:
        return _message_figure(title, "Run speculative decoding to fill the notebook.", HEIGHTS["notebook"])
    groups = {"fed": ([], [], [], FED, "square", "the last token, fed"),
              "accepted": ([], [], [], FINISHED, "square", "draft accepted (kept in the cache)"),
              "rolled": ([], [], [], ROLLED, "x", "draft rolled back (truncated)"),
              "own": ([], [], [], OWN, "circle-open", "the model's own next token (fed next)")}

    for s in decode:
        y = s.step
        a = s.accepted
        for i in range(len(s.drafted) + 1):
            pos = s.position + i
            key = "fed" if i == 0 else ("accepted" if i <= a else "rolled")
            xs, ys, hv = groups[key][0], groups[key][1], groups[key][2]
            tok = short_label(s.drafted_text[i - 1]) if i and i - 1 < len(s.drafted_text) else ""
            xs.append(pos)
            ys.append(y)
            hv.append(f"forward {y} · position {pos} · {groups[key][5]}{' · ' + tok if tok else ''}")
        own = s.position + 1 + a
        groups["own"][0].append(own)
        groups["own"][1].append(y)
        groups["own"][2].append(f"forward {y} · position {own} · the model's own token, written next forward")
    fig = go.Figure()
    for key, (xs, ys, hv, color, symbol, name) in groups.items():
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=name, hovertext=hv, hoverinfo="text",
                                 marker=dict(color=color, symbol=symbol, size=13,
                                             line=dict(width=2, color=color))))
    fig.update_yaxes(autorange="reversed", title="verify forward", dtick=1 if len(decode) <= 30 else None)
    fig.update_xaxes(title="cache position")
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.3, x=0.0))
    rolled = sum(len(s.rolled_back) for s in decode)
    sub = (f"{len(decode)} verify forwards after the prefill ({n_prompt} prompt positions)<br>"
           f"{rolled} positions written, then rolled back (red x)")
    fig = _layout(fig, title, sub, HEIGHTS["notebook"] + 60)
    fig.update_layout(margin_t=118, margin_b=150)
    return fig


def acceptance_chart(steps: Sequence[SpecStep]) -> go.Figure:
    title = "Drafted vs accepted, per verify forward"
    decode = [s for s in steps if s.step > 0]
    if not decode:
        return _message_figure(title, "No speculative run yet.", HEIGHTS["accept"])
    x = [s.step for s in decode]
    fig = go.Figure([
        go.Bar(x=x, y=[len(s.drafted) for s in decode], name="drafted", marker_color=PRUNED),
        go.Bar(x=x, y=[s.accepted for s in decode], name="accepted", marker_color=FINISHED),
    ])
    fig.update_layout(barmode="overlay", legend=dict(orientation="h", yanchor="top", y=-0.3, x=0.0), font=FONT)
    fig.update_xaxes(title="verify forward")
    fig.update_yaxes(title="tokens", dtick=1 if max(len(s.drafted) for s in decode) <= 12 else None)
    drafted, accepted = sum(len(s.drafted) for s in decode), sum(s.accepted for s in decode)
    rate = f"{accepted / drafted:.0%}" if drafted else "n/a"
    fig = _layout(fig, title, f"{accepted} of {drafted} drafted tokens accepted ({rate})<br>no bar: no n-gram "
                              "matched, a plain one-token step", HEIGHTS["accept"] + 120)
    fig.update_layout(margin_t=118, margin_b=120)
    return fig
