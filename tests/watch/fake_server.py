"""Loopback HTTP servers for the watch tests (bounded: each serves until the test's `with` block ends):
`serve` answers fixed bodies per path, a stand-in for vLLM, SGLang or llama.cpp's /metrics; `serve_completions`
streams completions deterministically, as an OpenAI-compatible server, for `serve-bench --target`."""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator


@contextmanager
def serve(routes: dict[str, tuple[int, bytes]], delay_s: float = 0.0, need_header: tuple[str, str] | None = None) -> Iterator[str]:
    """Serve ``routes`` ({path: (status, body)}) on 127.0.0.1; yields the base URL. ``need_header``:
    answer 401 unless the request carries it; ``delay_s``: wait before answering (timeouts)."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            seen.append(dict(self.headers))
            if delay_s:
                time.sleep(delay_s)
            if need_header and self.headers.get(need_header[0]) != need_header[1]:
                status, body = 401, b"unauthorized"
            else:
                status, body = routes.get(self.path, (404, b"not found"))
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a timeout test's client gave up during ``delay_s``, as it should: nothing to answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class HandClock:
    """A clock the fake completions server sets: the server sets a value before each event it streams
    and waits until the client has read it, so the client's timestamps are the script's, exactly
    (one request in flight; the client reads the clock once per event)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._read = threading.Event()
        self._read.set()

    def __call__(self) -> float:
        value = self.now
        self._read.set()
        return value

    def set(self, t: float) -> None:
        if not self._read.wait(30.0):  # a hang detector, not a bound
            raise RuntimeError("the client never read the clock")
        self._read.clear()
        self.now = t


def fake_token(prompt: list[int], k: int, vocab: int = 1000) -> int:
    """The fake model's k-th output token for a prompt: a fixed function, so tests know every id."""
    return (sum(prompt) + 7 * k) % vocab


@dataclass
class Completions:
    """What the fake completions server does (every field scripted)."""

    model: str = "fake/model"
    max_model_len: int = 256
    ttft_s: float = 0.0  # real seconds before the first event (the HandClock decides the measured times)
    times: list[float] | None = None  # HandClock values, one per streamed event, in order
    chunk_tokens: list[int] | None = None  # tokens per output event (default one each)
    stream: bool = True  # False: a plain JSON answer, as a server that does not stream
    token_ids: bool = True  # send vLLM's token_ids per chunk
    honour_ignore_eos: bool = True
    eos_after: int | None = None  # a request that does not ignore EOS ends after this many tokens
    status: int = 200
    error_body: bytes = b'{"error": {"message": "scripted failure", "type": "BadRequestError", "code": 400}}'
    hits: dict[int, int] = field(default_factory=dict)  # prompt length -> prefix-hit tokens at admission
    preemptions_per_request: int = 0
    hold_until_polled: int | None = None  # streams wait until /metrics was read with this many running
    metrics: bool = True
    block_size: int = 16
    num_blocks: int = 101
    usage_blocks_per_request: int = 2
    tokenize: bool = False  # answer POST /tokenize with fake_tokenize's ids


def fake_tokenize(text: str) -> list[int]:
    """The fake server's tokenizer: one id per character."""
    return [ord(c) % 1000 for c in text]


@contextmanager
def serve_completions(script: Completions, clock: HandClock | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """A stand-in OpenAI-compatible server: /v1/models, a streamed /v1/completions whose tokens are
    ``fake_token``'s, and a vLLM-style /metrics whose counters move as the script says. Yields the base
    URL and its state (the bodies it received, its counters)."""
    state: dict[str, Any] = {"bodies": [], "running": 0, "queries": 0, "hits": 0, "preemptions": 0,
                             "steps": 0, "polled_full": threading.Event()}
    lock = threading.Lock()

    def metrics_text() -> str:
        with lock:
            running = state["running"]
            if script.hold_until_polled is not None and running >= script.hold_until_polled:
                state["polled_full"].set()
            used = running * script.usage_blocks_per_request
            return "\n".join([
                "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="{script.model}"}} {running}',
                "# TYPE vllm:num_requests_waiting gauge", f'vllm:num_requests_waiting{{model_name="{script.model}"}} 0',
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f'vllm:kv_cache_usage_perc{{model_name="{script.model}"}} {used / (script.num_blocks - 1)}',
                "# TYPE vllm:prefix_cache_queries counter",
                f'vllm:prefix_cache_queries_total{{model_name="{script.model}"}} {state["queries"]}',
                "# TYPE vllm:prefix_cache_hits counter", f'vllm:prefix_cache_hits_total{{model_name="{script.model}"}} {state["hits"]}',
                "# TYPE vllm:num_preemptions counter",
                f'vllm:num_preemptions_total{{model_name="{script.model}"}} {state["preemptions"]}',
                "# TYPE vllm:iteration_tokens_total histogram",
                f'vllm:iteration_tokens_total_bucket{{le="+Inf",model_name="{script.model}"}} {state["steps"]}',
                f'vllm:iteration_tokens_total_count{{model_name="{script.model}"}} {state["steps"]}',
                f'vllm:iteration_tokens_total_sum{{model_name="{script.model}"}} {state["steps"]}',
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{block_size="{script.block_size}",num_gpu_blocks="{script.num_blocks}",'
                f'enable_prefix_caching="True"}} 1.0', ""])

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": script.model, "object": "model", "max_model_len": script.max_model_len}]}).encode())
            elif self.path == "/metrics" and script.metrics:
                self._send(200, metrics_text().encode(), "text/plain; version=0.0.4")
            else:
                self._send(404, b'{"detail": "Not Found"}')

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            if self.path == "/tokenize":
                if script.tokenize:
                    self._send(200, json.dumps({"tokens": fake_tokenize(body["prompt"]), "count": 1}).encode())
                else:
                    self._send(404, b'{"detail": "Not Found"}')
                return
            state["bodies"].append(body)
            if self.path != "/v1/completions" or script.status != 200:
                self._send(script.status if script.status != 200 else 404, script.error_body)
                return
            prompt, n = body["prompt"], body["max_tokens"]
            if script.eos_after is not None and (not body.get("ignore_eos") or not script.honour_ignore_eos):
                n = min(n, script.eos_after)
            finish = "length" if n == body["max_tokens"] else "stop"
            ids = [fake_token(prompt, k) for k in range(n)]
            if not script.stream:
                self._send(200, json.dumps({"choices": [{"text": "".join(f" t{i}" for i in ids)}]}).encode())
                return
            with lock:
                state["running"] += 1
                state["queries"] += len(prompt)
                state["hits"] += script.hits.get(len(prompt), 0)
                state["preemptions"] += script.preemptions_per_request
            try:
                self._stream(prompt, ids, finish, body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (the timeout test): a real server logs and moves on
            finally:
                with lock:
                    state["running"] -= 1
                    state["steps"] += n

        def _stream(self, prompt: list[int], ids: list[int], finish: str, body: dict[str, Any]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Connection", "close")
            self.end_headers()
            if script.hold_until_polled is not None:
                state["polled_full"].wait(30.0)  # a hang detector, not a bound
            if script.ttft_s:
                time.sleep(script.ttft_s)
            sizes = list(script.chunk_tokens or [1] * len(ids))
            times = iter(script.times or [])
            events, at = [], 0
            for j, size in enumerate(sizes):
                part = ids[at:at + size]
                at += size
                choice: dict[str, Any] = {"index": 0, "text": "".join(f" t{i}" for i in part),
                                          "finish_reason": finish if j == len(sizes) - 1 else None}
                if script.token_ids and body.get("return_token_ids"):
                    choice["token_ids"] = part
                events.append({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
            events.append({"id": "cmpl-1", "object": "text_completion", "choices": [],
                           "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                     "total_tokens": len(prompt) + len(ids)}})
            for event in events:
                if clock is not None:
                    clock.set(next(times))
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
