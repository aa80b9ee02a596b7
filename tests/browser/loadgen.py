"""A bounded load test: N browser sessions generate at once against one local app server.

Each session is its own Chromium context (its own Streamlit session), sets ``max_new_tokens`` and
presses Generate; all presses land within a second. The run ends when every session shows its
done marker (``.st-key-run_done_1``) or at the deadline. Per session it records how the run ended
(tokens, reason, the page's own sentence), and every WebSocket the page opened and saw close: a
second socket is a reconnect. The server's CPU time and peak RSS come from /proc via psutil.

Only 127.0.0.1 is contacted, the number of sessions and tokens is capped, and everything stops at
the deadline. ``python tests/browser/loadgen.py --sessions 10 --tokens 500`` starts the server the
way ``make run`` does (bound to 127.0.0.1) and prints one JSON object; ``tests/browser/test_load.py``
runs a short version in the suite.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
MAX_SESSIONS = 16  # a load test on a shared 2-core box, not a stress test
MAX_TOKENS = 1000
DONE = re.compile(r"Run #1 finished: (\d+) tokens, ([^.]+)\.")


@dataclass
class SessionResult:
    index: int
    tokens: int | None = None  # None: no done marker before the deadline
    reason: str = ""  # the page's words: "reached max_new_tokens", "stopped by the user", ...
    seconds: float | None = None  # Generate press to done marker
    sockets_opened: int = 0  # 1 = never reconnected
    sockets_closed: int = 0
    closed_at_s: list[float] = field(default_factory=list)  # seconds after the Generate presses
    notices: list[str] = field(default_factory=list)  # st.info / st.error texts after the run
    unfinished: str = ""  # a session with no done marker: its script state and what its page showed
    reclicked: bool = False  # its first Generate click started nothing (idle, no run): clicked once more
    console_errors: list[str] = field(default_factory=list)
    # The prompt box as the browser held it just before the Generate press (its first 40 characters):
    # once, a session answered "the prompt is empty" with its default prompt untouched; this says
    # next time whether the browser's box was empty or the server lost the value.
    prompt_at_click: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def app_server(log: Path, env: dict[str, str] | None = None, startup_s: float = 90.0,
               launcher: Path | None = None) -> Iterator[tuple[str, int]]:
    """``python -m streamlit run app.py --server.port P``, as ``make run`` runs it, on 127.0.0.1 only.

    Yields (url, pid). The environment is the caller's (no test-only model or settings).
    ``launcher``: a script run instead of ``-m streamlit run app.py`` with the same options (a
    diagnosis build that logs inside Streamlit's websocket code, say).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        start = [str(launcher)] if launcher else ["-m", "streamlit", "run", "app.py"]
        proc = subprocess.Popen([sys.executable, *start, "--server.port", str(port), "--server.address", "127.0.0.1"],
                                cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_s
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"streamlit did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)  # polling a condition
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ProcessMeter:
    """Peak RSS and CPU seconds of a process (and its children), sampled every 0.25 s."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._proc = psutil.Process(pid)
        self.peak_rss = 0
        self._cpu0 = self._cpu()
        self.cpu_seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _cpu(self) -> float:
        t = self._proc.cpu_times()
        return t.user + t.system

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.25):
            try:
                self.peak_rss = max(self.peak_rss, self._proc.memory_info().rss)
            except psutil.Error:
                return

    def __enter__(self) -> "ProcessMeter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu_seconds = self._cpu() - self._cpu0


RECLICK_AFTER_S = 15.0  # a run that started is 'running' or done by then; idle means the click was lost
IDLE_JS = "document.querySelector('[data-testid=stApp]')?.dataset.testScriptState === 'notRunning'"


def _prepare(page: Any, url: str, tokens: int) -> None:
    page.goto(url)
    page.wait_for_selector(".st-key-generate button")
    box = page.locator(".st-key-max_new_tokens input")
    box.fill(str(tokens))
    box.press("Enter")
    page.get_by_text(re.compile(rf"\+ {tokens:,} new = ")).wait_for()
    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']")


def run_load(url: str, sessions: int, tokens: int, deadline_s: float) -> dict[str, Any]:
    """Drive ``sessions`` browser sessions generating ``tokens`` tokens each; a JSON-ready summary."""
    from playwright.sync_api import sync_playwright

    if not (1 <= sessions <= MAX_SESSIONS and 1 <= tokens <= MAX_TOKENS):
        raise ValueError(f"at most {MAX_SESSIONS} sessions and {MAX_TOKENS} tokens")
    results = [SessionResult(i) for i in range(sessions)]
    t0 = time.monotonic()  # reset at the Generate presses

    def closed(r: SessionResult) -> None:
        r.sockets_closed += 1
        r.closed_at_s.append(round(time.monotonic() - t0, 1))

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            pages = []
            for r in results:
                ctx = browser.new_context(viewport={"width": 1400, "height": 900})
                page = ctx.new_page()
                page.set_default_timeout(120_000)

                def on_socket(ws: Any, r: SessionResult = r) -> None:
                    r.sockets_opened += 1
                    ws.on("close", lambda _ws, r=r: closed(r))

                page.on("websocket", on_socket)
                page.on("console", lambda m, r=r: r.console_errors.append(m.text[:200]) if m.type == "error" else None)
                _prepare(page, url, tokens)
                pages.append(page)
            for r, page in zip(results, pages):
                r.prompt_at_click = page.locator(".st-key-prompt textarea").input_value()[:40]
            t0 = time.monotonic()
            for page in pages:
                page.locator(".st-key-generate button:visible").click()
            deadline = t0 + deadline_s
            pending = set(range(sessions))
            while pending and time.monotonic() < deadline:
                for i in sorted(pending):
                    marker = pages[i].locator(".st-key-run_done_1")
                    if marker.count():
                        m = DONE.search(marker.inner_text())
                        if m:
                            results[i].tokens, results[i].reason = int(m.group(1)), m.group(2)
                            results[i].seconds = round(time.monotonic() - t0, 1)
                            pending.discard(i)
                    elif (not results[i].reclicked and time.monotonic() - t0 > RECLICK_AFTER_S
                          and pages[i].evaluate(IDLE_JS)):
                        # Idle with no run at all: the click landed while the button was being redrawn
                        # and started nothing (a lost click, not a dropped session). Press it once more.
                        results[i].reclicked = True
                        pages[i].locator(".st-key-generate button:visible").click()
                pages[0].wait_for_timeout(500)  # polling the markers; also lets Playwright deliver events
            for i, page in enumerate(pages):
                for kind in ("stAlert",):
                    texts = page.locator(f"[data-testid='{kind}']").all_inner_texts()
                    results[i].notices = [t[:300] for t in texts]
                if i in pending:  # say why: never started, still running, or ended without its marker
                    state = page.evaluate("document.querySelector('[data-testid=stApp]')?.dataset.testScriptState")
                    shown = page.locator("[data-testid='stMain']").inner_text()[:600]
                    box = page.locator(".st-key-prompt textarea")  # absent: the sidebar never came
                    now = box.first.input_value()[:40] if box.count() else None
                    results[i].unfinished = f"script {state}; prompt box now {now!r}; page: {shown}"
            wall = time.monotonic() - t0
        finally:
            browser.close()
    done = [r for r in results if r.tokens is not None]
    full = [r for r in done if r.tokens == tokens]
    return {
        "sessions": sessions, "tokens": tokens, "deadline_s": deadline_s, "wall_s": round(wall, 1),
        "completed_full": len(full), "ended_early": len(done) - len(full), "unfinished": sessions - len(done),
        "sessions_that_reconnected": sum(r.sockets_opened > 1 for r in results),
        "socket_closes": sum(r.sockets_closed for r in results),
        "stopped_by_the_user": sum("stopped by the user" in r.reason for r in results),
        "lost_clicks_pressed_again": sum(r.reclicked for r in results),
        "results": [asdict(r) for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds after the Generate presses")
    ap.add_argument("--log", type=Path, default=Path("/tmp/kvviz-load-server.log"))
    ap.add_argument("--launcher", type=Path, help="diagnosis: a script to run instead of `-m streamlit run app.py`")
    ap.add_argument("--model", help="the picker's preselected model ($KVVIZ_DEFAULT_MODEL), e.g. random:tiny, "
                                    "so runs on different commits use the same model")
    args = ap.parse_args(argv)
    env = {"KVVIZ_DEFAULT_MODEL": args.model} if args.model else {}
    with app_server(args.log, env=env, launcher=args.launcher) as (url, pid), ProcessMeter(pid) as meter:
        out = run_load(url, args.sessions, args.tokens, args.deadline)
    out["model"] = args.model or "the app's default"
    out["server_peak_rss_mib"] = round(meter.peak_rss / 2**20)
    out["server_cpu_s"] = round(meter.cpu_seconds, 1)
    out["server_log_tail"] = args.log.read_text(errors="replace")[-2000:]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
