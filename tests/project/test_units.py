"""One unit system: binary KiB/MiB/GiB on every page, in the CLI and the docs, all from
kvviz.units.fmt_bytes. The calculator may add the decimal figure in brackets after the binary one;
bandwidth stays GB/s, as spec sheets state it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from kvviz.units import GB, GIB, MIB, fmt_bytes

from unit_names import decimal_without_binary

ROOT = Path(__file__).resolve().parents[2]

# The few strings that must name a decimal unit on its own, each for a reason.
ALLOWED = {
    ("kvviz/ui/pages/calculator/calculator.py", "~4 GB for Llama 3 8B"),  # a quotation, then explained in GiB
    ("kvviz/ui/pages/calculator/calculator.py", "GB"),  # _pair's (binary, decimal) unit names
    ("kvviz/ui/pages/calculator/calculator.py", "MB"),
    ("kvviz/ui/pages/calculator/calculator.py", "KB"),
    ("kvviz/calculator/__init__.py", "GB"),  # the constant's name in __all__
    # SGLang's own log lines, in its words (its GB is 2**30 bytes: sglang's memory_pool GB = 1024**3)
    ("kvviz/calculator/server_sglang.py", "KV size: {} GB"),
    ("kvviz/calculator/server_sglang.py", "K size: {} GB, V size: {} GB"),
    ("kvviz/calculator/server_sglang.py", "Reserving {} GB of the KV budget for post-sizing multimodal allocations"),
    # the SGLang log reader: its patterns and the figures it quotes back, in the log's own GB (2**30)
    ("kvviz/calculator/server_log_engines.py", r"\s*GB"),
    ("kvviz/calculator/server_log_engines.py", " GB"),
    # the reconciler's placeholder: an SGLang pool line as SGLang writes it (kvviz's own figures for Llama 3 8B)
    ("kvviz/ui/pages/calculator/calculator_servers.py",
     "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 81920, K size: 5.00 GB, V size: 5.00 GB"),
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


# --- one definition each (issue 36) ------------------------------------------------------------

def test_gpu_menu_names_its_memory_in_the_unit_every_figure_uses() -> None:
    """The menu said "GeForce RTX 4090 (24 GB)" and the line below "GPU 24 GiB (as entered)"."""
    from kvviz.calculator import load_gpus

    for g in load_gpus().values():
        assert not decimal_without_binary(g.name), g.name
        assert f"({g.memory_gib} GiB)" in g.name, g.name  # the size in the name is the one the calculator uses


def test_a_preset_gpu_is_never_called_as_entered(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The engines' GPU line: a preset at its nominal size is named, with nvidia-smi's total where one
    is on file (H100) and saying there is none where not (RTX 4090); "as entered" only for a typed size."""
    from types import SimpleNamespace

    from kvviz.ui.pages.calculator import calculator_servers as ce

    def pick(kind: str) -> None:
        monkeypatch.setattr(ce.session, "get", lambda key, default=None: kind if key == "mem_gpu_kind" else default)

    pick("rtx-4090")
    assert ce.usable_gpu(SimpleNamespace(gpu_gib=24.0)) == (
        24.0, "GeForce RTX 4090 (24 GiB): 24 GiB nominal (no nvidia-smi total on file)")
    assert ce.usable_gpu(SimpleNamespace(gpu_gib=20.0)) == (20.0, "GPU 20 GiB (as entered)")
    pick("h100-sxm")
    assert ce.usable_gpu(SimpleNamespace(gpu_gib=80.0)) == (
        81_559 / 1024, "H100 SXM (80 GiB): 81,559 MiB usable (what nvidia-smi reports), 80 GiB nominal")


def test_vllm_formula_shows_how_a_request_counts_its_blocks() -> None:
    """"one request of 32,768 tokens = 2,048 = 2,048 blocks": each group's count is shown worked out,
    and no formula line repeats a figure as its own result."""
    from kvviz.calculator import load_presets
    from kvviz.calculator.server_vllm import VLLMSettings, vllm_sizing

    presets = load_presets()
    for key, want in (("llama-3-8b", "one request of 32,768 tokens: full: ceil(32,768 / 16) = 2,048 blocks"),
                      ("gemma-2-9b", "one request of 32,768 tokens: sliding 4,096: ceil(min(4,096 - 1 + 16,384, "  # 2 batches in flight
                                     "32,768) / 16) + 1 = 1,281 + full: ceil(32,768 / 16) = 2,048; 3,329 blocks in all")):
        v = vllm_sizing(presets[key], VLLMSettings(30 * GIB, 32_768, max_num_batched_tokens=8192))
        assert want in v.formula, v.formula
        assert not [f for f in v.formula if re.search(r"= ([\d,]+) = \1\b", f)], v.formula


def test_the_race_divides_weights_by_bandwidth_in_one_unit() -> None:
    """"513.1 MiB of weights at 11.4 GB/s": the weights also in MB beside the GB/s they are divided
    by, and the bandwidth labelled with the probe it is (the roofline's too)."""
    from kvviz.engine.generation.events import Run, StepEvent
    from kvviz.measure.stats import MachineProbe, race_explanation

    def run(lat: list[float], flops: list[float]) -> Run:
        ev = tuple(StepEvent(step=i, phase="prefill" if i == 0 else "decode", token_id=1, token_text="a",
                             position=8 + i, input_len=8 if i == 0 else 1, cache_len=8 + i, cache_bytes_used=0,
                             cache_bytes_allocated=0, latency_ms=t, flops=f, token_bytes=b"a", cache_bytes_copied=0,
                             elapsed_ms=t) for i, (t, f) in enumerate(zip(lat, flops)))
        return Run(model="m", device="cpu", dtype="fp32", use_cache=True, cache_kind="static", sampling="greedy",
                   prompt_ids=tuple(range(8)), prompt_text="", max_new_tokens=len(ev), events=ev)

    n = 40
    cached = run([5.0] + [1.0] * (n - 1), [8e6] + [1e6] * (n - 1))
    none = run([5.0] + [1.0 + 0.1 * i for i in range(n - 1)], [8e6] + [1e6 * (9 + i) for i in range(n - 1)])
    probe = MachineProbe("cpu", "fp32", peak_flops=50e9, bandwidth=11.4e9, matmul_n=1024, copy_bytes=256 * MIB,
                         seconds=1.0)
    text = race_explanation(cached, none, 538_061_568, probe)  # SmolLM2's fp32 weights
    assert "reading all 513.14 MiB (538.06 MB) of weights at 11.4 GB/s takes 47,198 µs" in text  # 538.06e6 / 11.4e9
    assert "this session's probe, an n=1024 matmul and a 256.0 MiB copy, the figures the roofline" in text


def test_tokens_per_s_has_one_definition() -> None:
    """The tour's tokens/s is 1000 / TPOT; ``run.tokens_per_s`` was tokens over the whole run (65.15
    beside 1000 / mean TPOT = 67.6). One definition (decode steps, batch x 1000 / mean TPOT); the
    end-to-end rate has its own name."""
    from kvviz.engine.generation.events import Run, StepEvent
    from kvviz.ui import tour

    lat = [40.0, 14.0, 15.0, 16.0]  # prefill, then three decode steps: mean TPOT 15 ms
    ev = tuple(StepEvent(step=i, phase="prefill" if i == 0 else "decode", token_id=1, token_text="a", position=8 + i,
                         input_len=8 if i == 0 else 1, cache_len=8 + i, cache_bytes_used=0, cache_bytes_allocated=0,
                         latency_ms=t, flops=1, token_bytes=b"a", cache_bytes_copied=0, elapsed_ms=t)
               for i, t in enumerate(lat))
    run = Run(model="m", device="cpu", dtype="fp32", use_cache=True, cache_kind="static", sampling="greedy",
              prompt_ids=tuple(range(8)), prompt_text="", max_new_tokens=4, events=ev, batch_size=2)
    assert run.mean_tpot_ms == 15.0
    assert run.tokens_per_s == run.decode_tokens_per_s == 2 * 1000 / 15.0  # batch x 1000 / TPOT
    assert run.e2e_tokens_per_s == 4 * 2 / (85.0 / 1000)  # every token, prefill's time included
    assert run.to_dict()["tokens_per_s"] == run.tokens_per_s
    assert "tokens per second is 1000 / TPOT" in Path(tour.__file__).read_text(encoding="utf-8")
