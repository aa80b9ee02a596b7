"""docs/ARCHITECTURE.md stays a true map: every module it names exists, and every module in the
tree is named there.

The "Every module, one line" section lists modules under package headings (a line that starts
with a backticked folder, such as `kvviz/engine/`: ...); a bullet's backticked `name.py` is read
relative to the heading above it, and `kvviz/...` or `app.py` from the repository root.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"

HEADING = re.compile(r"^`((?:kvviz/)[\w/]*/)`")
PACKAGES = {"engine", "fast", "measure", "calculator", "charts", "ui", "cli"}
MODULE = re.compile(r"`([\w/]+\.py)`")


def _section(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Every module"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    return lines[start + 1:end]


def named_modules(text: str) -> set[str]:
    """Repository-relative paths of the modules the section names."""
    named: set[str] = set()
    package = ""
    for line in _section(text):
        heading = HEADING.match(line)
        if heading:
            package = heading.group(1)
            continue
        if line.strip() == "Top level":
            package = ""
        for name in MODULE.findall(line):
            if name.startswith("kvviz/") or name == "app.py":
                named.add(name)
            elif name.split("/")[0] in PACKAGES:  # `engine/models/attention.py` named from another package
                named.add("kvviz/" + name)
            else:
                named.add(package + name)
    return named


def _is_marker(path: Path) -> bool:
    """A folder marker: an __init__.py that holds a docstring at most (the floors test's rule)."""
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def tree_modules() -> set[str]:
    found = {"app.py"}
    for path in (ROOT / "kvviz").rglob("*.py"):
        if "__pycache__" not in path.parts and not _is_marker(path):
            found.add(path.relative_to(ROOT).as_posix())
    return found


def test_every_module_the_doc_names_exists() -> None:
    missing = sorted(p for p in named_modules(DOC.read_text()) if not (ROOT / p).is_file())
    assert not missing, f"docs/ARCHITECTURE.md names modules that do not exist: {missing}"


def test_every_module_in_the_tree_is_named_in_the_doc() -> None:
    unnamed = sorted(tree_modules() - named_modules(DOC.read_text()))
    assert not unnamed, f"modules missing from docs/ARCHITECTURE.md's 'Every module' section: {unnamed}"


def test_the_reader_resolves_headings_and_roots() -> None:
    """The checker is not vacuous: a bullet resolves against its heading, and an unnamed module shows."""
    text = ("## Every module, one line\n\nTop level\n- `app.py`: x\n- `kvviz/cli/main.py`: y\n\n"
            "`kvviz/engine/kvcache/`: z\n- `dense.py` + `paged_cache.py`: w\n- `engine/models/gpt2.py`: v, beside\n"
            "  `fast/llama_flat.py`\n\n## Data flow\n")
    assert named_modules(text) == {"app.py", "kvviz/cli/main.py", "kvviz/engine/kvcache/dense.py",
                                   "kvviz/engine/kvcache/paged_cache.py", "kvviz/engine/models/gpt2.py",
                                   "kvviz/fast/llama_flat.py"}
    assert "kvviz/engine/loading/loader.py" in tree_modules() - named_modules(text)
