"""kvviz: page config and navigation only. Each page is a function in kvviz/ui/pages/."""
import streamlit as st

from kvviz import paths
from kvviz.ui import present, tour
from kvviz.ui.pages.batching import batching
from kvviz.ui.pages.calculator import calculator
from kvviz.ui.pages.chat import chat_page
from kvviz.ui.pages.compress import compress
from kvviz.ui.pages.decoding import decoding
from kvviz.ui.pages.generate import live
from kvviz.ui.pages.live import live_server
from kvviz.ui.pages.prefill import prefill
from kvviz.ui.pages.race import race
from kvviz.ui.pages.serving import serving_page
from kvviz.ui.sidebar import render_sidebar
from kvviz.ui.common import text_guard
from kvviz.ui.state import session

# A local SVG, not ":material/memory:": Streamlit turns a Material page icon into a favicon URL on
# fonts.gstatic.com, which fails offline and tells a third party who opens the app.
ICON = paths.ASSETS / "icon.svg"  # the checkout's assets/ or the installed package's
st.set_page_config(page_title="kvviz: see the KV cache at work", page_icon=str(ICON), layout="wide",
                   initial_sidebar_state=present.sidebar_state())  # folded away while presenting

GENERATE_PATH = "generate"
GENERATION_PAGES = [
    st.Page(live.page, title="Generate", icon=":material/edit_note:", url_path=GENERATE_PATH, default=True),
    st.Page(race.page, title="Cache vs no cache", icon=":material/speed:", url_path="race"),
    st.Page(prefill.page, title="Prefill vs decode", icon=":material/balance:", url_path="prefill"),
    st.Page(batching.page, title="Batching", icon=":material/stacks:", url_path="batching"),
    st.Page(chat_page.page, title="Chat: cache across turns", icon=":material/forum:", url_path="chat"),
    st.Page(decoding.page, title="Decoding strategies", icon=":material/account_tree:", url_path="decoding"),
    st.Page(compress.page, title="Compression lab", icon=":material/compress:", url_path="compress"),
    st.Page(serving_page.page, title="Serving: many requests at once", icon=":material/dns:", url_path="serving"),
]
CALCULATOR = st.Page(calculator.page, title="KV memory calculator", icon=":material/calculate:", url_path="calculator")
LIVE_SERVER = st.Page(live_server.page, title="Live server", icon=":material/monitor_heart:", url_path="live")


def _default_page_at_its_own_path(path: str) -> None:
    """/generate, the Generate page's own url_path, opens Generate. Streamlit serves the default page
    only at "/", so a link to /generate met "Page not found" and an inert page: here a request for
    the default page by its name is turned into a request for the app's root before the pages
    resolve (Streamlit's page manager; where that is missing, the old behaviour remains)."""
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    manager = getattr(get_script_run_ctx(), "pages_manager", None)
    if (manager is not None and getattr(manager, "intended_page_name", None) == path
            and not getattr(manager, "intended_page_script_hash", "")):
        manager.set_script_intent("", "")


_default_page_at_its_own_path(GENERATE_PATH)
# Material icons ship with Streamlit; emoji need a font that Debian's Chromium lacks.
pg = st.navigation({"Watch it generate": GENERATION_PAGES, "Size it": [CALCULATOR, LIVE_SERVER]})
tour.register_pages(generate=GENERATION_PAGES[0], race=GENERATION_PAGES[1], calculator=CALCULATOR,
                    serving=GENERATION_PAGES[7])
present.apply()  # the presentation layout's fonts, on every page
text_guard.install()  # a lone surrogate typed or pasted is replaced before the browser sends it
if pg.url_path not in (CALCULATOR.url_path, LIVE_SERVER.url_path):
    # Model, prompt and sampling controls: shared by every generation page.
    session.set_settings(render_sidebar())
tour.banner(pg.url_path)  # on the other pages while the tour is on
pg.run()
