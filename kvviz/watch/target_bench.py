"""A workload sent to a running OpenAI-compatible server (vLLM, SGLang, llama.cpp's server), measured
as ``serve-bench`` measures kvviz's own engine: ``serve-bench --target URL``.

Every request is one streamed ``POST /v1/completions``: the prompt as token ids (so both engines see
the same tokens, whatever their tokenizers do to text), ``max_tokens``, temperature 0 unless the
workload names its own sampling, ``stream: true`` with ``stream_options.include_usage`` (the server's
own output-token count), ``ignore_eos`` (a vLLM and SGLang extension; llama.cpp's server reads it as a
native option; a server that drops it ends a request early at its end-of-text token, and the run's
notes say which requests did) and ``return_token_ids`` (vLLM's extension: the output ids, chunk by
chunk; without it ``output_ids`` is null). Each request is sent at its arrival second from the run's
start, on its own thread; the server's scheduler decides the rest, as it would for real clients.

Around the run /metrics is read (``server_metrics.read_metrics``): the prefix-cache and preemption
counters before and after, the running count and KV usage polled every ``poll_s`` while requests are in
flight (a peak between two polls is missed: the summary says how many polls it took). What a client
cannot see (per-request preemptions and prefix hits, the scheduler's steps) is null and named in
``not_measured``. The timing arithmetic is ``target_stats``.

Bad answers end the run with one line (``TargetError``): a refused connection, a timeout, an HTTP
error with the server's own message, an answer that is not an event stream, a model the server does
not serve, a request longer than the server's context.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvviz.errors import KVVizError
from kvviz.watch.scrape import ScrapeError, Target, fetch_json, fetch_text
from kvviz.watch.server_metrics import Reading, parse_metrics, read_metrics
from kvviz.watch.target_stats import NOT_MEASURED, ServerCounts, StreamTrace, request_row, summarize

REQUEST_TIMEOUT_S = 900.0  # one read's silence: 64 requests queued on a busy 2-core CPU wait minutes
MAX_LINE_BYTES = 1 << 20  # one SSE line; a completion chunk is a few hundred bytes
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "min_tokens")


class TargetError(KVVizError):
    """The server could not run the workload; the message is one line saying why."""


def refuse_steps(arrival: str) -> None:
    """Arrivals in scheduler steps have no meaning against a server: its steps are not a client's to count."""
    if arrival != "seconds":
        raise TargetError(f"--arrival {arrival} cannot be used with --target: a server's scheduler steps are not "
                          "visible to a client; use --arrival seconds")


@dataclass(frozen=True)
class TargetRequest:
    """One request of the workload, its prompt already token ids."""

    id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = False
    arrival_s: float = 0.0
    sampling: Mapping[str, Any] = field(default_factory=dict)  # any of SAMPLING_FIELDS; default greedy


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int | None


def served_model(target: Target, wanted: str | None, timeout_s: float) -> ServedModel:
    """The model to name in every request: ``wanted`` if the server serves it, else the only one it serves."""
    try:
        listing = fetch_json(target, "/v1/models", timeout_s)
    except ScrapeError as e:
        raise TargetError(f"cannot list the server's models: {e}") from None
    rows = listing.get("data") if isinstance(listing, dict) else None
    models = [r for r in rows if isinstance(r, dict) and isinstance(r.get("id"), str)] if isinstance(rows, list) else []
    names = [r["id"] for r in models]
    if not names:
        raise TargetError(f"{target.url('/v1/models')} lists no model: is this an OpenAI-compatible server?")
    if wanted is None and len(names) > 1:
        raise TargetError(f"the server serves {len(names)} models ({', '.join(names[:5])}): name one with --served-model")
    if wanted is not None and wanted not in names:
        raise TargetError(f"the server serves {', '.join(names[:5])}, not {wanted!r} (--served-model)")
    row = models[names.index(wanted) if wanted is not None else 0]
    L = row.get("max_model_len")
    return ServedModel(row["id"], L if isinstance(L, int) and not isinstance(L, bool) and L > 0 else None)


def check_lengths(requests: Sequence[TargetRequest], model: ServedModel) -> None:
    """A request the server would refuse for its length is named before anything is sent."""
    if not requests:
        raise TargetError("the workload has no requests")
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        raise TargetError(f"request ids repeat ({next(i for i in ids if ids.count(i) > 1)!r}): each must be its own")
    if model.max_model_len is None:
        return
    for r in requests:
        if len(r.prompt_ids) + r.max_tokens > model.max_model_len:
            raise TargetError(f"request {r.id}: {len(r.prompt_ids)} prompt + {r.max_tokens} output tokens is past the "
                              f"server's context ({model.max_model_len} tokens, --max-model-len)")


PROBE_TEXT = "The KV cache holds each token's keys and values."


def check_tokenizer(target: Target, model: str, ids: Sequence[int], timeout_s: float) -> str | None:
    """Whether the server's tokenizer gives ``ids`` for PROBE_TEXT (vLLM's and SGLang's ``POST /tokenize``):
    prompts travel as ids, so a server running another model would answer nonsense without an error.
    A TargetError when they differ; a note (the check was not possible) when the server has no /tokenize."""
    conn, prefix = _connection(target, timeout_s)
    body = json.dumps({"model": model, "prompt": PROBE_TEXT, "add_special_tokens": False}).encode()
    try:
        conn.request("POST", prefix + "/tokenize", body=body, headers={"Content-Type": "application/json",
                                                                        **dict(target.headers)})
        resp = conn.getresponse()
        raw = resp.read(1 << 20)
        theirs = json.loads(raw).get("tokens") if resp.status == 200 else None
    except (http.client.HTTPException, OSError, ValueError, AttributeError):
        theirs = None
    finally:
        conn.close()
    if not isinstance(theirs, list):
        return "the server has no /tokenize: that it runs the same model as kvviz's tokenizer was not checked"
    if [int(t) for t in theirs if isinstance(t, int)] != list(ids):
        raise TargetError(f"the server's {model!r} tokenizes {PROBE_TEXT!r} as {theirs[:12]}, kvviz's model as "
                          f"{list(ids)[:12]}: it serves another model (prompts are sent as token ids)")
    return None


def body_of(r: TargetRequest, model: str) -> dict[str, Any]:
    """The JSON of one request's POST /v1/completions."""
    body: dict[str, Any] = {"model": model, "prompt": list(r.prompt_ids), "max_tokens": r.max_tokens,
                            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                            "ignore_eos": bool(r.ignore_eos), "return_token_ids": True}
    body.update({k: v for k, v in r.sampling.items() if k in SAMPLING_FIELDS})
    return body


def _connection(target: Target, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(target.base)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname or "", parts.port, timeout=timeout_s), parts.path


def _http_error(status: int, reason: str, raw: bytes) -> str:
    """The server's own words for a refused request (vLLM/SGLang: {"error": {"message"}} or {"message"})."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        text = str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except ValueError:
        pass
    return f"HTTP {status} {reason}: {' '.join(text.split())[:300]}"


def stream_one(target: Target, r: TargetRequest, model: str, clock: Callable[[], float],
               timeout_s: float = REQUEST_TIMEOUT_S) -> StreamTrace:
    """Send one request and read its stream to the end; a TargetError (naming the request) on any failure."""
    payload = json.dumps(body_of(r, model)).encode()
    conn, prefix = _connection(target, timeout_s)
    trace = StreamTrace(r.id, clock(), max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
    url = target.url("/v1/completions")
    try:
        conn.request("POST", prefix + "/v1/completions", body=payload,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream", **dict(target.headers)})
        resp = conn.getresponse()
        if resp.status != 200:
            raise TargetError(f"request {r.id}: {url}: {_http_error(resp.status, resp.reason, resp.read(65536))}")
        kind = resp.getheader("Content-Type", "") or ""
        if "text/event-stream" not in kind:
            raise TargetError(f"request {r.id}: {url} answered {kind or 'no Content-Type'}, not an event stream: "
                              "this server does not stream completions (stream: true)")
        _read_events(resp, trace, clock, r.id)
    except TargetError:
        raise
    except ConnectionRefusedError:
        raise TargetError(f"request {r.id}: {url}: connection refused (is the server running on that port?)") from None
    except (TimeoutError, socket.timeout):
        raise TargetError(f"request {r.id}: {url}: no answer within {timeout_s:g} s") from None
    except (http.client.HTTPException, OSError, ValueError) as e:
        raise TargetError(f"request {r.id}: {url}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
    if not trace.chunk_s:
        raise TargetError(f"request {r.id}: {url}: the stream ended with no output")
    return trace


def _read_events(resp: http.client.HTTPResponse, trace: StreamTrace, clock: Callable[[], float], rid: str) -> None:
    """Server-sent events: ``data: {json}`` lines until ``data: [DONE]`` (or the stream's end)."""
    while True:
        line = resp.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES:
            raise TargetError(f"request {rid}: a streamed line over {MAX_LINE_BYTES >> 20} MiB: not a completion stream")
        text = line.decode("utf-8", "replace").strip()
        if not text.startswith("data:"):
            continue  # blank separators, comments (": ping"), event names
        data = text[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise TargetError(f"request {rid}: a streamed event is not JSON: {data[:80]!r}") from None
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:  # vLLM streams a mid-run failure as an event
            err = chunk["error"]
            raise TargetError(f"request {rid}: the server failed mid-stream: "
                              f"{err.get('message', err) if isinstance(err, dict) else err}")
        _take_chunk(chunk, trace, clock())


def _take_chunk(chunk: dict[str, Any], trace: StreamTrace, now: float) -> None:
    choices = chunk.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        c = choices[0]
        text = c.get("text") if isinstance(c.get("text"), str) else ""
        ids = c.get("token_ids")
        ids = [int(i) for i in ids if isinstance(i, int)] if isinstance(ids, list) else None
        if text or ids:
            trace.chunk_s.append(now)
            trace.output_text += text
            if ids is not None:
                trace.output_ids = (trace.output_ids or []) + ids
        if isinstance(c.get("finish_reason"), str):
            trace.finish_reason = c["finish_reason"]
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            trace.completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            trace.prompt_tokens = usage["prompt_tokens"]


class _Poller:
    """Reads /metrics every ``poll_s`` on a thread until stopped: the peak running count and KV usage."""

    def __init__(self, target: Target, poll_s: float, timeout_s: float) -> None:
        self.target, self.poll_s, self.timeout_s = target, poll_s, timeout_s
        self.peak_running: float | None = None
        self.peak_usage: float | None = None
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.take()
            self._stop.wait(self.poll_s)

    def take(self) -> None:
        try:
            r = read_metrics(fetch_text(self.target, "/metrics", self.timeout_s))
        except ScrapeError:
            return  # a missed poll: the peak is over the polls that answered
        self.polls += 1
        if r.requests_running is not None:
            self.peak_running = max(self.peak_running or 0.0, r.requests_running)
        if r.kv_cache_usage is not None:
            self.peak_usage = max(self.peak_usage or 0.0, r.kv_cache_usage)

    def __enter__(self) -> "_Poller":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + self.poll_s + 1.0)
        self.take()  # the state at the end, whatever the thread's last poll saw


def _metrics(target: Target, timeout_s: float) -> tuple[Reading | None, dict[str, Any] | None]:
    """One /metrics reading and vLLM's iteration counter; (None, None) from a server without /metrics."""
    try:
        text = fetch_text(target, "/metrics", timeout_s)
        reading = read_metrics(text)
    except ScrapeError:
        return None, None
    steps = sum(v for _, v in parse_metrics(text).get("vllm:iteration_tokens_total_count", [])) \
        if reading.engine == "vllm" else None
    return reading, {"busy_steps": steps}


def _pair(before: Reading | None, after: Reading | None, name: str) -> tuple[float | None, float | None]:
    return (getattr(before, name) if before else None, getattr(after, name) if after else None)


def run_target(target: Target, requests: Sequence[TargetRequest], *, served: str | None = None,
               poll_s: float = 0.5, timeout_s: float = REQUEST_TIMEOUT_S, scrape_timeout_s: float = 10.0,
               probe_ids: Sequence[int] | None = None, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Run the workload against the server; the ``serve-bench --json`` object (``requests``, ``summary``,
    ``settings``, ``not_measured``, ``notes``). ``probe_ids``: kvviz's ids for PROBE_TEXT, checked against
    the server's tokenizer first. A failed request stops sending and raises its TargetError
    once the requests in flight have ended."""
    model = served_model(target, served, scrape_timeout_s)
    check_lengths(requests, model)
    probe_note = check_tokenizer(target, model.name, probe_ids, scrape_timeout_s) if probe_ids is not None else None
    before, before_x = _metrics(target, scrape_timeout_s)
    traces: dict[str, StreamTrace] = {}
    errors: list[TargetError] = []
    failed = threading.Event()

    def worker(r: TargetRequest) -> None:
        try:
            traces[r.id] = stream_one(target, r, model.name, clock, timeout_s)
        except TargetError as e:
            errors.append(e)
            failed.set()

    threads: list[threading.Thread] = []
    poller = _Poller(target, poll_s, scrape_timeout_s) if before is not None else None
    start = clock()
    with poller or contextlib.nullcontext():
        for r in sorted(requests, key=lambda x: x.arrival_s):
            if failed.wait(max(0.0, start + r.arrival_s - clock())):
                break  # the wait doubles as the arrival clock; a failure stops the sending
            t = threading.Thread(target=worker, args=(r,), daemon=True, name=f"kvviz-target-{r.id}")
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    after, after_x = _metrics(target, scrape_timeout_s)
    ordered = [traces[r.id] for r in requests]
    counts = ServerCounts(
        _pair(before, after, "prefix_cache_queries"), _pair(before, after, "prefix_cache_hits"),
        _pair(before, after, "preemptions"),
        ((before_x or {}).get("busy_steps"), (after_x or {}).get("busy_steps")),
        poller.peak_running if poller else None, poller.peak_usage if poller else None,
        after.kv_cache_usage if after and not after.requests_running else None,
        # vLLM's usage is 1 - free / (blocks - 1): the null block is never counted (v1/core/block_pool.py)
        (after.num_blocks - 1) if after and after.engine == "vllm" and after.num_blocks else None,
        poller.polls if poller else 0)
    notes = [f"request {t.id} ended at the end-of-text token after {t.output_len()} of {t.max_tokens} tokens "
             "although ignore_eos was sent: this server ignores it"
             for t in ordered if t.ignore_eos and t.finish_reason == "stop" and t.output_len() < t.max_tokens]
    if probe_note:
        notes.append(probe_note)
    if before is None:
        notes.append("the server has no /metrics: prefix hits, preemptions and peaks are null")
    if any(t.output_ids is None for t in ordered):
        notes.append("the server did not return token ids (vLLM's return_token_ids): output_ids is null")
    engine = (after or before).engine if (after or before) else None
    return {
        "requests": [request_row(t) for t in ordered],
        "summary": summarize(ordered, start, counts),
        "settings": {"target": target.base, "engine": engine, "served_model": model.name,
                     "max_model_len": model.max_model_len, "arrival": "seconds", "policy": "the server's own",
                     "block_size": after.block_size if after else None,
                     "num_blocks": after.num_blocks if after else None, "poll_s": poll_s,
                     "num_requests": len(requests)},
        "not_measured": dict(NOT_MEASURED),
        "notes": notes,
    }
