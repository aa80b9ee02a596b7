"""`make run` on a fresh clone says what it installs while it installs, and stays idempotent.

Issue 36: the first `make run` took 175 s to the first page (a .venv and about 1.8 GB of installs)
with nothing on screen but `pip -q`. Read with `make -n` (print, never run) in a copy of the
Makefile and the requirements files, so nothing is created or installed.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = ("Makefile", "requirements.txt", "requirements-dev.txt", "requirements-models.txt", "pyproject.toml")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def _dry_run(where: Path, target: str) -> list[str]:
    out = subprocess.run(["make", "-n", target, "PYTHON=python3"], cwd=where, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.splitlines()


@pytest.fixture()
def clone(tmp_path: Path) -> Path:
    for name in FILES:
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("target", ["run", "test-fast"])
def test_a_first_start_says_what_it_installs(clone: Path, target: str) -> None:
    lines = _dry_run(clone, target)
    steps = [i for i, line in enumerate(lines) if line.lstrip().startswith("echo \"==> [")]
    assert len(steps) == 3, lines
    assert "few minutes" in lines[steps[0]] and "1.8 GB" in lines[steps[0]]
    # Each step's line comes before its command, and the big installs show pip's own progress.
    venv = next(i for i, line in enumerate(lines) if " -m venv " in line)
    installs = [i for i, line in enumerate(lines) if " -m pip install " in line and "--upgrade pip" not in line]
    assert steps[0] < venv < steps[1] < installs[0] < steps[2] < installs[1], lines
    for i in installs:
        assert " -q" not in lines[i] and "--progress-bar on" in lines[i], lines[i]


def test_a_second_start_installs_nothing(clone: Path) -> None:
    """Idempotent: with the environment in place and its stamps newer than the requirements, `make
    run` only starts the app."""
    venv = clone / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".run-installed").write_text("")
    lines = _dry_run(clone, "run")
    assert not any("pip install" in line or "==>" in line for line in lines), lines
    assert any("streamlit run app.py" in line for line in lines), lines
