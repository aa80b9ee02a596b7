"""One unit system: binary KiB/MiB/GiB on every page, in the CLI and the docs, all from
kvviz.units.fmt_bytes. The calculator may add the decimal figure in brackets after the binary one;
bandwidth stays GB/s, as spec sheets state it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from kvviz.units import GB, GIB, MIB, fmt_bytes

ROOT = Path(__file__).resolve().parents[2]
DECIMAL = re.compile(r"(?<![\w/])(KB|MB|GB|TB)(?![\w/])")  # 'GB/s' and 'MB/s' are rates, allowed
BINARY = re.compile(r"\b(KiB|MiB|GiB|TiB)\b")

# The few strings that must name a decimal unit on its own, each for a reason.
ALLOWED = {
    ("kvviz/ui/pages/calculator/calculator.py", "~4 GB for Llama 3 8B"),  # a quotation, then explained in GiB
    ("kvviz/ui/pages/calculator/calculator.py", "GB"),  # _pair's (binary, decimal) unit names
    ("kvviz/ui/pages/calculator/calculator.py", "MB"),
    ("kvviz/ui/pages/calculator/calculator.py", "KB"),
    ("kvviz/memory/__init__.py", "GB"),  # the constant's name in __all__
    # SGLang's own log lines, in its words (its GB is 2**30 bytes: sglang's memory_pool GB = 1024**3)
    ("kvviz/memory/engine_sglang.py", "KV Cache is allocated. #tokens: {}, KV size: {} GB"),
    ("kvviz/memory/engine_sglang.py", "KV Cache is allocated. #tokens: {}, K size: {} GB, V size: {} GB"),
}


def _strings(tree: ast.AST) -> list[str]:
    """Every string a module can show: plain literals and whole f-strings (their literal parts
    joined), docstrings left out (they are for readers of the code)."""
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    inside_f = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.JoinedStr):
            out.append("{}".join(v.value for v in n.values if isinstance(v, ast.Constant)))
        elif (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
              and id(n) not in inside_f):
            out.append(n.value)
    return out


def decimal_without_binary(text: str) -> list[str]:
    """Decimal units that no binary unit precedes in the same string ('1.00 GiB (1.07 GB)' passes)."""
    bad = []
    for m in DECIMAL.finditer(text):
        if not BINARY.search(text, 0, m.start()):
            bad.append(text[max(0, m.start() - 40):m.end() + 10])
    return bad


def test_fmt_bytes_is_binary_with_the_decimal_figure_in_brackets() -> None:
    # The cache: 360 MiB = 377,487,360 B, once "377.49 MB" in the race and "360.0 MiB" on Generate.
    assert fmt_bytes(360 * MIB) == "360.0 MiB"
    assert fmt_bytes(538_061_568) == "513.1 MiB"  # SmolLM2's fp32 weights (weight_bytes), "538.1 MB" before
    assert fmt_bytes(GIB) == "1.0 GiB" and fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(1000) == "1,000 B"
    assert fmt_bytes(GIB, both_units=True) == "1.00 GiB (1.07 GB)"
    assert fmt_bytes(47_185_920, both_units=True) == "45.00 MiB (47.19 MB)"
    assert fmt_bytes(23_040, both_units=True) == "23,040 B (22.5 KiB)"
    assert GB == 10**9 and GIB == 2**30


def test_the_scanner_can_fail() -> None:
    tree = ast.parse('x = f"{n / 1e6:,.2f} MB"\ny = "weights 538.1 MB"\nz = f"{a} GiB ({b} GB)"\nw = "3 GB/s"')
    found = [s for s in _strings(tree) if decimal_without_binary(s)]
    assert found == [" MB", "weights 538.1 MB"]


def test_no_module_writes_a_decimal_byte_unit() -> None:
    bad = []
    for path in sorted((ROOT / "kvviz").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for s in _strings(ast.parse(path.read_text(encoding="utf-8"))):
            if decimal_without_binary(s) and not any(rel == f and (s == a or a in s and len(a) > 2)
                                                     for f, a in ALLOWED):
                bad.append((rel, s[:120]))
    assert not bad, bad


def test_docs_use_binary_units() -> None:
    """README and the docs: no '98 MB' beside '93.8 MiB'. The decimal unit only after a binary figure
    on the same line, or in the few lines that quote a decimal source on purpose."""
    quoted = ("Streamlit's decimal unit", "606 MB in huge pages")
    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\d\s?(KB|MB|GB)\b(?!/s)", line) and decimal_without_binary(line) \
                    and not any(q in line for q in quoted):
                bad.append(f"{path.name}:{i}: {line[:100]}")
    assert not bad, bad


def test_memory_cli_names_the_weight_dtype_it_counts(capsys) -> None:
    """`memory --dtype bf16` printed "weights fp16"; the weights now follow a float KV dtype."""
    from kvviz.cli.main import main

    for dtype, weights, weight_bytes in (("bf16", "bf16", "256.57 MiB"), ("fp32", "fp32", "513.13 MiB"),
                                         ("int8", "fp16", "256.57 MiB")):
        assert main(["memory", "--preset", "smollm2-135m", "--seq-len", "2048", "--dtype", dtype]) in (0, None)
        out = capsys.readouterr().out
        assert f"KV {dtype}, weights {weights}" in out
        assert f"weights:       {weight_bytes} (" in out  # 134,515,008 params x 2 or 4 bytes
    main(["memory", "--preset", "smollm2-135m", "--seq-len", "2048", "--dtype", "bf16", "--weight-dtype", "int8"])
    assert "KV bf16, weights int8" in capsys.readouterr().out
