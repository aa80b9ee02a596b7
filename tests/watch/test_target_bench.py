"""``serve-bench --target``'s client (kvviz/watch/target_bench.py, target_stats.py) against a stand-in
OpenAI-compatible server (fake_server.serve_completions): the timing arithmetic exact from the script's
own clock, the counters from scripted /metrics deltas, the request bodies, and every way a server can
refuse the workload as one line."""
from __future__ import annotations

import numpy as np
import pytest

from kvviz.watch.scrape import parse_target
from kvviz.watch.target_bench import PROBE_TEXT, TargetError, TargetRequest, body_of, refuse_steps, run_target
from kvviz.watch.target_stats import NOT_MEASURED, ServerCounts, StreamTrace, percentile, request_row, summarize
from kvviz.watch.vllm_harness import free_port

from fake_server import Completions, HandClock, fake_token, fake_tokenize, serve_completions


def _req(i: int, n: int = 4, plen: int = 5, **kw: object) -> TargetRequest:
    return TargetRequest(f"r{i}", tuple(range(i, i + plen)), n, **kw)  # type: ignore[arg-type]


def test_one_request_is_timed_exactly_from_the_scripts_clock() -> None:
    # Events at 0.25 s (1 token), 0.3125 s (2), 0.5 s (2), then the usage event at 0.625 s; sent at 0.
    # Dyadic times, so every figure below is exact in binary floating point.
    clock = HandClock()
    script = Completions(times=[0.25, 0.3125, 0.5, 0.625], chunk_tokens=[1, 2, 2])
    with serve_completions(script, clock) as (url, state):
        out = run_target(parse_target(url), [_req(0, n=5, ignore_eos=True)], clock=clock)
    row = out["requests"][0]
    assert row["ttft_ms"] == 250.0  # first output event - sent
    assert row["tpot_ms"] == (500.0 - 250.0) / (5 - 1) == 62.5  # over the server's 5 tokens, not 3 events
    assert row["e2e_ms"] == 500.0  # the last output event, as vLLM's benchmark ends a request
    assert row["output_ids"] == [fake_token(list(range(5)), k) for k in range(5)]
    assert row["output_text"] == "".join(f" t{i}" for i in row["output_ids"])
    assert (row["output_tokens"], row["prompt_tokens"], row["finish_reason"]) == (5, 5, "length")
    s = out["summary"]
    assert s["throughput_tok_s"] == 5 / 0.5 == 10.0
    assert s["ttft_ms_p50"] == s["ttft_ms_p99"] == 250.0 and s["tpot_ms_p90"] == 62.5
    assert s["steps"] is None and row["preemptions"] is None and row["prefix_hit_tokens"] is None
    assert set(NOT_MEASURED) <= set(out["not_measured"])


def test_the_request_body_is_token_ids_streamed_greedy() -> None:
    r = _req(3, n=7, ignore_eos=True, sampling={"seed": 4, "evil": 1})
    body = body_of(r, "m")
    assert body == {"model": "m", "prompt": [3, 4, 5, 6, 7], "max_tokens": 7, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True,
                    "seed": 4}  # only the known sampling fields travel


def test_percentiles_are_numpys_linear_rule() -> None:
    xs = [400.0, 100.0, 300.0, 200.0]
    # By hand: sorted 100..400, rank (n-1)q: p50 at 1.5 -> 250; p90 at 2.7 -> 370; p99 at 2.97 -> 397.
    assert [percentile(xs, q) for q in (50, 90, 99)] == pytest.approx([250.0, 370.0, 397.0], abs=1e-9)
    assert [percentile(xs, q) for q in (50, 90, 99)] == pytest.approx(list(np.percentile(xs, [50, 90, 99])), abs=1e-9)
    assert percentile([], 50) is None


def test_the_summary_by_hand() -> None:
    # Three requests from a run that started at t = 10 s: TTFTs 0.5, 1, 2 s; the last ends at 14 s.
    traces = [StreamTrace("a", 10.0, [10.5, 11.0, 11.5], completion_tokens=3),
              StreamTrace("b", 10.0, [11.0, 13.0], completion_tokens=5),  # two events, five tokens
              StreamTrace("c", 11.0, [13.0], completion_tokens=1)]  # one token: no TPOT
    rows = [request_row(t) for t in traces]
    assert [r["ttft_ms"] for r in rows] == [500.0, 1000.0, 2000.0]
    assert [r["tpot_ms"] for r in rows] == [500.0, 500.0, None]
    assert [r["e2e_ms"] for r in rows] == [1500.0, 3000.0, 2000.0]
    counts = ServerCounts(prefix_queries=(100.0, 160.0), prefix_hits=(32.0, 64.0), preemptions=(2.0, 5.0),
                          busy_steps=(7.0, 19.0), peak_running=3.0, peak_usage=0.25, final_usage=0.0,
                          used_block_total=100, polls=4)
    s = summarize(traces, 10.0, counts)
    assert s["throughput_tok_s"] == 9 / 3.0  # 3 + 5 + 1 tokens over 13 - 10 s
    assert (s["ttft_ms_p50"], s["ttft_ms_p90"]) == (1000.0, pytest.approx(1800.0))
    assert s["tpot_ms_p50"] == s["tpot_ms_p99"] == 500.0
    assert (s["prefix_query_tokens"], s["prefix_hit_tokens"], s["preemptions"]) == (60, 32, 3)
    assert (s["peak_running"], s["peak_blocks_used"], s["blocks_leaked"], s["server_busy_steps"]) == (3, 25, 0, 12)
    # A counter that went down (a server restart mid-run) is unknown, never negative.
    reset = summarize(traces, 10.0, ServerCounts(preemptions=(5.0, 1.0)))
    assert reset["preemptions"] is None and reset["peak_running"] is None and reset["peak_blocks_used"] is None


def test_a_workload_against_the_fake_server() -> None:
    # Six requests at once; the fake holds every stream until /metrics was read with all six running, so
    # the polled peak is 6 whatever the machine's load. Prefix hits are scripted per prompt length.
    reqs = [_req(i, n=3 + i, plen=4 + i, ignore_eos=True) for i in range(6)]
    script = Completions(hits={6: 4, 8: 8}, preemptions_per_request=1, hold_until_polled=6)
    with serve_completions(script) as (url, state):
        out = run_target(parse_target(url), reqs, poll_s=0.02)
    for r, row in zip(reqs, out["requests"]):
        assert row["id"] == r.id
        assert row["output_ids"] == [fake_token(list(r.prompt_ids), k) for k in range(r.max_tokens)]
        assert row["ttft_ms"] > 0 and row["e2e_ms"] >= row["ttft_ms"]
    s = out["summary"]
    assert s["prefix_query_tokens"] == sum(len(r.prompt_ids) for r in reqs) == 39
    assert s["prefix_hit_tokens"] == 4 + 8
    assert s["preemptions"] == 6
    assert s["peak_running"] == 6 and s["peak_blocks_used"] == 12 and s["blocks_leaked"] == 0
    assert s["server_busy_steps"] == s["output_tokens"] == sum(r.max_tokens for r in reqs)
    assert s["steps"] is None
    assert sorted(b["prompt"] for b in state["bodies"]) == sorted(list(r.prompt_ids) for r in reqs)
    assert all(b["model"] == "fake/model" and b["stream"] and b["ignore_eos"] for b in state["bodies"])
    assert out["settings"]["engine"] == "vllm" and out["settings"]["block_size"] == 16
    assert out["notes"] == []


def test_arrivals_are_honoured_in_seconds() -> None:
    with serve_completions(Completions()) as (url, state):
        out = run_target(parse_target(url), [_req(0), _req(1, arrival_s=0.3)])
    assert [r["id"] for r in out["requests"]] == ["r0", "r1"]
    # r1 is sent no sooner than 0.3 s after the start (the dispatcher waits for it; a wait is never
    # shorter than asked), so the run's wall time is at least that.
    assert out["summary"]["wall_s"] >= 0.3


def test_a_server_that_ignores_ignore_eos_is_named() -> None:
    script = Completions(honour_ignore_eos=False, eos_after=2)
    with serve_completions(script) as (url, _):
        out = run_target(parse_target(url), [_req(0, n=6, ignore_eos=True), _req(1, n=2, ignore_eos=True)])
    assert out["requests"][0]["output_tokens"] == 2 and out["requests"][0]["finish_reason"] == "stop"
    assert out["notes"] == ["request r0 ended at the end-of-text token after 2 of 6 tokens although ignore_eos "
                            "was sent: this server ignores it"]


def test_a_server_without_metrics_or_token_ids() -> None:
    with serve_completions(Completions(metrics=False, token_ids=False)) as (url, _):
        out = run_target(parse_target(url), [_req(0)])
    s = out["summary"]
    assert (s["prefix_hit_tokens"], s["preemptions"], s["peak_running"], s["blocks_leaked"]) == (None,) * 4
    assert out["requests"][0]["output_ids"] is None and out["requests"][0]["output_tokens"] == 4
    assert any("no /metrics" in n for n in out["notes"]) and any("token ids" in n for n in out["notes"])


@pytest.mark.parametrize("script, served, reqs, words", [
    (Completions(status=400), None, [_req(0)], "request r0: http://127.0.0.1:PORT/v1/completions: HTTP 400 Bad "
                                               "Request: scripted failure"),
    (Completions(status=500, error_body=b"boom"), None, [_req(0)], "HTTP 500 Internal Server Error: boom"),
    (Completions(stream=False), None, [_req(0)], "answered application/json, not an event stream: this server "
                                                 "does not stream completions"),
    (Completions(), "other/model", [_req(0)], "the server serves fake/model, not 'other/model' (--served-model)"),
    (Completions(max_model_len=8), None, [_req(0, n=4, plen=5)], "request r0: 5 prompt + 4 output tokens is past "
                                                                 "the server's context (8 tokens"),
    (Completions(), None, [], "the workload has no requests"),
    (Completions(), None, [_req(0), _req(0)], "request ids repeat ('r0')"),
])
def test_refusals_are_one_line(script: Completions, served: str | None, reqs: list[TargetRequest], words: str) -> None:
    with serve_completions(script) as (url, _):
        with pytest.raises(TargetError) as e:
            run_target(parse_target(url), reqs, served=served)
    msg = str(e.value)
    assert "\n" not in msg
    assert words.replace("http://127.0.0.1:PORT", url) in msg


def test_refused_and_timed_out() -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(TargetError, match=r"cannot list the server's models: .*connection refused"):
        run_target(parse_target(f"127.0.0.1:{port}"), [_req(0)])
    with serve_completions(Completions(ttft_s=2.0)) as (url, _):
        with pytest.raises(TargetError, match=r"request r0: .*: no answer within 0.2 s"):
            run_target(parse_target(url), [_req(0)], timeout_s=0.2)


def test_steps_mode_is_refused() -> None:
    refuse_steps("seconds")
    with pytest.raises(TargetError, match="--arrival steps cannot be used with --target"):
        refuse_steps("steps")


def test_the_servers_tokenizer_is_checked_against_kvvizs() -> None:
    ids = fake_tokenize(PROBE_TEXT)
    with serve_completions(Completions(tokenize=True)) as (url, _):
        out = run_target(parse_target(url), [_req(0)], probe_ids=ids)
        assert out["notes"] == []  # the same ids: the same model
        with pytest.raises(TargetError, match=r"the server's 'fake/model' tokenizes .* it serves another model"):
            run_target(parse_target(url), [_req(0)], probe_ids=ids[:-1] + [ids[-1] + 1])
    with serve_completions(Completions()) as (url, _):  # no /tokenize (llama.cpp's takes another body)
        out = run_target(parse_target(url), [_req(0)], probe_ids=ids)
    assert out["notes"] == ["the server has no /tokenize: that it runs the same model as kvviz's tokenizer was "
                            "not checked"]
