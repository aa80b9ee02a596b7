"""Nothing lost on the Serving page: the workload builder's values (every widget, the ones its
choices hide included) come back after another page was shown, and a finished run stays on the
page, downloadable, when a setting changes, with a plain note that it used the settings it started
with."""
from __future__ import annotations

from typing import Any

from streamlit.testing.v1 import AppTest

from apptest_pages import ok, tiny_default  # noqa: F401 - the fixture applies to every test here

TIMEOUT = 300
OTHER = "_test_other_page"  # True: this run draws another page (no serving widget is drawn)


def _app() -> None:
    import streamlit as st

    from kvviz.ui.pages.serving import serving_page
    from kvviz.ui.sidebar import render_sidebar

    st.session_state["settings"] = render_sidebar()
    if not st.session_state.get("_test_other_page"):  # OTHER
        serving_page.page()


# A value unlike each default (kvviz/ui/pages/serving/serving_page.py) for every builder widget.
NUMBERS: dict[str, Any] = {"serve_requests": 5, "serve_rate": 1.75, "serve_seed": 7, "serve_burst_size": 3,
                           "serve_burst_every": 6, "serve_prompt_len": 6, "serve_prompt_max": 21,
                           "serve_output_len": 3, "serve_output_max": 5, "serve_shared_len": 8, "serve_blocks": 40,
                           "serve_mib": 2.5, "serve_budget": 24, "serve_max_running": 3}


def _away_and_back(at: AppTest) -> AppTest:
    at.session_state[OTHER] = True
    at.run(timeout=TIMEOUT)  # a run that draws none of the page's widgets: Streamlit forgets their values
    drawn = [w.key for kind in ("number_input", "radio", "slider", "selectbox") for w in at.get(kind)]
    assert drawn and not [k for k in drawn if k and k.startswith("serve_")]  # the sidebar's only
    at.session_state[OTHER] = False
    return at.run(timeout=TIMEOUT)


def test_every_builder_value_survives_another_page() -> None:
    at = AppTest.from_function(_app, default_timeout=TIMEOUT).run()
    ok(at)
    # Each widget is set where it is drawn: the arrival and the pool unit hide some of them.
    at.radio(key="serve_arrival").set_value("bursts").run()
    for key in ("serve_burst_size", "serve_burst_every"):
        at.number_input(key=key).set_value(NUMBERS[key])
    at.radio(key="serve_pool_unit").set_value("MiB").run()
    at.number_input(key="serve_mib").set_value(NUMBERS["serve_mib"])
    at.radio(key="serve_pool_unit").set_value("blocks").run()
    at.radio(key="serve_arrival").set_value("steady").run()
    for key, value in NUMBERS.items():
        if key not in ("serve_burst_size", "serve_burst_every", "serve_mib"):
            at.number_input(key=key).set_value(value)
    at.run(timeout=TIMEOUT)  # one change per run, as a user makes them
    at.radio(key="serve_prompt").set_value("fixed")
    at.radio(key="serve_output").set_value("fixed")
    at.slider(key="serve_shared").set_value(0.25)
    at.selectbox(key="serve_block_size").set_value(8)
    at.run(timeout=TIMEOUT)
    ok(at)
    at = _away_and_back(at)
    ok(at)
    assert at.radio(key="serve_arrival").value == "steady"
    assert (at.radio(key="serve_prompt").value, at.radio(key="serve_output").value) == ("fixed", "fixed")
    assert at.slider(key="serve_shared").value == 0.25 and at.selectbox(key="serve_block_size").value == 8
    assert at.radio(key="serve_pool_unit").value == "blocks"
    shown = {k: v for k, v in NUMBERS.items() if k not in ("serve_burst_size", "serve_burst_every", "serve_mib")}
    assert {k: at.number_input(key=k).value for k in shown} == shown
    # The widgets that were hidden all along (bursts, MiB) come back with their values too.
    at.radio(key="serve_arrival").set_value("bursts")
    at.radio(key="serve_pool_unit").set_value("MiB").run(timeout=TIMEOUT)
    ok(at)
    assert at.number_input(key="serve_burst_size").value == NUMBERS["serve_burst_size"]
    assert at.number_input(key="serve_burst_every").value == NUMBERS["serve_burst_every"]
    assert at.number_input(key="serve_mib").value == NUMBERS["serve_mib"]


def _small_run(at: AppTest) -> AppTest:
    at.number_input(key="serve_requests").set_value(4)
    at.radio(key="serve_arrival").set_value("once")
    at.number_input(key="serve_prompt_len").set_value(6)
    at.number_input(key="serve_prompt_max").set_value(12)
    at.number_input(key="serve_output_len").set_value(2)
    at.number_input(key="serve_output_max").set_value(4)
    at.number_input(key="serve_shared_len").set_value(8)
    at.selectbox(key="serve_block_size").set_value(4)
    at.number_input(key="serve_budget").set_value(16)
    at.run(timeout=TIMEOUT)
    at.button(key="serve_run").click().run(timeout=TIMEOUT)
    ok(at)
    return at


def _metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def _notes(at: AppTest) -> list[str]:
    return [i.value for i in at.info if "changed after this run" in i.value]


def test_a_finished_run_stays_when_a_setting_changes_and_after_another_page() -> None:
    at = _small_run(AppTest.from_function(_app, default_timeout=TIMEOUT).run())
    before = _metrics(at)
    assert before["Peak running"] and not _notes(at)  # the settings are the run's: no note
    at.slider(key="serve_replay").set_value(1).run(timeout=TIMEOUT)
    # A changed setting (and even a bad one: 0 requests) keeps the run, its numbers and its downloads.
    at.number_input(key="serve_budget").set_value(32).run(timeout=TIMEOUT)
    assert _metrics(at) == before
    note = _notes(at)
    assert len(note) == 1 and "4 requests" in note[0] and "a budget of 16 tokens" in note[0]
    at.number_input(key="serve_requests").set_value(0).run(timeout=TIMEOUT)
    assert _metrics(at) == before and not at.exception
    labels = {b.proto.label for b in at.get("download_button")}
    assert labels == {"Events (JSON Lines)", "Requests (CSV)"}
    # Away and back: the run, the changed settings and the replay's step are all still there.
    at = _away_and_back(at)
    assert _metrics(at) == before and len(_notes(at)) == 1
    assert at.number_input(key="serve_requests").value == 0 and at.number_input(key="serve_budget").value == 32
    assert at.slider(key="serve_replay").value == 1
    # Back to the run's settings: the note goes.
    at.number_input(key="serve_requests").set_value(4)
    at.number_input(key="serve_budget").set_value(16).run(timeout=TIMEOUT)
    assert not _notes(at) and _metrics(at) == before
