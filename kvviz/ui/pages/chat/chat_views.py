"""The Chat page's views: token chips with the reuse boundary, per-turn numbers, and the paged
pool (grid, block tables) with a replay slider over a turn's steps. Text is escaped (st.html).
Typed text shaped like a control token ("<|im_end|>" in a message, encoded as text) is marked in
the chips and named under the message."""
from __future__ import annotations

from html import escape
from typing import Any, Sequence

import streamlit as st

from kvviz.charts import paged_charts as pc
from kvviz.charts.tokens import lookalike_positions, visible
from kvviz.engine.tokenize.chat_template import typed_specials
from kvviz.engine.sessions.conversation import InterruptedTurn, TurnRecord
from kvviz.ui.common.figs import show
from kvviz.units import fmt_bytes

CSS = """<style>
.kv-cc{font-family:'DejaVu Sans Mono',Menlo,Consolas,monospace;font-size:1.0rem;line-height:2.1;word-break:break-all}
.kv-cc span{display:inline-block;padding:0 .18em;margin:0 .05em;border-radius:.25em;border:1px solid;white-space:pre;
  line-height:1.45}
.kv-cc .r{background:#ebfbee;border-color:#8ce99a;color:#1b4d24}
.kv-cc .p{background:#e7f5ff;border-color:#74c0fc;color:#0b3d66}
.kv-cc .g{background:#fff4e6;border-color:#ffc078;color:#5c3200}
.kv-cc .look{border-style:dashed;border-color:#e03131}
.kv-cc .cut{border:none;background:#e03131;padding:0;width:4px;margin:0 .25em;height:1.6em;vertical-align:middle}
.kv-cc-legend{font-size:.95rem;color:#495057}
</style>"""
MAX_CHIPS = 600  # a long conversation shows its last chips; the counts stay exact


def chips(tok: Any, turn: TurnRecord) -> None:
    """The turn's prompt (reused | prefilled, a red bar at the boundary) and its answer tokens."""
    ids = list(turn.prompt_ids)
    gen = list(turn.generated_ids)
    parts: list[str] = []
    start = max(0, len(ids) + len(gen) - MAX_CHIPS)
    token_bytes = getattr(tok, "token_bytes", None)
    marked = lookalike_positions([token_bytes(t) for t in ids + gen]) if token_bytes is not None else set()
    for pos, t in enumerate(ids + gen):
        if pos < start:
            continue
        if pos == turn.reused_tokens and pos < len(ids):
            parts.append('<span class="cut" title="the cache ends here: everything after is computed"></span>')
        cls = "r" if pos < turn.reused_tokens else ("p" if pos < len(ids) else "g")
        text = visible(tok.token_display(t))
        title = f"position {pos}: token {t}"
        if pos in marked:
            cls += " look"
            title += " (typed text shaped like a control token: the model reads its characters)"
        parts.append(f'<span class="{cls}" title="{escape(title)}">{escape(text)}</span>')
    legend = (f'<div class="kv-cc kv-cc-legend"><span class="r">reused</span> {turn.reused_tokens} from the cache · '
              f'<span class="p">prefilled</span> {turn.prefilled_tokens} · <span class="g">generated</span> '
              f'{turn.generated_tokens}' + (f" · first {start} tokens not drawn" if start else "")
              + (' · <span class="p look">&lt;|</span> typed, not a control token' if marked else "") + "</div>")
    st.html(CSS + legend + f'<div class="kv-cc">{"".join(parts)}</div>')


def typed_note(text: str, controls: dict[str, int], parsed: bool) -> str:
    """One plain-text line naming the control-token text typed in a message ('' when there is none)."""
    found = typed_specials(text, controls)
    if not found:
        return ""
    names = ", ".join(dict.fromkeys(found))  # each once, in order
    if parsed:
        return f"Typed control tokens ({names}) were read as control tokens: this message can end its turn."
    return (f"Typed as text, not as control tokens: {names} ({len(found)} in all). The model reads their "
            "characters, so they cannot end this turn or start another.")


def turn_line(t: TurnRecord, recompute_ms: float | None = None, scratch: bool | None = None) -> str:
    """The turn's numbers in one line (plain text, no user text in it)."""
    s = (f"{t.prompt_tokens} prompt tokens: {t.reused_tokens} reused, {t.prefilled_tokens} prefilled · "
         f"{t.generated_tokens} generated · TTFT {t.ttft_ms:.0f} ms")
    if t.no_reuse_ttft_ms is not None:
        s += f" (without reuse: {t.no_reuse_ttft_ms:.0f} ms, measured after it)"
    if recompute_ms is not None:
        s += f" (recomputing all: {recompute_ms:.0f} ms)"
    s += f" · cache {fmt_bytes(t.cache_bytes_before)} → {fmt_bytes(t.cache_bytes_used)}"
    if t.blocks_used is not None:
        s += f" · {t.blocks_used} blocks, {t.blocks_shared} shared"
        if t.prefix_hit_blocks:
            s += f", {t.prefix_hit_blocks} found by prefix hash"
    if scratch is not None:
        s += " · equals a from-scratch generation ✓" if scratch else " · DIFFERS from a from-scratch generation ✗"
    return s


def no_reuse_note(turns: Sequence[TurnRecord], label: str, device: str) -> str:
    """What the TTFT chart compares, and how it was measured (plain text; the label names a model).
    The model and cache named are those of the turn described (``made_on``), else ``label``."""
    timed = [t for t in turns if t.no_reuse_ttft_ms is not None]
    if not timed:
        return "The TTFT without reuse is measured after each turn (turns computed on an earlier cache are not timed)."
    t = timed[-1]
    saved = t.no_reuse_ttft_ms - t.ttft_ms  # type: ignore[operator]
    how = (f"Both measured on the same turn, on {device}: its TTFT with the cache kept ({t.reused_tokens} tokens "
           f"reused, {t.prefilled_tokens} prefilled), then the same {t.prompt_tokens} prompt tokens prefilled from "
           f"scratch on a fresh cache, right after it ({t.made_on or label}). Last turn: {t.ttft_ms:.0f} ms with reuse vs "
           f"{t.no_reuse_ttft_ms:.0f} ms without")
    if t.reused_tokens == 0:  # the same work twice: the gap is the timing's own noise, not a saving
        return (how + f". This turn reused nothing, so both timed the same work: their gap ({abs(saved):.0f} ms) "
                "is how much one timing varies on this machine now.")
    return (how + f" ({'saved' if saved >= 0 else 'lost'} {abs(saved):.0f} ms). Each is one timing on a shared "
            "CPU: compare them with the gap on a turn that reused nothing.")


def interrupted_line(c: InterruptedTurn) -> str:
    """The label of an interrupted turn (plain text; the reason may quote an error)."""
    if c.reason.startswith("not sent: "):
        return (f"Not answered, refused before its turn began: {c.reason.removeprefix('not sent: ')} The message "
                "is kept here as typed; it is not part of the conversation.")
    why = {"replaced by a newer turn": "a newer turn replaced it",
           "stopped": "stopped before it ended",
           "interrupted by a rerun": "a click or a new message interrupted it",
           "the model was switched": "the model was switched in the sidebar",
           "the cache settings changed": "the cache settings changed"}.get(c.reason, c.reason)
    n = c.generated_tokens
    return (f"Interrupted after {n} generated token{'' if n == 1 else 's'} ({why}). Not part of the conversation: "
            "the cache, its blocks and the messages are as they were before this message.")


def pool_stats_line(stats: dict[str, int]) -> str:
    return (f"pool {fmt_bytes(stats['bytes_allocated'])} allocated · held {stats['blocks_used']} blocks = "
            f"{fmt_bytes(stats['bytes_held'])} (filled {fmt_bytes(stats['bytes_filled'])}, internal fragmentation "
            f"{fmt_bytes(stats['fragmentation_bytes'])}) · shared {stats['blocks_shared']} blocks, saving "
            f"{fmt_bytes(stats['bytes_saved_by_sharing'])} · free {stats['blocks_free']}, cached (evictable) "
            f"{stats['blocks_cached']} · copy-on-write copies {stats['cow_copies']}, evictions {stats['evictions']}, "
            f"prefix-hash hits {stats['prefix_hits']}")


def pool_views(snaps: Sequence[dict[str, Any]], key: str, names: Sequence[str] | None = None,
               caption: str = "") -> None:
    """The pool grid and block tables at one step of ``snaps``, with a replay slider."""
    if not snaps:
        return
    i = len(snaps) - 1
    if len(snaps) > 1:
        i = st.slider("Step (replay)", 0, len(snaps) - 1, len(snaps) - 1, key=f"{key}_step",
                      help="0 is the prefill; every later step wrote one new slot per sequence")
    snap = snaps[i]
    if caption:
        st.caption(caption)
    left, right = st.columns([3, 2])
    show(left, pc.pool_grid(snap, names), key=f"{key}_grid_{i}")
    show(right, pc.block_tables(snap, names), key=f"{key}_tables_{i}")
    st.caption(pool_stats_line(snap["stats"]))
