"""``serve-bench --target``'s wiring (kvviz/cli/target_cli.py): serve-bench's requests become the
client's, its options are bounded, steps mode is refused, and the text report names every figure."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

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
