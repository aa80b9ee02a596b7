"""Layout choices priced in the browser: what keeps a chart cheap for Chromium to draw.

Pure Python over label texts, axis dicts and column counts (charts/run_charts.py applies them;
docs/benchmarks.md has the measurements).

Margins preset for the labels, so Plotly lays a chart out once. With automargin on, a margin smaller than what the
labels need is grown after drawing, and growing it makes Plotly lay the chart out and draw it a
second time: that doubled what Chromium spent on each live chart (docs/benchmarks.md). So each
live chart (charts/run_charts.py) starts from the margins its labels need, as automargin measured them
in Chromium on the project's machine at the charts' 15 px font, plus a few px. automargin stays on
as a safety net: a wider label (another font, a longer token) costs the second pass, never a clip.
``style.legible`` grows these presets for a projector's larger font. ``AXIS`` goes on every axis.

Heatmap columns gapped only while they are few: a white gap between columns draws each cell as its
own brick, which doubled what Chromium spends on a heatmap of SmolLM2's 240 positions (213 -> 107
ms for the notebook, 226 -> 112 for the attention map, on the project's 2-core machine).
"""
from __future__ import annotations

COLUMN_GAP_MAX = 128  # gapped columns at most: about 8 px each at full width, where a gap still reads as a grid
# Every axis: automargin as the safety net above, and no overflow check per tick label. Plotly's
# default ("hide past div") measures every label's box after drawing it, a forced layout each;
# the presets keep the labels inside the figure, and skipping it cut a third of what Chromium
# spent on the live charts.
AXIS = dict(automargin=True, ticklabeloverflow="allow")

MARGIN = dict(l=90, r=30, b=40)  # what a chart starts from where it presets nothing
COLORBAR_R = 116  # right: a colorbar with its title above it ("‖K‖ (L2)"); 114 px measured (Chromium)
COLORBAR_TITLE_R = 116  # right: a colorbar with its title beside it ("weight"); 112 px measured
LATENCY_R_BASE, LATENCY_R_PER_CHAR = 36, 7  # right: a tokens/s axis, its title and labels ("63": 48 px, "1,320": 69)
AXIS_MARGIN_FLAT = 52  # bottom: level labels and the axis title (49 px measured)
SLANTED_BASE, SLANTED_PER_CHAR = 48, 5.5  # bottom: labels slanted at -50°, 88 px measured for 8 characters, 77 for 6


def visible_len(text: str) -> int:
    """Characters a Plotly label shows: a tag (``<b>``, ``<br>``) takes no room, an entity
    (``&lt;``, as ``tokens.plotly_text`` writes a "<") takes one."""
    n, i = 0, 0
    while i < len(text):
        ch = text[i]
        if ch == "<" and (end := text.find(">", i)) != -1:
            i = end + 1
            continue
        if ch == "&" and (end := text.find(";", i)) != -1 and end - i <= 6:
            i = end + 1
        else:
            i += 1
        n += 1
    return n


def axis_margin(axis: dict) -> int:
    """The bottom margin a ``tokens.token_axis`` needs: more for slanted labels, by the longest one."""
    if not axis.get("tickangle"):
        return AXIS_MARGIN_FLAT
    longest = max((visible_len(t) for t in axis.get("ticktext") or ()), default=0)
    return max(AXIS_MARGIN_FLAT, round(SLANTED_BASE + SLANTED_PER_CHAR * longest))


def label_margin(labels: list[str], least: int = MARGIN["l"]) -> int:
    """Left margin for horizontal y tick labels and a y axis title: "kv 0 ← q 0-2" needed 116 px
    (about 8 px a character and 20 for the title)."""
    return max(least, 20 + 8 * max((visible_len(t) for t in labels), default=0))


def rate_axis_margin(highest: float | None) -> int:
    """Right margin for a tokens/s axis whose highest tick label is ``highest`` (None: no rate yet).
    The highest tick, not the fastest point: 96 tok/s draws a tick at 100, and a margin sized for "96"
    was grown by Plotly (a second layout)."""
    widest = len(f"{highest:,.0f}") if highest is not None else 1
    return LATENCY_R_BASE + LATENCY_R_PER_CHAR * widest


def column_gap(n_columns: int) -> int:
    """The white gap (px) between a heatmap's columns: 1 while there are few, else none."""
    return 1 if n_columns <= COLUMN_GAP_MAX else 0
