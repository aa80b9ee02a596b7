"""The sidebar's machine line: the cores, the thread count the forwards run on and why, and a
control to change it (kvviz.measure.threads holds the choice; it is process-wide)."""
from __future__ import annotations

import streamlit as st

from kvviz import LoadedModel
from kvviz.measure import threads
from kvviz.ui.state import session

KEY = "cpu_threads"


def apply() -> threads.ThreadChoice:
    """Apply the thread choice before any model is loaded or run (once per process)."""
    return threads.ensure()


def _on_change() -> None:
    threads.set_threads(int(session.read(KEY)))


def render(model: LoadedModel | None) -> None:
    choice = apply()
    on_gpu = model is not None and str(model.device).startswith("cuda")
    where = " The model runs on the GPU; these threads do the rest." if on_gpu else ""
    with st.container(key="machine_line"):
        st.caption(f":material/developer_board: {choice.describe()}.{where}")
        with st.popover("CPU threads", icon=":material/tune:"):
            session.put(KEY, choice.threads)  # follow the process's value (another session may set it)
            st.number_input(
                "Threads for the model's forwards", 1, max(choice.cores, choice.threads), step=1, key=KEY,
                on_change=_on_change,
                help="Every session of this server shares it. More threads than free cores make torch's "
                     "spinning threads fight the browser for the CPU, and generation collapses; one core left "
                     "for the browser keeps the live views smooth. Start the app with KVVIZ_THREADS=N to "
                     "choose it from the start.")
