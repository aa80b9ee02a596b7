"""`python -m build` makes an sdist and a wheel; the wheel holds every file the app needs (the
package, the C sources, the shipped model and data, the app script and its Streamlit settings,
the model pins), nothing else (no tests, venvs, caches, compiled kernels), and declares the
requirements' pins and the `kvviz` console script."""
from __future__ import annotations

import re
import tarfile
import zipfile
from pathlib import Path

import pytest

from wheel_build import ROOT, tracked_files

import kvviz

pytestmark = pytest.mark.process  # builds the package in a process (10-30 s)

# The files the wheel renames into the package (pyproject.toml's force-include and sources).
MOVED = {"app.py": "kvviz/_app/app.py", ".streamlit/config.toml": "kvviz/_app/config.toml",
         "requirements-models.txt": "kvviz/requirements-models.txt"}
FORBIDDEN = re.compile(r"(^|/)(tests?|\.venv|venv|__pycache__|\.pytest_cache|\.hypothesis|train_state|"
                       r"test-results|node_modules)(/|$)|\.(pyc|so|o)$")


def _pins(path: Path) -> list[str]:
    return sorted(line.split("#")[0].strip() for line in path.read_text().splitlines()
                  if line.split("#")[0].strip() and not line.startswith("-r"))


def test_wheel_holds_every_needed_file_and_nothing_else(dists: tuple[Path, Path]) -> None:
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        expected = {f for f in tracked_files("kvviz") if "__pycache__" not in f}
        expected |= {"kvviz/" + f for f in tracked_files("assets")}
        expected |= set(MOVED.values())
        missing = sorted(expected - names)
        assert not missing, f"files the app needs are missing from the wheel: {missing}"
        assert any(n.startswith("kvviz/fast/csrc/") and n.endswith(".c") for n in names)
        assert "kvviz/assets/models/shakespeare/model.safetensors" in names
        dist_info = f"kvviz-{kvviz.__version__}.dist-info/"
        stray = sorted(n for n in names - expected if not n.startswith(dist_info))
        assert not stray, f"files in the wheel that no tracked file accounts for: {stray}"
        assert not [n for n in names if FORBIDDEN.search(n)]
        for src, dst in MOVED.items():  # the very bytes of the checkout's copy
            assert z.read(dst) == (ROOT / src).read_bytes(), dst
        assert z.read("kvviz/assets/models/shakespeare/model.safetensors") == \
            (ROOT / "assets/models/shakespeare/model.safetensors").read_bytes()
        meta = z.read(dist_info + "METADATA").decode()
        entry = z.read(dist_info + "entry_points.txt").decode()
    assert re.search(r"^\[console_scripts\]\s*\nkvviz = kvviz\.cli\.main:main$", entry, re.M)
    assert f"Version: {kvviz.__version__}" in meta
    required = sorted(m.group(1) for m in re.finditer(r"^Requires-Dist: ([^;\n]+)$", meta, re.M))
    assert required == _pins(ROOT / "requirements.txt")  # the runtime pins, no extra's among them
    assert "Provides-Extra: dev" in meta and "Provides-Extra: reference" in meta


def test_sdist_builds_the_same_package(dists: tuple[Path, Path]) -> None:
    sdist, _ = dists
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for f in ["pyproject.toml", "app.py", ".streamlit/config.toml", "requirements-models.txt",
              "assets/models/shakespeare/model.safetensors", "kvviz/fast/csrc/rowops.c", "kvviz/cli/main.py"]:
        assert f in names, f
    assert not [n for n in names if FORBIDDEN.search(n)]
