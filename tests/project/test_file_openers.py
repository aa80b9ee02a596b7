"""One opener per file format (docs/ARCHITECTURE.md, "engine/loading" and `safeio.py`): each way
of opening or parsing a model file is reached from one module, so its checks (a GGUF's header walk,
a safetensors header before any tensor, a bounded JSON read) cannot be skipped by a second reader.

Read with ``ast`` over kvviz/ and app.py; a name counts wherever code uses it (a call, an attribute,
an import), never in a docstring or a comment:
- GGUF: memory-mapped only by ``gguf_lite.read_gguf`` (numpy's ``memmap``); the header walk
  (``scan_header``) defined in ``gguf_checks`` and run by ``read_gguf`` and ``model_family`` alone;
  ``gguf.GGUFReader`` never used.
- safetensors: read (``safe_open``; ``load_file`` nowhere) only in ``safetensors_header`` (the header
  and the tensors); other modules may import ``save_file`` and ``SafetensorError``.
- tokenizer.json: opened (``Tokenizer.from_file``) only by ``HFTokenizer``.
- JSON (a config.json above all): decoded (``json.load(s)``, ``JSONDecoder``) in ``safeio`` and in
  the modules of ``JSON_ELSEWHERE`` only, each of which decodes something no user names as a file.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A name used in code -> the only modules that may use it.
OPENERS: dict[str, tuple[str, ...]] = {
    "memmap": ("kvviz/engine/loading/gguf_lite.py",),  # the one GGUF opener maps the file once
    "GGUFReader": (),  # trusts every length (gguf_checks' docstring says how it fails); never built
    "scan_header": ("kvviz/engine/loading/gguf_checks.py", "kvviz/engine/loading/gguf_lite.py"),
    "safe_open": ("kvviz/engine/loading/safetensors_header.py",),
    "load_file": (),  # safetensors.torch.load_file: safetensors_header reads through safe_open
    "from_file": ("kvviz/engine/tokenize/tokenizer.py",),  # tokenizer.json, through `tokenizers`
}
JSON_DECODERS = ("load", "loads", "JSONDecoder")
# Modules that decode JSON themselves, each with what it decodes: none is a file a user names.
JSON_ELSEWHERE: dict[str, str] = {
    "kvviz/safeio.py": "the one JSON decoder for users' files (json_value, parse_json)",
    "kvviz/watch/scrape.py": "an HTTP body, already bounded in size and time by scrape",
    "kvviz/watch/target_bench.py": "a server's streamed and /tokenize responses",
    "kvviz/measure/llamacpp.py": "its worker's answer line (a subprocess kvviz started)",
    "kvviz/measure/llamacpp_worker.py": "the parent's request line",
    "kvviz/calculator/presets.py": "assets/memory_presets.json, shipped with kvviz",
    "kvviz/calculator/cost.py": "the GPU presets shipped in assets/",
    "kvviz/engine/serving/workloads.py": "assets/serve_prompts.json, shipped with kvviz",
    "kvviz/ui/pages/compress/compress_window.py": "the shipped curves (read through safeio's read_bounded)",
    "kvviz/engine/loading/gemma3_package.py": "its own stamp file in kvviz's cache folder",
    "kvviz/notebook_live.py": "plotly's own JSON of a figure, in memory",
}


def names_used(source: str) -> dict[str, list[int]]:
    """Every name used in code -> its lines: ``x.NAME`` (attribute), ``NAME`` (a name) and
    ``from m import NAME`` / ``import m.NAME`` (an import). Docstrings and comments are not code."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [part for a in node.names for part in a.name.split(".")]
        else:
            continue
        for n in names:
            found.setdefault(n, []).append(node.lineno)
    return found


def json_decodes(source: str) -> list[int]:
    """Lines that decode JSON: ``json.load(s)``, ``json.JSONDecoder``, or those names imported from json."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in JSON_DECODERS and \
                isinstance(node.value, ast.Name) and node.value.id == "json":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "json" and \
                any(a.name in JSON_DECODERS for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def _files(root: Path) -> dict[str, str]:
    paths = [*(root / "kvviz").rglob("*.py"), root / "app.py"]
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in sorted(paths)
            if "__pycache__" not in p.parts}


def opener_violations(root: Path) -> list[str]:
    problems = []
    for rel, source in _files(root).items():
        used = names_used(source)
        for name, allowed in OPENERS.items():
            if name in used and rel not in allowed:
                problems.append(f"{rel}:{used[name][0]} uses {name} (only {', '.join(allowed) or 'nothing'} may)")
        if (lines := json_decodes(source)) and rel not in JSON_ELSEWHERE:
            problems.append(f"{rel}:{lines[0]} decodes JSON itself (a user's file goes through safeio.parse_json)")
    return problems


def test_each_file_format_has_one_opener() -> None:
    assert opener_violations(ROOT) == []


def test_every_listed_opener_still_opens() -> None:
    """The lists hold no stale entry: every module allowed a reader uses it (else the list drifts
    into an allowance nobody needs, which a new reader could hide behind)."""
    files = _files(ROOT)
    stale = [f"{rel}: {name}" for name, allowed in OPENERS.items() for rel in allowed
             if name not in names_used(files[rel])]
    stale += [f"{rel}: JSON" for rel in JSON_ELSEWHERE if not json_decodes(files[rel])]
    assert stale == []


def test_a_second_reader_is_caught(tmp_path: Path) -> None:
    """Not vacuous: each kind of second reader, planted in a copy of the package, is reported; a
    docstring that names one is not."""
    import shutil

    shutil.copytree(ROOT / "kvviz", tmp_path / "kvviz", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "app.py", tmp_path / "app.py")
    planted = {
        "kvviz/engine/loading/loader.py": ("from safetensors.torch import load_file\n", "uses load_file"),
        "kvviz/engine/loading/gguf_llama.py": ("import numpy as np\nmm = lambda p: np.memmap(p)\n", "uses memmap"),
        "kvviz/engine/tokenize/gguf_bpe.py": ("from gguf import GGUFReader\n", "uses GGUFReader"),
        "kvviz/engine/loading/llama_loader.py": ("import json\ncfg = lambda p: json.loads(p.read_text())\n",
                                                 "decodes JSON itself"),
        "kvviz/ui/state/model_menu.py": ("from json import load\n", "decodes JSON itself"),
        "kvviz/engine/loading/save.py": ("from kvviz.engine.loading.gguf_checks import scan_header\n",
                                         "uses scan_header"),
    }
    for rel, (line, _) in planted.items():
        target = tmp_path / rel
        target.write_text(line + target.read_text())
    (tmp_path / "kvviz/units.py").write_text('"""json.loads, safe_open and GGUFReader, named in a docstring."""\n'
                                            + (tmp_path / "kvviz/units.py").read_text())
    found = opener_violations(tmp_path)
    for rel, (_, needle) in planted.items():
        assert any(p.startswith(rel) and needle in p for p in found), (rel, found)
    assert not any(p.startswith("kvviz/units.py") for p in found)
