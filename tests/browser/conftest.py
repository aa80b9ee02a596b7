"""Browser fixtures shared by every page's Playwright tests: ``app_url`` and ``page``.

``app_url`` starts ``streamlit run app.py`` once per session on a free port, with the untrained
``random:tiny`` model as the default so the tests never depend on the shipped checkpoint, and
waits for ``/_stcore/health``. ``page`` is a fresh 1400×900 Chromium page (a new Streamlit
session) per test that fails the test on any JavaScript dialog. Tests wait on conditions (the
app's own markers, ``.st-key-<key>`` elements), never on fixed sleeps.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1400, "height": 900}
# Screenshots land in an ignored folder, so a test run never dirties the committed README images;
# `make screenshots` points both knobs at docs/screenshots and the shipped model to refresh them.
SCREENSHOTS = ROOT / os.environ.get("KVVIZ_SCREENSHOTS", "test-results/screenshots")
APP_MODEL = os.environ.get("KVVIZ_BROWSER_MODEL", "random:tiny")
STARTUP_TIMEOUT_S = 90

try:
    from playwright import sync_api
except ImportError:  # reported by _require_browser as a skip, not a collection error
    sync_api = None  # type: ignore[assignment]


def _require_browser() -> None:
    """Skip (never fail) where the browser tests cannot run. A module-level skip in a conftest
    would abort the whole pytest session instead."""
    if not CHROMIUM.exists():
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium (`make browser`) to run the browser tests")
    if sync_api is None:
        pytest.skip("the playwright package is not installed (requirements-dev.txt)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="session")
def app_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _require_browser()  # no server for tests that will skip anyway
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("streamlit") / "server.log"
    env = {**os.environ, "KVVIZ_DEFAULT_MODEL": APP_MODEL, "OMP_NUM_THREADS": "1",
           "KVVIZ_MODELS_DIR": str(tmp_path_factory.mktemp("models"))}  # no stray folders in the list
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
             "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
             # Other work may edit files under the repo while tests run: never rerun on a file change.
             "--server.fileWatcherType", "none", "--server.runOnSave", "false"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None:
                pytest.fail(f"streamlit exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"streamlit was not healthy after {STARTUP_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)  # polling interval of a condition wait, not a fixed sleep
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def make_run_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The app started exactly as `make run` starts it (see make_run.py), on a free port."""
    _require_browser()
    from make_run import make_run_server  # this folder is on sys.path (pytest's rootdir conftest mode)

    with make_run_server(_free_port(), tmp_path_factory.mktemp("make_run") / "server.log") as url:
        yield url


@pytest.fixture(scope="session")
def screen_walk(browser: "sync_api.Browser", make_run_url: str):  # type: ignore[no-untyped-def]
    """``screen_walk(size, present)``: the walk of every page at that screen (screen_walks.py), taken
    on first use and kept for the session, so test_cut_labels and test_layout_fit load and run each
    page once per screen between them. A walk that failed fails every test that asks for it again,
    without walking again."""
    from screen_walks import TIGHT, walk_screen  # this folder is on sys.path (pytest's rootdir conftest mode)

    walks: dict[tuple[tuple[int, int], bool], object] = {}

    def get(size: tuple[int, int], present: bool):  # type: ignore[no-untyped-def]
        key = (tuple(size), present if tuple(size) == TIGHT else True)
        if key not in walks:
            try:
                walks[key] = walk_screen(browser, make_run_url, key[0], key[1])
            except Exception as e:  # noqa: BLE001 - kept, and raised to every test that uses this walk
                walks[key] = e
        got = walks[key]
        if isinstance(got, Exception):
            raise got
        return got

    return get


@pytest.fixture(scope="session")
def browser() -> Iterator["sync_api.Browser"]:
    _require_browser()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:  # type: ignore[type-arg]
    """Keep each phase's report on the test item, so ``page`` can tell whether its test failed."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def _failure_record(pg: "sync_api.Page", name: str) -> str:
    """What a failed browser test's page showed: its alerts and script state (in the report), and
    a screenshot under SCREENSHOTS/failures, so a flake on a loaded CI box says what happened."""
    try:
        alerts = pg.locator("[data-testid='stAlert']").all_inner_texts()
        state = pg.evaluate("document.querySelector('[data-testid=stApp]')?.dataset.testScriptState")
        box = pg.locator(".st-key-prompt textarea")
        prompt = box.first.input_value(timeout=2_000)[:40] if box.count() else None
        # The run's status line and every button's label: where a replay or a run stood.
        status = pg.locator("[class*='st-key-run_done_'], [class*='st-key-run_stepping_']").all_inner_texts()
        buttons = [b.strip() for b in pg.locator("button:visible").all_inner_texts() if b.strip()][:20]
        errors = pg.locator("[data-testid='stException']").all_inner_texts()
        folder = SCREENSHOTS / "failures"
        folder.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(folder / f"{name}.png"))
        return (f"page at failure: script {state}; alerts {[a[:300] for a in alerts]}; prompt box {prompt}; "
                f"status {[t[:200] for t in status]}; buttons {buttons}; exceptions {[e[:300] for e in errors]}")
    except Exception as e:  # the page may be gone; the test's own error is what matters
        return f"page at failure: not readable ({type(e).__name__}: {e})"


@pytest.fixture
def page(browser: "sync_api.Browser", app_url: str, request: pytest.FixtureRequest) -> Iterator["sync_api.Page"]:
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    dialogs: list[str] = []

    def on_dialog(d: "sync_api.Dialog") -> None:
        dialogs.append(d.message)
        d.dismiss()

    pg.on("dialog", on_dialog)
    try:
        yield pg
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            rep.sections.append(("browser", _failure_record(pg, request.node.name)))
    finally:
        context.close()
    assert not dialogs, f"the page opened a JavaScript dialog: {dialogs}"


def _wait_idle(page: "sync_api.Page", timeout_ms: int = 60_000) -> None:
    """Wait until the script run is over (Streamlit marks the app 'notRunning')."""
    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=timeout_ms)


@pytest.fixture
def wait_idle():  # type: ignore[no-untyped-def]
    """``wait_idle(page)``: block until the current script run has finished."""
    return _wait_idle


def _full_page_screenshot(page: "sync_api.Page", name: str) -> Path:
    """Streamlit scrolls inside its main container, so grow the viewport to the content, then shoot."""
    height = page.evaluate("""() => Math.max(...['stMain', 'stAppViewContainer', 'stMainBlockContainer']
        .map(t => document.querySelector(`[data-testid='${t}']`)).filter(e => e).map(e => e.scrollHeight))""")
    page.set_viewport_size({"width": VIEWPORT["width"], "height": int(height) + 24})
    page.wait_for_function("[...document.querySelectorAll('.js-plotly-plot')].every(p => p.querySelector('.main-svg'))")
    page.wait_for_timeout(500)  # one Plotly resize redraw after the viewport change (not a readiness wait)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(VIEWPORT)
    _shrink_png(path)
    return path


def _shrink_png(path: Path) -> None:
    """A 256-colour palette: a UI screenshot looks the same at a third of the bytes (README-friendly)."""
    try:
        from PIL import Image  # Pillow comes with Streamlit
    except ImportError:  # pragma: no cover - keep the full-colour file
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


@pytest.fixture
def screenshot():  # type: ignore[no-untyped-def]
    """``screenshot(page, "name.png")``: the whole page, saved under SCREENSHOTS."""
    return _full_page_screenshot
