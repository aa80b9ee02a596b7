"""``serve-bench --target URL``: the same workload kvviz's engine runs, sent to a running vLLM, SGLang
or llama.cpp server instead (kvviz/watch/target_bench.py), printing the same ``--json`` keys.

The workload is read and tokenized exactly as for kvviz's own engine (serve-bench's workload reader,
the model's tokenizer and chat template), so both engines get the same prompt ids; only the arrival
clock differs: a server has no step counter a client can see, so ``--arrival steps`` is refused.
"""
from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from kvviz.cli.argtypes import float_in
from kvviz.watch.scrape import parse_target
from kvviz.watch.target_bench import REQUEST_TIMEOUT_S, TargetRequest, refuse_steps, run_target


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a running server instead of kvviz's engine")
    g.add_argument("--target", metavar="URL", default=None,
                   help="send the workload to this OpenAI-compatible server (vLLM, SGLang, llama.cpp) and "
                        "measure it there: streamed /v1/completions, prompts as token ids; arrivals in seconds")
    g.add_argument("--served-model", metavar="NAME", default=None,
                   help="the model name to send (default: the one the server lists at /v1/models)")
    g.add_argument("--header", action="append", default=[], metavar="'Name: value'",
                   help="an HTTP header for every request, e.g. 'Authorization: Bearer KEY' (repeatable)")
    g.add_argument("--poll", type=float_in(0.05, 60.0, "seconds between reads", "0.5"), default=0.5, metavar="S",
                   help="read the server's /metrics every S seconds during the run (peak running, KV usage)")
    g.add_argument("--request-timeout", type=float_in(1.0, 3600.0, "seconds", "900"), default=REQUEST_TIMEOUT_S, metavar="S",
                   help="give up on a request after S seconds without a byte from the server")


def target_requests(requests: Iterable[Any]) -> list[TargetRequest]:
    """serve-bench's requests (``ServeRequest``: id, prompt ids, max_tokens, sampling, ignore_eos, stop,
    arrival) as the client sends them: greedy stays greedy (temperature 0); sampled requests carry
    their temperature, top-k, top-p and seed (the server's own sampler draws other numbers)."""
    out = []
    for r in requests:
        sampling: dict[str, Any] = {}
        sp = getattr(r, "sampling", None)
        if sp is not None and not getattr(sp, "greedy", True):
            sampling = {"temperature": sp.temperature, "seed": sp.seed,
                        **({"top_k": sp.top_k} if sp.top_k is not None else {}),
                        **({"top_p": sp.top_p} if sp.top_p is not None else {})}
        stop = tuple(getattr(r, "stop", ()) or ())
        if stop:
            sampling["stop"] = list(stop)
        out.append(TargetRequest(str(r.request_id), tuple(int(i) for i in r.prompt_ids), int(r.max_tokens),
                                 bool(r.ignore_eos), float(r.arrival), sampling))
    return out


def run_against_target(args: argparse.Namespace, requests: Iterable[Any],
                       probe_ids: list[int] | None = None) -> dict[str, Any]:
    """The ``serve-bench --target`` JSON object; a TargetError (one line) when the server cannot run it."""
    refuse_steps(getattr(args, "arrival", None) or "seconds")
    target = parse_target(args.target, args.header)
    return run_target(target, target_requests(requests), served=args.served_model, poll_s=args.poll,
                      timeout_s=args.request_timeout, probe_ids=probe_ids)


def run_serve_target(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """``serve-bench --target URL``: the workload read and tokenized by ``--model`` as for kvviz's engine,
    then sent to the server. The engine's own options (policy, pool, budget) are the server's there."""
    from kvviz.engine.loaded import load_model
    from kvviz.engine.serving.workloads import BUILTIN, builtin, load_workload
    from kvviz.errors import KVVizError
    from kvviz.watch.target_bench import PROBE_TEXT

    refuse_steps(args.arrival or "seconds")  # before a model loads
    if args.events is not None:
        raise KVVizError("--events records kvviz's scheduler steps; a server's are not visible: drop --events "
                         "with --target")
    model = load_model(args.model, device="cpu")  # its tokenizer and chat template make the prompt ids
    if args.workload in BUILTIN:
        requests = builtin(args.workload, model, args.num_requests, args.seed)
    else:
        requests = load_workload(args.workload, model)
    probe = model.tokenizer.encode(PROBE_TEXT) if getattr(model, "has_tokenizer", True) else None
    obj = run_against_target(args, requests, probe)
    obj["settings"].update(model=model.name, workload=args.workload)
    return obj, target_report(obj)


def target_report(obj: dict[str, Any]) -> str:
    """The text serve-bench prints without --json."""
    s, st = obj["summary"], obj["settings"]

    def f(x: Any, fmt: str = "{:.1f}") -> str:
        return "n/a" if x is None else fmt.format(x)

    lines = [f"{st['num_requests']} requests on {st['engine'] or 'a server'} at {st['target']} "
             f"(model {st['served_model']})",
             f"throughput {f(s['throughput_tok_s'])} tok/s ({s['output_tokens']} tokens in {f(s['wall_s'], '{:.2f}')} s)",
             f"TTFT ms p50/p90/p99: {f(s['ttft_ms_p50'])} / {f(s['ttft_ms_p90'])} / {f(s['ttft_ms_p99'])}",
             f"TPOT ms p50/p90/p99: {f(s['tpot_ms_p50'])} / {f(s['tpot_ms_p90'])} / {f(s['tpot_ms_p99'])}",
             f"prefix cache: {f(s['prefix_hit_tokens'], '{}')} of {f(s['prefix_query_tokens'], '{}')} tokens hit; "
             f"preemptions {f(s['preemptions'], '{}')}; peak running {f(s['peak_running'], '{}')} "
             f"({s['metrics_polls']} polls of /metrics)"]
    lines += [f"note: {n}" for n in obj["notes"]]
    return "\n".join(lines)
