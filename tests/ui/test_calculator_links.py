"""Issue 37, class 3: every link the calculator writes reproduces the same page when opened.

Each case sets EVERY setting of the page (calculator_links.SHARED_KEYS) away from its default, lets the
page write its link into the address bar, opens that link in a new session and checks that every
setting, every headline figure and the link itself come back unchanged, with no "ignored" warning.
"""
from __future__ import annotations

from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from kvviz.ui.pages.calculator.calculator_links import DEFAULTS, SHARED_KEYS
from test_calculator_page import fresh, metrics

# Everything away from its default, and a custom GPU size: the reported mem_gpu=custom link.
CUSTOM: dict[str, Any] = {
    "mem_source": "preset", "mem_preset": "mistral-7b-v0.1", "mem_seq_len": 12_345, "mem_batch": 3, "mem_beams": 2,
    "mem_dtype": "int4", "mem_weight_dtype": "fp8", "mem_group_size": 128, "mem_scale_dtype": "fp32",
    "mem_zero_point": True, "mem_paged": True, "mem_block_size": 32, "mem_windows": True,
    "mem_gpu": "custom", "mem_gpu_custom": 33.0, "mem_reserve": 5, "mem_params": 7_000_000_000,
    "mem_compare": ["llama-2-7b"], "mem_chart_dtypes": ["fp8"], "mem_log": False, "mem_chart_weights": True,
    "mem_tp": 2, "mem_state_dtype": "fp32", "mem_gpu_kind": "custom", "mem_bandwidth": 1234.5, "mem_price": 3.25,
    "mem_efficiency": 0.55, "mem_cost_dtype": "int8", "mem_cache_window": True, "mem_window": 2048, "mem_sinks": 8,
}
# A named GPU with a preset size, empty lists, a 1 TB context: the other branch of every setting that has one.
NAMED = {**CUSTOM, "mem_gpu": "141", "mem_gpu_kind": "h200", "mem_bandwidth": 4800.0, "mem_price": 3.5,
         "mem_compare": [], "mem_chart_dtypes": [], "mem_seq_len": 1_000_000_000_000, "mem_batch": 1_073_741_824,
         "mem_cache_window": False, "mem_paged": False, "mem_dtype": "fp16", "mem_windows": False}
# An imported config: the link carries every setting but the config (too big for a link) and the preset.
IMPORTED = {**CUSTOM, "mem_source": "import", "mem_preset": DEFAULTS["mem_preset"]}
CASES = {"custom_gpu": CUSTOM, "named_gpu_huge_context": NAMED, "imported": IMPORTED}


def _open_with_settings(settings: dict[str, Any]) -> AppTest:
    at = AppTest.from_function(_script, default_timeout=90)
    for k, v in settings.items():
        at.session_state[k] = v
    return at.run()


def _script() -> None:
    from kvviz.ui.pages.calculator.calculator import page

    page()


def test_the_cases_cover_every_setting() -> None:
    """A setting added to the page without a case here fails this test, so the round trip stays complete."""
    assert all(set(case) == set(SHARED_KEYS) for case in CASES.values())
    assert [k for k in SHARED_KEYS if all(case[k] == DEFAULTS[k] for case in CASES.values())] == []


@pytest.mark.parametrize("case", CASES)
def test_a_written_link_reproduces_the_page(case: str) -> None:
    settings = CASES[case]
    first = _open_with_settings(settings)
    assert not first.exception, first.exception
    link = dict(first.query_params)
    assert {k: first.session_state[k] for k in SHARED_KEYS} == settings  # the page kept what was set
    again = fresh(**link)  # a new session, as when the link is pasted into another browser
    assert not again.exception, again.exception
    assert [w.value for w in again.warning if w.value.startswith("Link setting")] == []
    assert [w.value for w in again.warning] == [w.value for w in first.warning]
    assert {k: again.session_state[k] for k in SHARED_KEYS} == settings
    assert metrics(again) == metrics(first)
    assert bool(metrics(first)) == (case != "imported")  # an import without its config shows no figures
    assert [i.value for i in again.info] == [i.value for i in first.info]
    assert dict(again.query_params) == link


def test_the_reported_gpu_link_round_trips() -> None:
    """/calculator?mem_gpu=33 is rewritten to mem_gpu=custom&mem_gpu_custom=33.0; that link keeps 33 GiB."""
    first = fresh(mem_gpu="33")
    link = dict(first.query_params)
    assert (link["mem_gpu"], link["mem_gpu_custom"]) == ("custom", "33.0")
    again = fresh(**link)
    assert not again.warning and again.session_state["mem_gpu_custom"] == 33.0
    assert metrics(again) == metrics(first)


@pytest.mark.parametrize("raw", ["0.1", "100001", "nan", "-3"])
def test_a_gpu_size_outside_the_box_is_ignored_with_a_message(raw: str) -> None:
    """The Custom (GiB) box takes 0.5 to 100,000: a link outside it is named, never a crash."""
    at = fresh(mem_gpu="custom", mem_gpu_custom=raw)
    assert not at.exception
    assert any("mem\\_gpu\\_custom" in w.value and "ignored" in w.value for w in at.warning), [w.value for w in at.warning]
    assert at.session_state["mem_gpu_custom"] == DEFAULTS["mem_gpu_custom"]
