"""Issue 18 in the browser: concurrent sessions, a dropped WebSocket, and nothing fetched off-machine.

- A short real load test (3 sessions) runs in the suite; ``KVVIZ_LOAD_TEST=1`` adds the issue's
  10 sessions x 500 tokens (minutes on 2 cores; figures in docs/load-test.md). Both start the app
  the way ``make run`` does (loadgen.app_server), on 127.0.0.1 only, bounded in sessions and time.
- A run whose WebSocket drops mid-run resumes after the reconnect and ends "reached
  max_new_tokens", never "stopped by the user".
- The app fetches nothing from any host but the app server (no font CDN, no favicon CDN).
"""
from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from tests.browser.loadgen import CHROMIUM, app_server, run_load

LOCAL_HOSTS = {"127.0.0.1", "localhost"}

# Records every WebSocket the page opens, so a test can drop the live one as a network fault would.
CAPTURE_SOCKETS = """
(() => {
  const Native = window.WebSocket;
  window.__kvvizSockets = [];
  window.WebSocket = function (...args) {
    const ws = new Native(...args);
    window.__kvvizSockets.push(ws);
    return ws;
  };
  window.WebSocket.prototype = Native.prototype;
  Object.assign(window.WebSocket, {CONNECTING: 0, OPEN: 1, CLOSING: 2, CLOSED: 3});
})();
"""


@pytest.fixture(scope="module")
def make_run_url(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium (`make browser`) to run the browser tests")
    # random:tiny, preselected as a user would pick it: the figures in docs/load-test.md use it, and
    # the default (SmolLM2, 30 layers) makes the test about CPU time instead of connections.
    with app_server(tmp_path_factory.mktemp("load") / "server.log", env={"KVVIZ_DEFAULT_MODEL": "random:tiny"}) \
            as (url, _pid):
        yield url


def _load(url: str, **kw: Any) -> dict[str, Any]:
    """run_load in a thread of its own: the suite's shared browser fixture keeps Playwright's sync
    API (an asyncio loop) open on the main thread, and a second sync session may not nest in it."""
    out: dict[str, Any] = {}
    failed: list[BaseException] = []

    def work() -> None:
        try:
            out.update(run_load(url, **kw))
        except Exception as e:  # handed to the test's thread, which re-raises it
            failed.append(e)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(timeout=kw["deadline_s"] + 120)
    if failed:
        raise failed[0]
    assert out, "the load generator did not finish in time"
    return out


def _assert_no_drop(out: dict) -> None:  # type: ignore[type-arg]
    # One line per session, as a string: pytest shortens a list's repr in its report, and the
    # tail (what an unfinished session's page showed) is the part a CI failure needs.
    fields = ("index", "tokens", "reason", "sockets_opened", "closed_at_s", "notices", "prompt_at_click", "reclicked",
              "unfinished")
    detail = "\n".join(repr(tuple(r[f] for f in fields)) for r in out["results"])
    assert out["completed_full"] == out["sessions"], detail
    assert out["sessions_that_reconnected"] == 0 and out["stopped_by_the_user"] == 0, detail


def test_three_sessions_generate_at_once_without_a_drop(make_run_url: str) -> None:
    _assert_no_drop(_load(make_run_url, sessions=3, tokens=150, deadline_s=120))


@pytest.mark.skipif(os.environ.get("KVVIZ_LOAD_TEST") != "1",
                    reason="the issue's 10 x 500 load test takes minutes: set KVVIZ_LOAD_TEST=1")
def test_ten_sessions_of_500_tokens_without_a_drop(make_run_url: str) -> None:
    _assert_no_drop(_load(make_run_url, sessions=10, tokens=500, deadline_s=600))


def test_a_run_survives_its_websocket_dropping(page, app_url: str, wait_idle) -> None:  # type: ignore[no-untyped-def]
    page.add_init_script(CAPTURE_SOCKETS)
    page.goto(app_url)
    page.wait_for_selector(".st-key-generate button")
    box = page.locator(".st-key-max_new_tokens input")
    box.fill("60")
    box.press("Enter")
    page.get_by_text(re.compile(r"\+ 60 new = ")).wait_for()
    page.locator(".st-key-present label").click()  # 3 tokens/s: 20 s, so the drop lands mid-run
    page.wait_for_selector(".st-key-speed_tps input[type='range']:not([disabled])")
    # The slider is enabled before the toggle's rerun ends; a click during that rerun lands on a
    # button being redrawn and starts nothing (it failed once in a full clean-clone run).
    wait_idle(page)
    page.locator(".st-key-generate button:visible").click()
    page.get_by_text(re.compile(r"generated\s+[4-9] of 60")).wait_for()
    assert page.evaluate("window.__kvvizSockets.length") == 1
    page.evaluate("window.__kvvizSockets.at(-1).close()")  # the server sees the connection go
    page.wait_for_function("window.__kvvizSockets.length >= 2")  # Streamlit reconnects
    marker = page.wait_for_selector(".st-key-run_done_1", timeout=90_000)
    text = marker.inner_text()
    assert "Run #1 finished: 60 tokens, reached max_new_tokens." in text, text
    alerts = " ".join(page.locator("[data-testid='stAlert']").all_inner_texts())
    assert "Stopped" not in alerts and "stopped" not in alerts, alerts


def test_nothing_is_fetched_from_another_host(page, app_url: str, wait_idle) -> None:  # type: ignore[no-untyped-def]
    requests: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(app_url)
    page.wait_for_selector(".st-key-generate button")
    box = page.locator(".st-key-max_new_tokens input")
    box.fill("8")
    box.press("Enter")
    # Let the count's rerun land first, as a user sees it: this test is about hosts, not about a
    # click racing a rerun (in one of 8 local runs of the browser suite, a click sent straight
    # after Enter never produced a run within 60 s).
    page.get_by_text(re.compile(r"\+ 8 new = ")).wait_for()
    wait_idle(page)
    page.locator(".st-key-generate button:visible").click()
    page.wait_for_selector(".st-key-run_done_1")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length > 0")
    icon = page.evaluate("document.querySelector('link[rel~=icon]')?.href || ''")
    assert icon.startswith(("data:", "http://127.0.0.1", "blob:")), icon
    remote = sorted({u for u in requests + [icon] if urlparse(u).scheme in ("http", "https", "ws", "wss")
                     and urlparse(u).hostname not in LOCAL_HOSTS})
    assert not remote, remote
    assert not [e for e in errors if "font" in e.lower() or "ERR_NAME_NOT_RESOLVED" in e], errors
