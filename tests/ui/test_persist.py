"""Widget values kept across pages (kvviz.ui.state.persist), on a plain dict standing in for st.session_state."""
from __future__ import annotations

import types

import pytest

from kvviz.ui.state import persist, session


@pytest.fixture()
def state(monkeypatch: pytest.MonkeyPatch) -> dict:
    fake: dict = {}
    monkeypatch.setattr(session, "st", types.SimpleNamespace(session_state=fake))
    return fake


def test_a_forgotten_widget_comes_back_from_its_shadow(state: dict) -> None:
    """Streamlit drops a widget's value after a run of a page that does not draw it (the calculator's
    context came back as 8,192 after a visit to the Generate page): keep puts the last value back."""
    assert persist.keep("mem_seq_len", 8192) == 8192  # first visit: the default
    state["mem_seq_len"] = 2048  # the user types 2,048
    persist.remember("mem_seq_len")
    del state["mem_seq_len"]  # another page ran: Streamlit forgot it
    assert persist.keep("mem_seq_len", 8192) == 2048 and state["mem_seq_len"] == 2048


def test_now_and_index_of_give_a_widget_its_current_value(state: dict) -> None:
    """What a widget is given as its default: the value its key holds now, so a widget registered afresh
    does not fall back to its lowest value or first option (every calculator setting did, once in CI)."""
    state.update(mem_bandwidth=3350, mem_gpu_kind="h100-sxm", mem_log=1)
    assert persist.now("mem_bandwidth", float) == 3350.0 and isinstance(persist.now("mem_bandwidth", float), float)
    assert persist.now("mem_log", bool) is True and persist.now("mem_gpu_kind") == "h100-sxm"
    assert persist.index_of("mem_gpu_kind", ["a100-80", "h100-sxm", "custom"]) == 1
    assert persist.index_of("mem_gpu_kind", ("a100-80", "custom")) == 0  # no longer offered: the first
    assert persist.index_of("missing", ["x", "y"]) == 0
