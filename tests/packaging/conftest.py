"""One sdist and wheel per session for every packaging test (a build takes 10-30 s)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wheel_build import build_dists  # noqa: E402


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_dists(tmp_path_factory.mktemp("dist"))
