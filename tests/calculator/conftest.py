"""Fixtures shared by the calculator's tests."""
from __future__ import annotations

import pytest

from kvviz.calculator import load_presets


@pytest.fixture(scope="module")
def presets():  # type: ignore[no-untyped-def]
    """The shipped presets, loaded once per module (every test reads, none writes them)."""
    return load_presets()
