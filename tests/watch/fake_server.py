"""A loopback HTTP server that answers fixed bodies per path: a stand-in for vLLM, SGLang or
llama.cpp's server in the watch tests (bounded: it serves until the test's `with` block ends)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


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
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

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
