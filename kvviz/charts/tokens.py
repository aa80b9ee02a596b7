"""Token labels for the charts and the chips: whitespace made visible, positions named by their
tokens, axes thinned to stay legible. Pure Python over a Run; no streamlit, no torch.
"""
from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from functools import lru_cache
from itertools import accumulate
from typing import Sequence

from kvviz.engine.generation.events import Run

MAX_TICKS = 72  # token labels per axis before thinning (about 14 px each at 1,000 px)
MAX_LABEL = 8  # characters of a token label on an axis (hover shows all)

_VISIBLE = {" ": "·", "\n": "↵", "\t": "⇥"}  # glyphs every common font has


# Text shaped like a control token: "<|im_end|>", "<|endoftext|>" (ChatML, GPT-2, Llama 3 style).
LOOKALIKE = re.compile(rb"<\|[^\s<>|]{1,40}\|>")


def lookalike_positions(raws: Sequence[bytes]) -> set[int]:
    """Positions of tokens that spell, together with their neighbours, text shaped like a control
    token: typed "<|im_end|>" encoded as text is 5 tokens ("<|", "im", ...), each marked here. A real
    control token is one token holding the whole text, so it is never marked."""
    ends = list(accumulate(len(raw) for raw in raws))  # token i covers bytes [ends[i-1], ends[i])
    out: set[int] = set()
    for m in LOOKALIKE.finditer(b"".join(raws)):
        first, last = bisect_right(ends, m.start()), bisect_left(ends, m.end())
        if last > first:  # more than one token: text, not the control token itself
            out.update(range(first, last + 1))
    return out


# --- token labels ----------------------------------------------------------------------------

@lru_cache(maxsize=1 << 16)  # a vocabulary's strings: the chips redraw every token ten times a second
def visible(text: str) -> str:
    """Token text with whitespace and control characters made visible (a space is '·')."""
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"<0x{ord(ch):02X}>")  # control characters: hex, as the tokenizer shows raw bytes
        else:
            out.append(ch)
    return "".join(out) or "∅"


def prompt_tokens(run: Run) -> list[str]:
    """Display text of each prompt token, as the run recorded it (ids where it recorded none)."""
    if len(run.prompt_tokens) == len(run.prompt_ids):
        return list(run.prompt_tokens)
    return [f"<|{i}|>" for i in run.prompt_ids]


def position_labels(run: Run) -> list[str]:
    """Token display text at every position that exists: prompt, then each generated token."""
    return prompt_tokens(run) + [e.token_text for e in run.events]


def generated_text(run: Run) -> str:
    """The generated text so far, decoded from the events (works for a replayed prefix too)."""
    # A token with no bytes (an id past a byte tokenizer's 256, or no tokenizer) shows as its label.
    return b"".join(e.token_bytes or e.token_text.encode() for e in run.events).decode("utf-8", errors="replace")


def planned_columns(run: Run) -> int:
    """K/V columns a full run writes: prompt + max_new_tokens - 1 (the last token is never fed)."""
    return max(1, len(run.prompt_ids) + max(run.max_new_tokens, len(run.events)) - 1)


def plotly_text(text: str) -> str:
    """Text for Plotly's labels, which read a subset of HTML: a BPE token "<a href=...>" or a byte
    token's "<0x0A>" must show as those characters, not become a link or vanish as a tag."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def short_label(label: str) -> str:
    """A token's axis label: visible, at most MAX_LABEL characters, escaped for Plotly."""
    label = visible(label)
    return plotly_text(label if len(label) <= MAX_LABEL else label[: MAX_LABEL - 1] + "…")


def _is_word_start(labels: list[str], i: int) -> bool:
    """A token that begins a word: not blank, and first or after whitespace (or with its own
    leading space, as BPE word pieces carry it)."""
    lab = labels[i]
    if not lab.strip():
        return False
    return i == 0 or lab[:1].isspace() or labels[i - 1][-1:].isspace()


def word_ticks(labels: list[str], n: int, gap: int) -> tuple[list[int], list[str]]:
    """Tick positions and texts for a long axis: each labelled position starts a word, and its label
    is the whole word (so a byte-level model reads "ROMEO" "But" "soft", not "R" "M" "O"). At least
    ``gap`` positions apart; a stretch with no word start longer than 3 gaps gets its tokens'
    own labels, so gibberish is labelled too."""
    ticks: list[int] = []
    texts: list[str] = []
    last = -gap
    m = min(n, len(labels))
    for i in range(m):
        if i - last < gap:
            continue
        if _is_word_start(labels, i):
            word, j = labels[i].lstrip(), i + 1
            while j < m and len(word) <= MAX_LABEL and labels[j].strip() and not labels[j][:1].isspace():
                word += labels[j]
                j += 1
            word = word.split("\n")[0].rstrip()
        elif i - last >= 3 * gap:
            word = labels[i]
        else:
            continue
        ticks.append(i)
        texts.append(short_label(word))
        last = i
    return ticks, texts


def token_axis(labels: list[str], n: int, title: str = "position (token)") -> dict:
    """Axis settings for positions 0..n-1 labelled with token text, thinned to stay legible.

    Up to MAX_TICKS positions every token is labelled; past that, words are, where they start
    (``word_ticks``), and the title says so, so nobody reads "R M O" as the prompt.
    """
    gap = max(1, -(-n // MAX_TICKS))
    if gap == 1:
        vals = list(range(n))
        text = [short_label(labels[i]) if i < len(labels) else "" for i in vals]
    else:
        vals, text = word_ticks(labels, n, gap)
        title += ": words labelled where they start, hover for every token"
    longest = max((len(t) for t in text), default=1)
    return dict(tickmode="array", tickvals=vals, ticktext=text, tickangle=0 if longest <= 2 else -50,
                tickfont=dict(size=14 if longest <= 2 else 12, family="DejaVu Sans Mono, monospace"),
                range=[-0.5, n - 0.5], showgrid=False, zeroline=False, title=dict(text=title, standoff=6))


def _ordinal(k: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(k, f"{k}th")
