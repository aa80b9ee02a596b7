"""The layers are a test: every module's imports, read with ``ast``, point down a floor or across
it, never up and never around a circle; only the UI imports streamlit; the calculator and the
charts never import torch. docs/ARCHITECTURE.md draws the same floors.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Module (or package prefix) -> floor. The longest matching prefix wins. A module that no entry
# covers fails the test: a new module gets its floor on purpose, here and in ARCHITECTURE.md.
FLOORS: dict[str, int] = {
    # Floor 0: facts, bounds and this machine's name; pure Python, importable from anywhere.
    "kvviz.errors": 0, "kvviz.units": 0, "kvviz.limits": 0,
    "kvviz.safeio": 0,  # bounded reads of user-named files and JSON
    "kvviz.hostinfo": 0,  # the CPU's name and free memory: the C kernels' build key and the benchmarks read it
    "kvviz.paths": 0,  # where the assets, the app script and its config are: a checkout's or an installed wheel's
    "kvviz.model_packages": 0,  # the model packages' pins, sizes and install command: the loaders' messages name it
    "kvviz.calculator": 1,  # the calculator: pure Python
    "kvviz.watch": 1,  # a running server's /metrics read and sized with the calculator: pure Python, no torch
    # engine/models: the readable families, their configs and the attention mask (2).
    "kvviz.engine.models": 2,
    "kvviz.engine.tokenize": 1,  # tokenizers and chat templates: text <-> ids, no model
    # engine/kvcache: the caches, their bookkeeping and quantizers (2).
    "kvviz.engine.kvcache": 2,
    # engine/generation: what a generation runs on (1): the request's values (the compressed-cache
    # request, KVSpec, among them) and the checked request, sampling, stops, events, captures, the
    # non-finite diagnosis, FLOPs; and the request with its checks (5), which opens the strategies' checks.
    "kvviz.engine.generation": 1, "kvviz.engine.generation.request": 5,
    # engine/loading: checkpoints -> the readable model (2), beside the families they fill; the GGUF
    # readers sit below (1): the tokenizers (1) read GGUF metadata, the block kernel (1) its codes. The accelerator (kvviz.fast, 3) is above them and
    # engine/loaded.py (4) above both builds it: no loader imports kvviz.fast.
    "kvviz.engine.loading": 2, "kvviz.engine.loaded": 4,
    "kvviz.engine.loading.gguf_checks": 1,
    "kvviz.engine.loading.gguf_lite": 1,  # the one GGUF reader: header checked, metadata and tensor views in one pass
    "kvviz.engine.loading.gguf_codes": 1,  # a quantized tensor's blocks as BlockCodes, the block kernel's input: file data
    # the step driver (plan, forward, commit; every generation path runs through it), the plain loop
    # over it and the stream base every strategy shares
    "kvviz.engine.core": 5,
    "kvviz.engine.serving": 5, "kvviz.engine.serving.records": 1,  # the serving scheduler (5) and its plain records (1)
    # engine/strategy: beam search and speculative decoding, streams over the loop's stream base (5);
    # their records are plain dataclasses in engine/generation (strategy_events.py), beside the Run.
    "kvviz.engine.strategy": 5,
    # engine/sessions: loops over one cache beside the loop, and a turn's record and undo data (5).
    "kvviz.engine.sessions": 5,
    # The accelerator and its kernels: built from a model (2) by engine/loaded.py (4).
    "kvviz.fast": 3,
    "kvviz.charts": 2,  # pure Plotly
    "kvviz": 6,  # the package's public API (kvviz/__init__.py)
    "kvviz.engine.api": 6,  # iter_generate/generate/open_stream: above the loop and the strategies it opens
    "kvviz.measure": 7, "kvviz.measure.stats": 2, "kvviz.measure.doubts": 2,  # stats: the perf charts (2) read it
    "kvviz.train": 7, "kvviz.evaluate": 7, "kvviz.ui": 7,
    "kvviz.notebook": 7, "kvviz.notebook_live": 7,  # the app's figures in Jupyter, beside the pages
    "kvviz.cli": 8, "kvviz.__main__": 8, "app": 8,  # the command line (its table, the subcommands' glue) and the app
}
# Package __init__ files that only mark a folder: importing them costs nothing and says nothing.
EMPTY_PACKAGES = ("kvviz.engine", "kvviz.engine.core", "kvviz.engine.serving", "kvviz.engine.models", "kvviz.engine.loading", "kvviz.engine.tokenize",
                  "kvviz.engine.kvcache", "kvviz.engine.generation", "kvviz.engine.strategy", "kvviz.engine.sessions",
                  "kvviz.cli", "kvviz.measure", "kvviz.watch", "kvviz.charts", "kvviz.ui", "kvviz.ui.state", "kvviz.ui.common",
                  "kvviz.ui.pages",
                  *(f"kvviz.ui.pages.{page}" for page in ("generate", "race", "prefill", "batching", "chat", "decoding",
                                                          "compress", "calculator", "live", "serving")))
STREAMLIT_ALLOWED = ("kvviz.ui", "app")
NO_TORCH = ("kvviz.calculator", "kvviz.watch", "kvviz.charts", "kvviz.units", "kvviz.engine.generation.flops", "kvviz.errors",
            "kvviz.safeio", "kvviz.limits", "kvviz.cli.argtypes", "kvviz.hostinfo", "kvviz.paths", "kvviz.model_packages")


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package and app.py."""
    out = {"app": root / "app.py"}
    for f in sorted((root / "kvviz").rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def floor_of(name: str) -> int | None:
    if name in EMPTY_PACKAGES:
        return 0
    # "kvviz" names the package's __init__ only; every other entry also covers what lies under it.
    best = max((p for p in FLOORS if name == p or (p != "kvviz" and name.startswith(p + "."))), key=len,
               default=None)
    return None if best is None else FLOORS[best]


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported name, line) for every import in the file, TYPE_CHECKING blocks included: a
    type-only import still says which way the dependency points."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:  # `from kvviz.charts import perf` imports the module kvviz.charts.perf
                sub = f"{base}.{a.name}"
                out.append((sub if sub in known else base, node.lineno))
    return out


def violations(root: Path) -> list[str]:
    mods = modules(root)
    known = set(mods)
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        mine = floor_of(name)
        if mine is None:
            problems.append(f"{name}: no floor assigned (add it to FLOORS and docs/ARCHITECTURE.md)")
            continue
        body = ast.parse(path.read_text(encoding="utf-8")).body
        if name in EMPTY_PACKAGES and any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
                                          for n in body):
            problems.append(f"{name}: a folder-marking __init__.py holds a docstring at most")
        for target, line in imports_of(name, path, known):
            top = target.split(".")[0]
            if top == "streamlit" and not _within(name, STREAMLIT_ALLOWED):
                problems.append(f"{name}:{line} imports streamlit (only kvviz.ui and app.py may)")
            if top == "torch" and _within(name, NO_TORCH):
                problems.append(f"{name}:{line} imports torch (it must stay pure Python)")
            if top not in ("kvviz", "app") or target in EMPTY_PACKAGES:
                continue
            theirs = floor_of(target)
            if theirs is not None and theirs > mine:
                problems.append(f"{name}:{line} (floor {mine}) imports {target} (floor {theirs}): upward")
            if target in graph and target != name:
                graph[name].add(target)
    problems += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected knot found by depth-first search."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


def test_the_package_keeps_its_floors() -> None:
    assert violations(ROOT) == []


@pytest.mark.parametrize("file,line,needle", [
    ("kvviz/engine/models/gpt2_config.py", "from kvviz.ui.state import run_store\n", "upward"),
    ("kvviz/engine/kvcache/dense.py", "from kvviz.engine.api import generate\n", "upward"),
    ("kvviz/charts/run_charts.py", "import streamlit as st\n", "imports streamlit"),
    ("kvviz/units.py", "import torch\n", "imports torch"),
    ("kvviz/engine/generation/sampling.py", "from kvviz.engine.tokenize.tokenizer import Tokenizer\n", "import cycle"),
    ("kvviz/engine/brand_new.py", "x = 1\n", "no floor assigned"),
    ("kvviz/engine/loading/loader.py", "from kvviz.fast import build\n", "upward"),  # loaders return the readable model
    ("kvviz/measure/bench.py", "import kvviz.cli.argtypes as types\n", "upward"),  # measure/ is a library below cli/
])
def test_a_planted_violation_fails(tmp_path: Path, file: str, line: str, needle: str) -> None:
    """The checker is not vacuous: each kind of violation, planted in a copy, is reported."""
    shutil.copytree(ROOT / "kvviz", tmp_path / "kvviz", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "app.py", tmp_path / "app.py")
    target = tmp_path / file
    if needle == "import cycle":  # sampling -> tokenizers, and tokenizers -> sampling back
        (tmp_path / "kvviz/engine/tokenize/tokenizer.py").write_text(
            "from kvviz.engine.generation.sampling import sample\n" + (tmp_path / "kvviz/engine/tokenize/tokenizer.py").read_text())
    target.write_text(line + (target.read_text() if target.exists() else ""))
    found = violations(tmp_path)
    assert any(needle in p for p in found), found


def test_measure_is_a_library_the_command_line_wires() -> None:
    """measure/ parses no arguments (issue 38): every subcommand's argparse wiring lives in cli/."""
    wiring = sorted(name for name, path in modules(ROOT).items() if _within(name, ("kvviz.measure",))
                    for target, _ in imports_of(name, path, set()) if target.split(".")[0] == "argparse")
    assert wiring == []


def test_no_two_modules_share_a_file_name() -> None:
    """A file name says which module it is: no two modules share one (a package's __init__.py aside)."""
    names: dict[str, list[str]] = {}
    for name, path in modules(ROOT).items():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(name)
    assert {n: m for n, m in names.items() if len(m) > 1} == {}


def test_no_engine_folder_holds_more_than_twelve_modules() -> None:
    """The engine stays in rooms a reader can take in at once (issue 29: about a dozen modules each)."""
    crowded = {str(d.relative_to(ROOT)): n for d in [ROOT / "kvviz/engine", *(ROOT / "kvviz/engine").iterdir()]
               if d.is_dir() and (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"])) > 12}
    assert crowded == {}


def test_the_calculator_imports_without_torch() -> None:
    """`import kvviz.calculator` is the plain import (no file-path trick), and torch stays out."""
    charts = [f"kvviz.charts.{p.stem}" for p in (ROOT / "kvviz/charts").glob("*.py") if p.stem != "__init__"]
    code = (f"import sys, kvviz.calculator, kvviz.units, {', '.join(charts)}\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_generation_never_imports_strategy() -> None:
    """strategy/ (beam search, speculative decoding) builds on generation/ (the stream base, the
    request); the API that opens either stream (engine/api.py) sits above both, so the two folders
    form no circle (issue 38)."""
    mods = modules(ROOT)
    back = [f"{name}:{line} imports {target}" for name, path in mods.items()
            if name.startswith("kvviz.engine.generation.")
            for target, line in imports_of(name, path, set(mods)) if target.startswith("kvviz.engine.strategy")]
    assert back == []
