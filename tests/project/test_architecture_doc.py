"""docs/ARCHITECTURE.md stays a true map: every module it names exists, every module in the
tree is named there, and every path it names anywhere (a module, a C file, a folder) exists.

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


# ----------------------------------------------------------------------------- every path the doc names
# A backticked token that looks like a path (a file with an extension, or a folder ending in /).
PATH_TOKEN = re.compile(r"`([\w.\-/]+(?:\.(?:py|md|json|toml|txt|c|h|gz|png|cfg|ini|sh|ipynb)|/))`")
# Named on purpose though not in the repository, each with why.
NOT_IN_REPO = {
    "kvviz/_app/": "where the wheel puts app.py and the config (tests/packaging/ checks the wheel)",
    "kvviz/assets/": "the wheel's copy of assets/",
    "kvviz/generate.py": "history: where the loop lived before the engine package",
    "bench-results/bench.json": "what `kvviz bench` writes",
    "models/": "the user's model folder (KVVIZ_MODELS_DIR), made on first use",
    "model.py": "nano-vllm's and nanoGPT's file, compared with kvviz's",
    "engine.py": "a file of another project, compared with kvviz's",
    "cache_utils.py": "transformers' cache module, compared with kvviz's",
    "config.json": "a model folder's file", "tokenizer.json": "a model folder's file",
    "spec.json": "what `kvviz bench-spec` writes",
}


def _repo_files() -> tuple[set[str], set[str]]:
    """(every file and folder path under the repository, relative, with folders ending in '/'; every file name)."""
    paths: set[str] = set()
    names: set[str] = set()
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in (".git", ".venv") or "__pycache__" in rel.parts:
            continue
        paths.add(rel.as_posix() + ("/" if p.is_dir() else ""))
        names.add(p.name)
    return paths, names


def missing_paths(text: str) -> list[str]:
    """Paths the doc names that exist nowhere they could mean: from the root, under kvviz/ or
    kvviz/engine/, under the section's package heading; a bare file name anywhere in the tree."""
    paths, names = _repo_files()
    missing: list[str] = []
    heading = ""
    for line in text.splitlines():
        found = HEADING.match(line)
        if found:
            heading = found.group(1)
        for token in PATH_TOKEN.findall(line):
            if token in NOT_IN_REPO:
                continue
            if "/" not in token.rstrip("/"):
                if token.rstrip("/") not in names:
                    missing.append(token)
                continue
            if not any(c in paths for c in (token, "kvviz/" + token, "kvviz/engine/" + token, heading + token)):
                missing.append(token)
    return missing


def test_every_path_the_doc_names_exists() -> None:
    """Issue 38: the prose drifted while only module names were checked; every path it names is held now."""
    assert missing_paths(DOC.read_text()) == []


def test_the_path_check_is_not_vacuous() -> None:
    text = ("`kvviz/engine/loaded.py` `engine/loading/loader.py` `kvviz/nowhere.py` `measure/bench_cli.py`\n"
            "`kvviz/fast/`: x\n- `csrc/blockdot.c`, `csrc/missing.c`, `no_such_module.py`, `model.py`\n")
    assert missing_paths(text) == ["kvviz/nowhere.py", "measure/bench_cli.py", "csrc/missing.c", "no_such_module.py"]


# ----------------------------------------------------------------------------- the floors' lists, word for word
def _bullet(text: str, start: str) -> str:
    """The bullet of the floors section that starts with ``start``, its continuation lines joined."""
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(start))
    out = [lines[i]]
    for line in lines[i + 1:]:
        if not line.startswith("  "):
            break
        out.append(line)
    return " ".join(out)


def dotted_names(bullet: str) -> set[str]:
    return set(re.findall(r"`(kvviz(?:\.\w+)*)`", bullet))


def test_the_no_torch_list_is_the_floors_tests() -> None:
    """The doc's "No torch" bullet names exactly the floors test's NO_TORCH (it once named 9 of 12)."""
    from test_floors import NO_TORCH

    assert dotted_names(_bullet(DOC.read_text(), "- **No torch** in")) == set(NO_TORCH)


def test_the_folder_markers_named_are_the_floors_tests() -> None:
    """Every folder marker of the floors test is named in the doc's bullet (sub-packages of
    kvviz.engine by their short names, the page folders together), and no other."""
    from test_floors import EMPTY_PACKAGES

    bullet = _bullet(DOC.read_text(), "- **Imports point down or across a floor, never up.**")
    head = bullet[:bullet.index("hold a docstring at most")]
    engine_subs = re.search(r"`kvviz\.engine` and its\s+sub-packages (.*?);", head)
    assert engine_subs, head
    named = {"kvviz.engine"} | {f"kvviz.engine.{n}" for n in re.findall(r"`(\w+)`", engine_subs.group(1))}
    named |= dotted_names(head[engine_subs.end():])
    pages = {m for m in EMPTY_PACKAGES if m.startswith("kvviz.ui.pages.")}
    assert "its page folders" in head
    assert named == set(EMPTY_PACKAGES) - pages


def test_the_list_checks_are_not_vacuous() -> None:
    text = "- **No torch** in `kvviz.units` and\n  `kvviz.errors`.\n- next\n"
    assert dotted_names(_bullet(text, "- **No torch** in")) == {"kvviz.units", "kvviz.errors"}
