"""How `make test` runs the suite stays whole: the tests without a browser on pytest-xdist, the
longest of them first (tests/conftest.py's LONGEST_FIRST), then the browser tests, collected from
tests/browser/ alone."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _longest_first() -> tuple[str, ...]:
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "LONGEST_FIRST" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("tests/conftest.py has no LONGEST_FIRST")


def test_each_longest_first_entry_names_a_test_that_exists() -> None:
    """A renamed test would otherwise quietly fall back to its place in the order."""
    entries = _longest_first()
    assert entries
    for entry in entries:
        path, _, name = entry.partition("::")
        assert (ROOT / path).is_file(), entry
        if name:
            tests = {f.name for f in ast.walk(ast.parse((ROOT / path).read_text()))
                     if isinstance(f, ast.FunctionDef) and f.name.startswith("test")}
            assert name in tests, entry


def test_no_browser_test_lives_outside_tests_browser() -> None:
    """The browser phase collects tests/browser/ alone and the other phase leaves out `browser`:
    a test marked `browser` by hand elsewhere would run in neither."""
    marked = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
              if ROOT / "tests" / "browser" not in p.parents and p.parent.name != "project"
              and re.search(r"@pytest\.mark\.browser\b|pytestmark\b.*mark\.browser\b", p.read_text())]
    assert not marked, marked
    assert re.search(r"pytest tests/browser .*-m \"browser and not bench", (ROOT / "Makefile").read_text())
