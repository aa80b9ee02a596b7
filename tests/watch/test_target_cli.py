"""``serve-bench --target``'s wiring (kvviz/cli/target_cli.py): serve-bench's requests become the
client's, its options are bounded, steps mode is refused, and the text report names every figure."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvviz.cli.target_cli import add_target_arguments, run_against_target, target_report, target_requests
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.errors import KVVizError
from kvviz.watch.target_bench import TargetError

from fake_server import Completions, fake_token, serve_completions


@dataclass(frozen=True)
class Req:  # the fields serve-bench's ServeRequest has (engine/serving/requests.py)
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int = 4
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = True
    stop: tuple[str, ...] = ()
    arrival: float = 0.0


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--arrival", default="seconds")
    add_target_arguments(p)
    return p.parse_args(list(argv))


def test_requests_keep_their_ids_lengths_and_sampling() -> None:
    greedy, sampled = target_requests([
        Req("a", (1, 2, 3), 5, arrival=1.5),
        Req("b", (4,), 2, SamplingParams(greedy=False, temperature=0.7, top_k=5, seed=3), False, ("\n",))])
    assert (greedy.id, greedy.prompt_ids, greedy.max_tokens, greedy.ignore_eos, greedy.arrival_s) == \
        ("a", (1, 2, 3), 5, True, 1.5)
    assert dict(greedy.sampling) == {}  # greedy: the client's temperature 0
    assert dict(sampled.sampling) == {"temperature": 0.7, "seed": 3, "top_k": 5, "stop": ["\n"]}


def test_the_workload_runs_against_a_server_and_reports() -> None:
    reqs = [Req("a", (1, 2, 3), 3), Req("b", (5, 6), 2, arrival=0.05)]
    with serve_completions(Completions(hits={3: 2})) as (url, _):
        obj = run_against_target(_args("--target", url, "--poll", "0.05"), reqs)
    assert [r["output_ids"] for r in obj["requests"]] == [[fake_token([1, 2, 3], k) for k in range(3)],
                                                           [fake_token([5, 6], k) for k in range(2)]]
    assert obj["summary"]["prefix_hit_tokens"] == 2 and obj["summary"]["prefix_query_tokens"] == 5
    text = target_report(obj)
    assert "2 requests on vllm at " + url in text and "prefix cache: 2 of 5 tokens hit" in text
    assert "throughput" in text and "TTFT ms p50/p90/p99" in text


def test_steps_and_bad_options_are_refused() -> None:
    with pytest.raises(TargetError, match="--arrival steps cannot be used with --target"):
        run_against_target(_args("--target", "http://127.0.0.1:9", "--arrival", "steps"), [Req("a", (1,))])
    with pytest.raises(SystemExit):
        _args("--poll", "0")  # an argparse error line and exit 2, before anything is sent
    with pytest.raises(KVVizError, match="header 'nocolon' is not 'Name: value'"):
        run_against_target(_args("--target", "127.0.0.1:9", "--header", "nocolon"), [Req("a", (1,))])


REQUEST_KEYS = {"id", "output_ids", "output_text", "ttft_ms", "tpot_ms", "e2e_ms", "preemptions", "lost_tokens",
                "prefix_hit_tokens"}  # serve-bench --json's, as issue 39 lists them (tests/cli/test_serve_cli.py)
SUMMARY_KEYS = {"throughput_tok_s", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90",
                "tpot_ms_p99", "preemptions", "prefix_query_tokens", "prefix_hit_tokens", "peak_running",
                "peak_blocks_used", "blocks_leaked", "steps"}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from kvviz.cli.main import main

    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_serve_bench_target_prints_serve_benchs_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "a", "prompt": "To be, or not", "max_tokens": 3, "ignore_eos": True}) + "\n"
                  + json.dumps({"id": "b", "prompt_ids": [5, 6, 7], "max_tokens": 2, "arrival": 0.05}) + "\n")
    with serve_completions(Completions()) as (url, state):
        code, out, err = cli(capsys, "serve-bench", "--model", "random:tiny", "--workload", str(wl), "--target", url,
                             "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert REQUEST_KEYS <= set(obj["requests"][0]) and SUMMARY_KEYS <= set(obj["summary"])
    ids = list("To be, or not".encode())  # random:tiny's byte tokenizer
    assert [b["prompt"] for b in state["bodies"]] == [ids, [5, 6, 7]]
    assert obj["requests"][0]["output_ids"] == [fake_token(ids, k) for k in range(3)]
    assert obj["settings"]["model"] == "random:tiny" and obj["settings"]["arrival"] == "seconds"
    # The fake has no /tokenize: the run says the model check was not possible.
    assert any("/tokenize" in n for n in obj["notes"])
    code, out, err = cli(capsys, "serve-bench", "--model", "random:tiny", "--workload", str(wl), "--target",
                         "http://127.0.0.1:9")
    assert code == 2 and out == "" and "Traceback" not in err
    assert [line for line in err.splitlines() if "error:" in line] == [
        "kvviz serve-bench: error: cannot list the server's models: http://127.0.0.1:9/v1/models: connection refused "
        "(is the server running on that port?)"]


def test_serve_bench_target_refuses_steps_and_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "serve-bench", "--model", "random:tiny", "--workload", "mixed", "--target",
                         "127.0.0.1:9", "--arrival", "steps")
    assert code == 2 and "kvviz serve-bench: error: --arrival steps cannot be used with --target" in err
    code, out, err = cli(capsys, "serve-bench", "--model", "random:tiny", "--workload", "mixed", "--target",
                         "127.0.0.1:9", "--events", str(tmp_path / "e.jsonl"))
    assert code == 2 and "drop --events with --target" in err
