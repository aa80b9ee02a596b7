"""AppTest over the Serving page on random:tiny: a small workload runs to the end and the numbers
shown are the run's records; bad input is one clear message each, with the inputs kept; the
policy comparison runs all three."""
from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest

from apptest_pages import ok, tiny_default  # noqa: F401 - the fixture applies to every test here
from kvviz.charts import serving_data as sd
from kvviz.ui.common.plain_text import unescape  # errors are shown through md_plain

TIMEOUT = 300


def _page() -> None:
    import streamlit as st

    from kvviz.ui.pages.serving import serving_page
    from kvviz.ui.sidebar import render_sidebar

    st.session_state["settings"] = render_sidebar()
    serving_page.page()


def _small(at: AppTest) -> AppTest:
    at.number_input(key="serve_requests").set_value(5)
    at.radio(key="serve_arrival").set_value("once")
    at.number_input(key="serve_prompt_len").set_value(6)
    at.number_input(key="serve_prompt_max").set_value(20)
    at.number_input(key="serve_output_len").set_value(3)
    at.number_input(key="serve_output_max").set_value(6)
    at.number_input(key="serve_shared_len").set_value(8)
    at.number_input(key="serve_blocks").set_value(12)
    at.selectbox(key="serve_block_size").set_value(4)
    at.number_input(key="serve_budget").set_value(16)
    return at.run(timeout=TIMEOUT)


def _job(at: AppTest, slot: str):  # type: ignore[no-untyped-def]
    from kvviz.ui.state import session

    return at.session_state[getattr(session, slot)]


def test_a_run_shows_its_own_records() -> None:
    at = _small(AppTest.from_function(_page, default_timeout=TIMEOUT).run())
    ok(at)
    at.button(key="serve_run").click().run(timeout=TIMEOUT)
    ok(at)
    job = _job(at, "SERVE_JOB")
    res = job.results["continuous"]
    assert len(res.requests) == 5 and all(r.state == "finished" and r.finish_reason == "length" for r in res.requests)
    summary = sd.summarize(res.steps, res.requests)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Peak running"] == str(summary.peak_running)
    assert metrics["Preemptions"] == str(summary.preemptions)
    assert metrics["Throughput"] == f"{summary.throughput_tok_s:,.1f} tok/s"
    assert metrics["TTFT p50"] == f"{summary.ttft_ms[0]:,.1f} ms"
    table = at.dataframe[0].value
    assert list(table["id"]) == [r.request_id for r in res.requests]
    assert list(table["output tokens"]) == [len(r.output_ids) for r in res.requests]
    titles = [json.loads(el.proto.spec)["layout"]["title"]["text"] for el in at.get("plotly_chart")]
    assert "Each request's life, step by step" in titles and "Latency percentiles" in titles
    assert any(t.startswith("Block pool after step") for t in titles)
    # The replay: the pool as it stood after step 0
    at.slider(key="serve_replay").set_value(0).run(timeout=TIMEOUT)
    ok(at)
    assert any(json.loads(el.proto.spec)["layout"]["title"]["text"] == "Block pool after step 0"
               for el in at.get("plotly_chart"))
    assert res.blocks_leaked == 0


def test_bad_input_is_one_clear_message_and_the_inputs_stay() -> None:
    at = AppTest.from_function(_page, default_timeout=TIMEOUT).run()
    at.number_input(key="serve_requests").set_value(0).run()
    assert any("at least 1 request" in unescape(e.value) for e in at.error)
    assert at.button(key="serve_run").disabled and at.number_input(key="serve_requests").value == 0
    at.number_input(key="serve_requests").set_value(4).run()
    at.number_input(key="serve_budget").set_value(8).run()
    assert any("smaller than one block (16 tokens)" in unescape(e.value) for e in at.error)
    at.number_input(key="serve_budget").set_value(64)
    at.number_input(key="serve_blocks").set_value(1).run()
    assert any("smaller than one request's prompt" in unescape(e.value) for e in at.error)
    at.number_input(key="serve_blocks").set_value(32)
    at.number_input(key="serve_prompt_max").set_value(5000).run()
    assert any("past this model's context" in unescape(e.value) for e in at.error)
    assert at.number_input(key="serve_prompt_max").value == 5000 and not at.exception


def test_the_three_policies_side_by_side() -> None:
    at = _small(AppTest.from_function(_page, default_timeout=TIMEOUT).run())
    at.button(key="serve_compare").click().run(timeout=TIMEOUT)
    ok(at)
    job = _job(at, "SERVE_COMPARE")
    assert list(job.results) == ["continuous", "static", "sequential"]
    outs = {p: {r.request_id: r.output_ids for r in res.requests} for p, res in job.results.items()}
    assert outs["continuous"] == outs["static"] == outs["sequential"]  # greedy: batching changes no output
    # One at a time never runs two requests in a step
    assert max(len(s.running) for s in job.results["sequential"].steps) == 1
    table = at.dataframe[-1].value  # the comparison table, last on the page
    assert list(table["policy"]) == ["continuous batching", "static batching", "one at a time"]
    assert list(table["steps"]) == [sd.summarize(r.steps, r.requests).steps for r in job.results.values()]
