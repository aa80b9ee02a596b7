"""HTTP reads of a running server: bounded in time and size, every failure one sentence.

kvviz only ever reads (GET) a URL the user typed; it never follows a redirect to another host and
never sends a header it was not given. Each failure class (a malformed URL, a refused connection, a
timeout, an HTTP error such as 401, a body too large or not text) becomes a ``ScrapeError`` whose
message is the line the CLI and the page print.
"""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from kvviz.errors import KVVizError

MAX_BODY_BYTES = 16 * 1024 * 1024  # a vLLM /metrics with many LoRA labels is ~1 MB; 16 MB is no server
DEFAULT_TIMEOUT_S = 5.0


class ScrapeError(KVVizError):
    """A server could not be read; the message says why, in one line."""


@dataclass(frozen=True)
class Target:
    """A server's base URL (scheme, host, port, path prefix) and the headers to send it."""

    base: str  # "http://127.0.0.1:8000", no trailing slash
    headers: tuple[tuple[str, str], ...] = ()

    def url(self, path: str) -> str:
        return self.base + path


def parse_target(url: str, headers: list[str] | tuple[str, ...] = ()) -> Target:
    """A base URL from what the user typed: "localhost:8000", "http://h:8000/", "http://h:8000/metrics"
    (the endpoint's own path is dropped: kvviz reads several). Headers as "Name: value" lines."""
    text = (url or "").strip()
    if not text:
        raise ScrapeError("no server URL given: type one like http://127.0.0.1:8000")
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError as e:
        raise ScrapeError(f"{url!r} is not a URL ({e})") from None
    if parts.scheme not in ("http", "https"):
        raise ScrapeError(f"{url!r}: only http:// and https:// servers can be read (got {parts.scheme}://)")
    if not parts.hostname:
        raise ScrapeError(f"{url!r} names no host: type one like http://127.0.0.1:8000")
    path = parts.path.rstrip("/")
    for endpoint in ("/metrics", "/v1/models", "/v1", "/slots", "/health"):
        if path.endswith(endpoint):
            path = path[: -len(endpoint)]
            break
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = host + (f":{port}" if port else "")
    parsed: list[tuple[str, str]] = []
    for h in headers:
        name, sep, value = h.partition(":")
        if not sep or not name.strip() or any(c in name for c in " \r\n") or any(c in value for c in "\r\n"):
            raise ScrapeError(f"header {h!r} is not 'Name: value' on one line")
        parsed.append((name.strip(), value.strip()))
    return Target(f"{parts.scheme}://{netloc}{path}", tuple(parsed))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:  # a 3xx is reported, not followed
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def fetch_text(target: Target, path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """GET ``path`` on the server as text (UTF-8), or a ScrapeError saying why not."""
    url = target.url(path)
    req = urllib.request.Request(url, headers=dict(target.headers), method="GET")
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            body = resp.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as e:
        hint = {401: " (the server wants a key: pass --header 'Authorization: Bearer ...')",
                403: " (the key was refused)", 404: " (this server has no such endpoint)"}.get(e.code, "")
        if 300 <= e.code < 400:
            hint = f" (a redirect to {e.headers.get('Location', '?')!r}, not followed)"
        raise ScrapeError(f"{url}: HTTP {e.code} {e.reason}{hint}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise ScrapeError(f"{url}: no answer within {timeout_s:g} s") from None
        if isinstance(reason, ConnectionRefusedError):
            raise ScrapeError(f"{url}: connection refused (is the server running on that port?)") from None
        if isinstance(reason, socket.gaierror):
            raise ScrapeError(f"{url}: unknown host ({reason.strerror or reason})") from None
        raise ScrapeError(f"{url}: {reason}") from None
    except (TimeoutError, socket.timeout):
        raise ScrapeError(f"{url}: no answer within {timeout_s:g} s") from None
    except (ConnectionError, OSError, ValueError) as e:
        raise ScrapeError(f"{url}: {type(e).__name__}: {e}") from None
    if len(body) > MAX_BODY_BYTES:
        raise ScrapeError(f"{url}: the answer is over {MAX_BODY_BYTES // (1024 * 1024)} MiB; not a metrics page")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError(f"{url}: the answer is not UTF-8 text") from None


def fetch_json(target: Target, path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """GET ``path`` as JSON, or a ScrapeError."""
    text = fetch_text(target, path, timeout_s)
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ScrapeError(f"{target.url(path)}: the answer is not JSON") from None
