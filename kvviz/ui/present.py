"""The presentation layout: one switch (and ``?present=1`` in the URL) for projecting the app.

On: the sidebar starts collapsed, every font is larger, the Generate page puts the token chips
(three lines, scrolled to the newest; the plain-text copy is left out) beside the numbers and the
cache notebook beside the attention map, so chips, notebook and attention fit above the fold at
1920x1080 (on a 1366x768 laptop a smaller base font and chips box bring the charts' tops onto the
screen), and the charts' text grows (``charts.style``).
Step has a key (S) on every layout; presenting mostly needs it.

The switch's value lives in session state under ``STATE_KEY`` (not only in its widget, which is
forgotten on the calculator page, where the sidebar is not drawn) and is mirrored in the URL, so
a link to ``/?present=1`` opens the app ready for the projector.
"""
from __future__ import annotations

import streamlit as st
from kvviz.ui.state import session

KEY = "present_layout"  # the switch in the sidebar
STATE_KEY = session.PRESENT_ON  # the value, kept across pages
PARAM = "present"  # ?present=1
ON_VALUES = ("1", "true", "on", "yes")

CSS = """<style>
html{font-size:19px}
body [data-testid="stMainBlockContainer"]{padding-top:2.3rem;padding-left:2.2rem;padding-right:2.2rem;max-width:100%}
/* The header keeps its buttons (the sidebar's) but lets clicks through elsewhere. */
body [data-testid="stHeader"],body [data-testid="stHeader"] *{background:transparent;pointer-events:none}
body [data-testid="stHeader"] button,body [data-testid="stHeader"] a{pointer-events:auto}
body [data-testid="stMainBlockContainer"] [data-testid="stVerticalBlock"]{gap:.55rem}
body .st-key-page_title h2{font-size:1.45rem;padding:0;white-space:nowrap}
/* The page's own styles come later in the document: "body" outranks them. */
body .kv-chips{font-size:1.3rem;line-height:2}
body .kv-body{display:flex;flex-direction:column-reverse;max-height:6em;overflow-y:auto}
body .kv-body .kv-chip{vertical-align:top;margin-top:.2em}
body .kv-plain{display:none}
body [data-testid="stMetricValue"]{font-size:1.6rem}
body [data-testid="stCaptionContainer"]{font-size:.9rem}
body .st-key-tour_card [data-testid="stVerticalBlock"]{gap:.3rem}
body .st-key-tour_card p{font-size:.9rem;margin-bottom:.1rem;line-height:1.45}
/* The cache formula under the numbers: smaller, so the numbers' column is no taller than the chips'. */
body .st-key-view_metrics [data-testid="stMarkdown"] p{font-size:.8rem;line-height:1.4}
/* On a wide screen each chart's selector button sits in its chart's top-right corner, not on a row of
   its own; narrower (1366 px), the charts' titles reach that corner, so the button keeps its row. */
@media (min-width:1700px){
body .st-key-view_notebook,body .st-key-view_attention{position:relative}
body .st-key-view_notebook > :has([data-testid="stPopover"]),
body .st-key-view_attention > :has([data-testid="stPopover"]){position:absolute;top:0;right:0;z-index:5;width:auto}
}
/* A laptop (1366x768): the 19 px fonts put the cache and attention charts under the fold; a
   smaller base and a shorter chips box bring their tops onto the screen. */
@media (max-width:1500px),(max-height:850px){
html{font-size:16px}
body .kv-body{max-height:4.2em}
body [data-testid="stMainBlockContainer"]{padding-top:1.6rem}
}
</style>"""


def _from_url() -> bool:
    return str(st.query_params.get(PARAM, "")).lower() in ON_VALUES


def active() -> bool:
    """Is the presentation layout on for this session? The URL switches it on the first time."""
    if _from_url():  # turning the switch off removes the parameter (_on_switch)
        session.put(STATE_KEY, True)
    return bool(session.get(STATE_KEY, False))


def sidebar_state() -> str:
    """For st.set_page_config: collapsed while presenting."""
    return "collapsed" if active() else "auto"


def _on_switch() -> None:
    on = bool(session.read(KEY))
    session.put(STATE_KEY, on)
    if on:
        st.query_params[PARAM] = "1"
    elif PARAM in st.query_params:
        del st.query_params[PARAM]


def switch() -> bool:
    """The sidebar's switch; returns whether the layout is on."""
    on = active()
    session.put(KEY, on)
    st.toggle("Presentation layout", key=KEY, on_change=_on_switch,
              help="For a projector: the sidebar folds away, fonts grow, and the Generate page puts the chips, "
                   "the cache and the attention map on one 1920×1080 screen. Press S to step. A link with "
                   "?present=1 opens the app this way.")
    return on


def apply() -> bool:
    """Inject the layout's CSS on every page while it is on (and keep ?present=1 in the URL)."""
    on = active()
    if on:
        st.html(CSS)
        if not _from_url():
            st.query_params[PARAM] = "1"
    return on
