"""`kvviz memory` run in-process, for the calculator's CLI tests: its one JSON object, or its exit-2
message (a bad input is one line on stderr, never a traceback)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from kvviz.cli.main import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["memory", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # exactly one object, nothing else


def run_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["memory", *argv])
    assert e.value.code == 2
    return capsys.readouterr().err
