"""Token chips: the prompt and the generated text, one box per token.

Security: every piece of user or model text goes through ``html.escape`` here, and the HTML is
shown with ``st.html`` (sanitised by DOMPurify, scripts off); ``unsafe_allow_html`` is never used.
Whitespace is made visible (a space is '·', a newline '↵' followed by a real line break), and
byte tokens that only make a character together (an emoji is 4 byte tokens) are drawn as one
glyph over their byte boxes, so token boundaries stay visible and the text stays readable.
Typed text shaped like a control token ("<|im_end|>" in a chat message, encoded as text) gets a
dashed red border: it reads like a turn boundary but the model sees its characters.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass
from functools import lru_cache
from html import escape
from typing import Any

import streamlit as st

from kvviz import Run
from kvviz.charts.tokens import generated_text, lookalike_positions, prompt_tokens, visible

CSS = """<style>
.kv-chips{font-family:'DejaVu Sans Mono',Menlo,Consolas,monospace;font-size:1.2rem;line-height:2.35;
  direction:ltr;text-align:left;word-break:break-all}
.kv-chip{display:inline-block;padding:0 .22em;margin:0 .08em;border-radius:.3em;border:1px solid;
  line-height:1.55;unicode-bidi:isolate;white-space:pre;vertical-align:middle}
.kv-p{background:#edf2ff;border-color:#bac8ff;color:#1c2a6b}
.kv-g{background:#fff4e6;border-color:#ffc078;color:#5c3200}
.kv-new{outline:3px solid #e03131;outline-offset:1px}
.kv-ws{color:#868e96}
.kv-look{border-style:dashed;border-color:#e03131}
.kv-multi{display:inline-flex;flex-direction:column;align-items:center;line-height:1.1;padding:.1em .22em}
.kv-glyph{font-size:1.1em}
.kv-bytes{font-size:.55em;color:#868e96;letter-spacing:.02em}
.kv-legend{font-size:.95rem;color:#495057;margin:.1rem 0 .3rem 0;word-break:normal;overflow-wrap:normal}
.kv-legend .kv-chip{font-size:.9rem}
.kv-plain{font-size:1.05rem;white-space:pre-wrap;overflow-wrap:anywhere;color:#343a40;background:#f8f9fa;
  border-left:4px solid #ced4da;padding:.35rem .7rem;margin-top:.4rem}
/* The scrolling box has no vertical padding and a height of whole lines, so when it is scrolled to
   the newest text (column-reverse keeps it there) its top line is never cut in half. */
.kv-plain-scroll{display:flex;flex-direction:column-reverse;line-height:1.5;max-height:7.5em;overflow-y:auto}
.kv-plain-gen{background:#fff4e6}
.kv-top{font-size:.98rem;color:#495057;margin-top:.3rem}
</style>"""


@dataclass(frozen=True)
class Chip:
    text: str  # what the chip shows (already made visible, not yet escaped)
    title: str  # hover text
    generated: bool
    newest: bool = False
    byte_labels: tuple[str, ...] = ()  # for a glyph assembled from byte tokens
    whitespace: bool = False
    lookalike: bool = False  # part of typed text shaped like a control token (charts/tokens.py)


LOOKALIKE_TITLE = " (typed text shaped like a control token: the model reads its characters, not a turn boundary)"


def _partial(raw: bytes) -> bool:
    """Bytes that are not whole UTF-8 characters on their own (part of an emoji, say)."""
    try:
        raw.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def build_chips(tokens: list[tuple[str, bytes]], n_prompt: int) -> list[Chip]:
    """Chips for (display text, bytes) of each token, prompt first. Tokens whose bytes are only
    part of a character are grouped until they make one. Tokens that spell typed text shaped like
    a control token are marked (``lookalike``)."""
    chips: list[Chip] = []
    marked = lookalike_positions([raw for _, raw in tokens])
    pending: list[tuple[int, str, bytes]] = []  # (position, display, bytes) not yet a whole character

    def single(pos: int, disp: str, raw: bytes) -> Chip:
        return Chip(disp, f"position {pos}: byte {disp}", pos >= n_prompt)

    for pos, (disp, raw_tok) in enumerate(tokens):
        if not _partial(raw_tok):
            if pending:  # an unfinished character stays bytes
                chips.extend(single(*x) for x in pending)
                pending.clear()
            look = pos in marked
            chips.append(Chip(visible(disp), f"position {pos}: {disp!r}" + (LOOKALIKE_TITLE if look else ""),
                              pos >= n_prompt, whitespace=disp != "" and disp.strip() == "", lookalike=look))
            continue
        pending.append((pos, disp, raw_tok))
        while pending:
            raw = b"".join(b for _, _, b in pending)
            try:
                glyph = raw.decode("utf-8")
            except UnicodeDecodeError:
                try:  # a valid start of a character: wait for its next byte
                    codecs.getincrementaldecoder("utf-8")().decode(raw, final=False)
                    break
                except UnicodeDecodeError:  # cannot become a character: the first byte stands alone
                    chips.append(single(*pending.pop(0)))
                    continue
            first = pending[0][0]
            labels = tuple(" ".join(f"{x:02X}" for x in b) for _, _, b in pending)
            chips.append(Chip(visible(glyph), f"positions {first}–{pending[-1][0]}: “{glyph}” = {len(pending)} "
                                              "byte tokens", first >= n_prompt, byte_labels=labels))
            pending.clear()
    chips.extend(single(*x) for x in pending)
    if chips:
        last = chips[-1]
        chips[-1] = Chip(last.text, last.title, last.generated, last.generated, last.byte_labels, last.whitespace,
                         last.lookalike)
    return chips


# A live run redraws all its chips ten times a second, each the same string as the last time: the
# escaping and formatting were most of a text redraw (3.7 ms at 260 tokens, 1.x ms cached).
@lru_cache(maxsize=1 << 14)
def chip_html(c: Chip, break_after: bool = False) -> str:
    cls = ("kv-chip " + ("kv-g" if c.generated else "kv-p") + (" kv-new" if c.newest else "")
           + (" kv-look" if c.lookalike else ""))
    title = escape(c.title, quote=True)
    if c.byte_labels:
        inner = (f'<span class="kv-glyph">{escape(c.text)}</span>'
                 f'<span class="kv-bytes">{escape(" ".join(c.byte_labels))}</span>')
        out = f'<span class="{cls} kv-multi" title="{title}">{inner}</span>'
    else:
        text = f'<span class="kv-ws">{escape(c.text)}</span>' if c.whitespace else escape(c.text)
        out = f'<span class="{cls}" title="{title}">{text}</span>'
    return out + ("<br>" if break_after else "")


def chips_body(chips: list[Chip]) -> str:
    """The chips' HTML. A newline chip ends its line, except inside a run of newlines ("↵↵↵" stays together)."""
    return "".join(chip_html(c, c.text.endswith("↵") and (i + 1 == len(chips) or chips[i + 1].text != "↵"))
                   for i, c in enumerate(chips))


def run_html(run: Run) -> str:
    """The chips, a legend, the plain text and the next-token candidates of a run's last step."""
    p_tokens = prompt_tokens(run)
    p_bytes = run.prompt_bytes if len(run.prompt_bytes) == len(p_tokens) else (b"",) * len(p_tokens)
    gen = [(e.token_text, e.token_bytes) for e in run.events]
    chips = build_chips(list(zip(p_tokens, p_bytes)) + gen, len(p_tokens))
    look = (' &nbsp; <span class="kv-chip kv-p kv-look">&lt;|</span>&nbsp;=&nbsp;typed, not a control token'
            if any(c.lookalike for c in chips) else "")
    legend = (f'<div class="kv-legend"><span class="kv-chip kv-p">prompt</span> {len(p_tokens):,} tokens · '
              f'<span class="kv-chip kv-g">generated</span> {len(gen):,} of {run.max_new_tokens:,} · '
              f'<span class="kv-chip kv-g kv-new">newest</span> &nbsp; '
              f'<span class="kv-ws">·</span>&nbsp;=&nbsp;space &nbsp; '
              f'<span class="kv-ws">↵</span>&nbsp;=&nbsp;newline{look}</div>')
    body = chips_body(chips)
    # The inner div sits in a column-reverse box, so the box stays scrolled to the newest text.
    plain = (f'<div class="kv-plain"><div class="kv-plain-scroll"><div dir="auto">{escape(run.prompt_text)}'
             f'<span class="kv-plain-gen">{escape(generated_text(run))}</span></div></div></div>')
    top = ""
    if run.events and run.events[-1].top:
        cands = " · ".join(f"“{escape(visible(t.text))}” {t.prob:.0%}" for t in run.events[-1].top)
        top = f'<div class="kv-top">Next-token candidates at step {run.events[-1].step}: {cands}</div>'
    # The chips sit in a column-reverse box too: where a layout caps its height (presenting), it stays
    # scrolled to the newest token.
    return f'<div class="kv-chips">{legend}<div class="kv-body"><div>{body}</div></div></div>{plain}{top}'


def inject_css() -> None:
    """Style-only HTML goes to Streamlit's event container: it takes no space on the page."""
    st.html(CSS)


def render(run: Run | None, slot: Any) -> None:
    """Draw a run's chips into ``slot``, the ``output`` placeholder (an ``st.empty``), as one HTML
    element replaced in place: the browser keeps the element and re-renders only its HTML."""
    if run is None:
        slot.html('<div class="kv-legend">The prompt and the generated tokens appear here, one chip per token.</div>')
        return
    slot.html(run_html(run))
