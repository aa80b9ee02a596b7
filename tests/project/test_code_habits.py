"""Two habits docs/ARCHITECTURE.md states, held by a test so they stay true: no module past 450
lines, and no function taking a dozen positional arguments (every one, the public API's included)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 450
MAX_POSITIONAL = 11


def _modules() -> list[Path]:
    return sorted([*ROOT.joinpath("kvviz").rglob("*.py"), ROOT / "app.py"])


def test_no_module_is_past_450_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (ARCHITECTURE.md, rules we keep): {long}"


def test_no_function_takes_a_dozen_positional_arguments() -> None:
    found = []
    for p in _modules():
        rel = str(p.relative_to(ROOT))
        for f in ast.walk(ast.parse(p.read_text())):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = f.args
                n = len(a.posonlyargs) + len(a.args) - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)
                if n > MAX_POSITIONAL:
                    found.append(f"{rel}:{f.lineno} {f.name} ({n})")
    assert not found, f"make their long tails keyword-only (after a *): {found}"
