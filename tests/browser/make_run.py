"""The app as a user gets it: started the way `make run` starts it, with no tuning in the environment.

`make run` is `.venv/bin/python -m streamlit run app.py --server.port $(PORT)` in the repository
root, with the user's own environment. A user has no OMP_NUM_THREADS, no KVVIZ_* variables and
no Streamlit overrides, so those are removed here (pytest itself may run with OMP_NUM_THREADS=1),
and nothing is passed on the command line but the port: the file watcher, the thread count and
the model are whatever the app and `.streamlit/config.toml` choose.

``KVVIZ_MAKE_RUN_SETTINGS=before`` (a knob of these tests, never passed to the app) starts it with the
settings `make run` had before b5e1676 instead: Streamlit's file watcher on (``--server.fileWatcherType
auto``, its default before config.toml turned it off) and torch's own intra-op thread count (one
per physical core, what the app ran with before it chose its own; given as ``KVVIZ_THREADS``, so the
sidebar's machine line names it). The code is today's: for the code of then as well, run the test in
a checkout of 281ee22 (docs/benchmarks.md says how).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120
# Variables a user of `make run` does not have; the app must do well without them.
TUNING_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "KVVIZ_", "STREAMLIT_", "GOMP_", "KMP_")
SETTINGS_ENV = "KVVIZ_MAKE_RUN_SETTINGS"  # "now" (default) or "before"


def settings() -> str:
    """Which `make run` settings the server gets: "now" or "before" (b5e1676)."""
    value = os.environ.get(SETTINGS_ENV, "now").strip().lower() or "now"
    if value not in ("now", "before"):
        raise ValueError(f"{SETTINGS_ENV}={value!r}: use 'now' or 'before'")
    return value


def torch_default_threads() -> int:
    """torch's own intra-op thread count in a fresh process with the user's environment."""
    out = subprocess.run([venv_python(), "-c", "import torch; print(torch.get_num_threads())"], cwd=ROOT,
                         env=user_env(), capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.strip())


def user_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(TUNING_PREFIXES)}


def venv_python() -> str:
    """`make run`'s interpreter: the repository's .venv, or this one where there is none."""
    py = ROOT / ".venv" / "bin" / "python"
    return str(py) if py.exists() else sys.executable


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def make_run_server(port: int, log: Path) -> Iterator[str]:
    """`make run PORT=<port>`, as a context: yields the URL once the server is healthy."""
    url = f"http://127.0.0.1:{port}"
    cmd = [venv_python(), "-m", "streamlit", "run", "app.py", "--server.port", str(port)]
    env = user_env()
    if settings() == "before":
        cmd += ["--server.fileWatcherType", "auto"]
        env["KVVIZ_THREADS"] = str(torch_default_threads())
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"streamlit was not healthy after {STARTUP_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)  # polling interval of a condition wait
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
