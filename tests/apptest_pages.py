"""What the AppTests of the generation pages share: the seeded random:tiny default model (fast,
nothing on disk), the Plotly titles a page drew, and "no exception, no error" with the reasons."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest


@pytest.fixture(autouse=True)
def tiny_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Imported into a test module, this applies to every test there: the app opens on random:tiny."""
    monkeypatch.setenv("KVVIZ_DEFAULT_MODEL", "random:tiny")
    monkeypatch.setenv("KVVIZ_MODELS_DIR", str(tmp_path))


def titles(at: AppTest) -> list[str]:
    return [json.loads(el.proto.spec)["layout"]["title"]["text"] for el in at.get("plotly_chart")]


def ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
