"""Build kvviz's sdist and wheel once per test session (tests/packaging/ shares them).

``python -m build`` as a user runs it: with hatchling importable here (requirements-dev.txt pins
it) the build runs in this environment (``--no-isolation``, offline); otherwise build makes its
own isolated environment and downloads hatchling from the package index.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_dists(out: Path) -> tuple[Path, Path]:
    """(sdist, wheel) built from the working tree into ``out``."""
    cmd = [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)]
    if importlib.util.find_spec("hatchling") is not None:
        cmd.insert(3, "--no-isolation")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"python -m build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    (sdist,) = out.glob("kvviz-*.tar.gz")
    (wheel,) = out.glob("kvviz-*-py3-none-any.whl")
    return sdist, wheel


def tracked_files(*folders: str) -> list[str]:
    """The files under these folders that git tracks or would (not ignored): what a checkout holds."""
    r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *folders], cwd=ROOT, capture_output=True, text=True, check=True)
    return [line for line in r.stdout.splitlines() if line]
