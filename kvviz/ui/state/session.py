"""This session's state, reached through here only.

Every value the app keeps per browser session outside a widget has a named slot below, so the
keys are written once and a reader sees in one place what a session holds. The pages and parts
read and write through the functions below; no other module touches ``st.session_state`` (a test
scans kvviz/ui for it). A widget's own key stays with the widget that draws it (``key=...``), and
its value is read back here by that key (``get``/``read``).

The functions reach ``st.session_state`` at the moment they are called, exactly as the code they
replace did: a read is still a Streamlit interrupt point, and an old run whose session state was
taken over by a newer one still raises on it (``RunStore`` keeps a plain dict for that reason).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import streamlit as st

if TYPE_CHECKING:
    from kvviz.ui.settings import Settings

# --- named slots (values that no widget owns) ---------------------------------------------------
SETTINGS = "settings"  # the sidebar's frozen Settings for this script run; app.py stores it
KEPT_WIDGETS = "_kvviz_kept_widgets"  # persist.py's shadow copy of widget values
RUNS_PREFIX = "kvviz_runs_"  # + a store's name: a RunStore's plain dict (run_store.py)
# Generate page
STEPPER = "_kvviz_stepper"  # the step-mode Stepper between Step presses
VIEW_PLACE = "_kvviz_view_place"  # which of the run view's two places holds it
REPLAY_PLAYING = "_kvviz_playing"  # replay's Play is on
REPLAY_FOR = "_kvviz_replay_for"  # (run id, steps) the replay state was set up for
REPLAY_INTERVAL = "_kvviz_replay_interval"  # the timer the replay fragment was created with
REPLAY_POS = "_kvviz_replay_pos"  # the step replay shows (the slider follows it, Play advances it)
REPLAY_TICK = "_kvviz_replay_tick"  # (run id, playing) of the fragment's previous run
REPLAY_TICKS_LEFT = "_kvviz_replay_ticks_left"  # what one Play may still advance
# tour and presentation
TOUR_STEP = "_kvviz_tour"  # the tour's step; 0 = off
TOUR_URL_READ = "_kvviz_tour_url"  # ?tour=N was read once this session
TOUR_LAST_PAGE = "_kvviz_tour_last_page"  # the page of the previous script run
TOUR_SCROLLED = "_kvviz_tour_scrolled"  # the step whose chart was last scrolled into view
TOUR_ARRIVALS = "_kvviz_tour_arrivals"  # arrivals counted, so each scroll script is new
PRESENT_ON = "_kvviz_present"  # the presentation layout's value, kept across pages
# measurement pages
SIZING_CALIBRATION = "sizing_cal"  # the estimator's calibration per (model, device, dtype)
MACHINE_PROBES = "pd_probes"  # the roofline probe per (device, dtype)
RACE_NEXT_ID = "race_next_id"  # the race page's run counter
RACE_TOKENS = "race_tokens"  # (the race's inputs, the new tokens its caption named): a click races the N shown
BUSY_SUFFIX = "::busy"  # + a results key: the busy warning measured beside a sweep
# Chat page
CHAT_CONVERSATION = "chat_conv"  # the Conversation over one cache
CHAT_CONVERSATION_KEY = "chat_key"  # (cache settings, next-turn settings) it runs with
CHAT_CHECKS = "chat_checks"  # turn -> (matches scratch, max |diff|)
CHAT_ERROR = "chat_error"  # a message for the next run
CHAT_SCENARIO = "chat_scn"  # the one-click scenario's stages
# calculator
CALC_LINK_READ = "mem_qp_loaded"  # the URL's settings were read once this session
# Serving page
SERVE_JOB = "_kvviz_serve_job"  # the last Run: a ServeJob (pages/serving/serving_run.py), live or finished
SERVE_COMPARE = "_kvviz_serve_compare"  # the last policy comparison, a ServeJob of three runs
SERVE_REPLAY_FOR = "_kvviz_serve_replay_for"  # the run whose step the replay slider (serve_replay) keeps
# Live server page
LIVE_WATCH = "_kvviz_live_watch"  # the readings of the server being watched (pages/live/live_server.py)


# --- access -------------------------------------------------------------------------------------

def mapping() -> MutableMapping[str, Any]:
    """The session's mapping itself, for code that keeps its own dict in it (RunStore) or walks it."""
    return st.session_state


def get(key: str, default: Any = None) -> Any:
    return st.session_state.get(key, default)


def read(key: str) -> Any:
    """The value under ``key``; KeyError when there is none (a widget's key read after it is drawn)."""
    return st.session_state[key]


def put(key: str, value: Any) -> None:
    st.session_state[key] = value


def setdefault(key: str, default: Any) -> Any:
    return st.session_state.setdefault(key, default)


def pop(key: str, default: Any = None) -> Any:
    return st.session_state.pop(key, default)


def has(key: str) -> bool:
    return key in st.session_state


def update(values: Mapping[str, Any]) -> None:
    st.session_state.update(values)


def items() -> Iterator[tuple[str, Any]]:
    """A snapshot of (key, value) pairs: safe to walk while the session changes."""
    return iter(list(st.session_state.items()))


# --- typed slots --------------------------------------------------------------------------------

def settings() -> Settings | None:
    """This run's sidebar Settings (None on the calculator page, which has no sidebar)."""
    return st.session_state.get(SETTINGS)


def set_settings(value: Settings) -> None:
    st.session_state[SETTINGS] = value
