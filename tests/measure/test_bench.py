"""``python -m kvviz bench``: the JSON it writes, its ratios, the floor's byte count, bad input."""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvviz.cli.main import main


def _engine_test(name: str) -> Any:
    """A module of tests/engine/ (its tiny-model writers), imported under the name pytest gives it:
    the test folders are not packages, so pytest puts each test's own folder on sys.path, and a
    run of this file alone has not put tests/engine/ there yet."""
    folder = str(Path(__file__).resolve().parents[1] / "engine")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def _tiny_weight_bytes() -> int:
    # By hand for random:tiny (4 layers, C = 256, V = 256, fp32), weights + biases of each matmul:
    # c_attn 256x768 + 768, attn c_proj 256x256 + 256, c_fc 256x1024 + 1024, mlp c_proj 1024x256 + 256,
    # then the LM head 256x256 (a vocabulary of 256 needs no padding to 64 columns).
    per_layer = 256 * 768 + 768 + 256 * 256 + 256 + 256 * 1024 + 1024 + 1024 * 256 + 256
    return (4 * per_layer + 256 * 256) * 4


def test_quick_bench_writes_the_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--model", "tiny", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads(out.read_text())
    assert printed["results"] == written["results"]
    m = written["machine"]
    assert m["cpu"] and m["cores"] == os.cpu_count() and m["device"] == "cpu" and m["torch"].startswith("2.")
    main_case, cache_case = written["results"]
    assert (main_case["shape"], main_case["new_tokens"], written["repeats"]) == ("tiny", 16, 2)
    v = main_case["variants"]
    assert set(v) == {"kvviz_static", "readable_static", "kvviz_uncached", "hf", "floor", "kvviz_static_decode"}
    # Every generator produced the same greedy tokens as kvviz cached; the floor generates none.
    assert [v[k]["tokens_match"] for k in ("kvviz_static", "readable_static", "kvviz_uncached", "hf", "floor")] == [
        True, True, True, True, None]
    for d in v.values():
        assert d["runs"] == 2 and 0 < d["tok_s_min"] <= d["tok_s_median"] <= d["tok_s_max"]
    med = {k: d["tok_s_median"] for k, d in v.items()}
    r = main_case["ratios"]
    assert r["kvviz_static_vs_hf"] == pytest.approx(med["kvviz_static"] / med["hf"], rel=1e-12)
    assert r["cached_vs_uncached"] == pytest.approx(med["kvviz_static"] / med["kvviz_uncached"], rel=1e-12)
    assert r["fast_vs_readable"] == pytest.approx(med["kvviz_static"] / med["readable_static"], rel=1e-12)
    assert r["readable_static_vs_hf"] == pytest.approx(med["readable_static"] / med["hf"], rel=1e-12)
    assert r["floor_vs_hf"] == pytest.approx(med["floor"] / med["hf"], rel=1e-12)
    assert r["kvviz_static_vs_floor"] == pytest.approx(med["kvviz_static"] / med["floor"], rel=1e-12)
    assert r["kvviz_static_decode_vs_floor"] == pytest.approx(med["kvviz_static_decode"] / med["floor"], rel=1e-12)
    # Repeat by repeat: repeat i of kvviz over repeat i of transformers, from the runs in order.
    runs = {k: d["runs_tok_s"] for k, d in v.items()}
    assert all(len(x) == 2 and sorted(x) == [v[k]["tok_s_min"], v[k]["tok_s_max"]] for k, x in runs.items())
    per_repeat = sorted(a / b for a, b in zip(runs["kvviz_static"], runs["hf"]))
    assert main_case["ratio_spread"]["kvviz_static_vs_hf"] == pytest.approx(
        {"min": per_repeat[0], "max": per_repeat[1]}, rel=1e-12)
    assert set(main_case["ratio_spread"]) == set(r)
    assert main_case["weight_bytes"] == _tiny_weight_bytes() == 12_881_920
    assert v["floor"]["GB_s_median"] == pytest.approx(12_881_920 * med["floor"] / 1e9, rel=1e-12)
    assert set(cache_case["variants"]) == {"kvviz_static", "kvviz_concat"}
    assert cache_case["ratios"]["static_vs_concat"] > 0


def test_table_names_the_machine_and_the_floor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", "--model", "tiny", "--no-hf", "--out", str(tmp_path / "b.json")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("machine: ") and "cores" in text and "median of 2 interleaved runs" in text
    assert "floor = weight matmuls only: 12.3 MiB per token" in text  # 12,881,920 B
    assert " hf " not in text  # --no-hf really skips the baseline


def test_bench_without_transformers_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(SystemExit) as e:
        main(["bench", "--quick", "--model", "tiny", "--out", str(tmp_path / "b.json")])
    assert e.value.code == 2
    assert "requirements-dev.txt" in capsys.readouterr().err


@pytest.mark.parametrize("arg", [["--repeats", "0"], ["--prompt-len", "0"], ["--repeats", "x"], ["--model", "huge"]])
def test_bench_bad_arguments_exit_2(arg: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", *arg, "--out", str(tmp_path / "b.json")])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_unwritable_out_is_refused_before_measuring(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--quick", "--model", "tiny", "--no-hf", "--out", str(blocker / "b.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cannot write the results to" in err and "Traceback" not in err


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_floor_runs_every_weight_matmul_of_the_step(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor calls each of the step's 17 matmuls once per token, through the kernels the step
    uses: the C row kernel where it builds, else the split (2 threads) or plain GEMMs."""
    from kvviz.fast import rowops
    from kvviz.measure.bench import _floor_runner, weight_matmuls
    from kvviz.engine.loaded import load_model

    model = load_model("random:tiny")
    mats = weight_matmuls(model)
    assert len(mats) == 4 * 4 + 1
    assert sum(m.w.nbytes + (m.bias.nbytes if m.bias is not None else 0) for m in mats) == _tiny_weight_bytes()
    calls: list[str] = []
    for name in ("bmm", "baddbmm", "addmm", "matmul"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: calls.append("@") or torch.mm(a, b))
    real_row = rowops.RowLinear.__call__
    monkeypatch.setattr(rowops.RowLinear, "__call__", lambda self, *a: calls.append("c") or real_row(self, *a))
    _floor_runner(model, 3)()
    assert len(calls) == 3 * 17
    if rowops.load() is not None:
        assert set(calls) == {"c"}
    else:
        assert set(calls) <= ({"bmm", "baddbmm"} if threads == 2 else {"addmm", "@"})


def test_a_llama_case_measures_both_engines_bf16_and_the_floors(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The SmolLM2 case's machinery on a tiny random Llama folder: transformers' LlamaForCausalLM
    on kvviz's own tensors gives the same tokens, the bf16 variants run a bf16 copy, and each
    floor streams every fused call's weights once per token (its bytes counted by dtype)."""
    pytest.importorskip("transformers")
    from kvviz.fast import rowops
    from kvviz.measure.bench import Case, _floor_runner, bench_case
    from kvviz.engine.loaded import load_model
    save_hf_llama = _engine_test("test_llama").save_hf_llama

    folder = tmp_path / "llama"
    save_hf_llama(folder, num_key_value_heads=2)  # 2 layers, C 64, I 112, V 96, tied
    variants = ("kvviz_static", "readable_static", "kvviz_uncached", "hf", "floor", "kvviz_static_bf16", "floor_bf16")
    r = bench_case(Case("llama", 6, variants, model=str(folder)), repeats=1, prompt_len=4, device="cpu", with_hf=True)
    v = r["variants"]
    assert set(v) == set(variants) | {"kvviz_static_decode"} and r["new_tokens"] == 6
    # the decode alone: 5 tokens over each run's time less its prefill, so faster than the whole run's 6
    d = v["kvviz_static_decode"]
    assert d["runs"] == 1 and d["tokens_match"] is None and d["tok_s_median"] > v["kvviz_static"]["tok_s_median"] * 5 / 6
    assert r["ratios"]["kvviz_static_decode_vs_floor"] == pytest.approx(d["tok_s_median"] / v["floor"]["tok_s_median"])
    assert [v[k]["tokens_match"] for k in variants[:4]] == [True] * 4
    assert v["kvviz_static_bf16"]["tokens_match"] is None and v["kvviz_static_bf16"]["dtype"] == "bf16"
    assert 0 <= v["kvviz_static_bf16"]["same_tokens_before_divergence"] <= 6
    per_layer = 64 * 64 * 2 + 2 * 32 * 64 + 3 * 112 * 64  # q, o; k, v (2 heads of 16); gate, up, down
    assert r["weight_bytes"] == v["floor"]["weight_bytes"] == 4 * (2 * per_layer + 96 * 64)
    assert v["floor_bf16"]["weight_bytes"] == 2 * (2 * per_layer + 96 * 64)
    assert {"bf16_vs_fp32", "kvviz_static_bf16_vs_floor_bf16", "kvviz_static_vs_hf"} <= set(r["ratios"])
    assert "quoted" not in r  # llama.cpp's figures belong to SmolLM2 alone
    calls: list[int] = []
    model = load_model(folder)
    real = rowops.RowDot.__call__
    monkeypatch.setattr(rowops.RowDot, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    _floor_runner(model, 3)()
    assert len(calls) == (3 * (4 * 2 + 1) if rowops.load() is not None else 0)


def test_llama_cpp_is_measured_beside_kvviz_when_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With llama-cpp-python importable (a stand-in here: CI does not compile llama.cpp), a GGUF
    model's case runs llama.cpp on the same file, greedy, for exactly n tokens, and the bf16 ratio
    is taken against that measured figure, not the quoted one."""
    pytest.importorskip("transformers")
    import types

    from kvviz.measure import bench
    from gguf_writers import write_llama_gguf

    path = write_llama_gguf(tmp_path / "tiny.gguf", _engine_test("test_gguf").make_hf())
    seen: dict[str, object] = {}

    class FakeLlama:
        def __init__(self, model_path: str, n_threads: int, n_ctx: int, verbose: bool) -> None:
            seen.update(model_path=model_path, n_threads=n_threads, n_ctx=n_ctx)

        def reset(self) -> None:
            seen["resets"] = int(seen.get("resets", 0)) + 1  # type: ignore[call-overload]

        def generate(self, tokens: list[int], temp: float, top_k: int, reset: bool):  # type: ignore[no-untyped-def]
            seen.update(prompt=list(tokens), temp=temp, top_k=top_k)
            while True:  # never stops by itself: the runner takes n tokens
                yield 5

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    monkeypatch.setattr(bench, "have_llama_cpp", lambda: True)
    variants = ("kvviz_static", "kvviz_static_bf16")
    case = bench.Case("gguf", 6, variants, model=str(path))
    r = bench.bench_case(case, repeats=1, prompt_len=4, device="cpu", with_hf=False)
    d = r["variants"][bench.LLAMA_CPP]
    model = bench.load_model(str(path))
    prompt = bench._prompt(case, model, 4)
    assert seen["model_path"] == str(path) and seen["n_threads"] == torch.get_num_threads()
    assert seen["prompt"] == prompt and seen["n_ctx"] == 4 + 6 + 8
    assert (seen["temp"], seen["top_k"], seen["resets"]) == (0.0, 1, 2)  # greedy; warm-up + 1 timed run
    assert d["dtype"] == "the GGUF's own block types (llama.cpp)" and d["tokens_match"] is None and d["runs"] == 1
    kvviz_ids = bench._runner("kvviz_static", model, None, prompt, 6)()
    assert d["same_tokens_before_divergence"] == next((i for i, t in enumerate(kvviz_ids) if t != 5), 6)
    assert r["ratios"]["kvviz_static_bf16_vs_llama_cpp"] == pytest.approx(
        r["variants"]["kvviz_static_bf16"]["tok_s_median"] / d["tok_s_median"])
    assert "quoted" not in r


def test_cache_sweep_reports_medians_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep.json"
    main(["bench", "--model", "tiny", "--cache-sweep", "12,4", "--repeats", "3", "--out", str(out)])
    text = capsys.readouterr().out
    res = json.loads(out.read_text())["cache_sweep"]
    assert [r["new_tokens"] for r in res["rows"]] == [4, 12]
    from statistics import median

    for r in res["rows"]:
        assert len(r["cached_runs_ms"]) == len(r["uncached_runs_ms"]) == 3
        assert r["cached_ms"] == round(median(r["cached_runs_ms"]), 1)
        # The runs are shown rounded to 0.1 ms and the ratio (rounded to 0.01) comes from the unrounded
        # ones: they differ by at most its own rounding, 0.005, plus what +-0.05 ms on each median moves
        # the ratio (a fixed 0.01 failed once: 10.79 from a 51.7 ms median, where 0.05 ms alone is 0.011).
        u, c = median(r["uncached_runs_ms"]), median(r["cached_runs_ms"])
        assert abs(r["speedup"] - u / c) <= 0.005 + (u / c) * (0.05 / u + 0.05 / c) / (1 - 0.05 / c)
        assert r["generated"] == r["new_tokens"]  # random weights never stop early here
    assert res["rows"][1]["seed_claim"] == [2.0, 5.0]  # 12 tokens: the seeds' "2-5x at 10-20"
    assert res["rows"][0]["seed_claim"] is None
    from kvviz.engine.loaded import load_model
    from kvviz.measure.sweeps import DOCUMENT

    assert res["prompt_tokens"] == len(load_model("random:tiny").tokenizer.encode(DOCUMENT)) > 100
    assert "cache vs no cache on" in text and "2-5x:" in text


@pytest.mark.parametrize("ns, message", [("a,b", "comma-separated"), ("0,4", "at least 1"), (",", "at least 1"),
                                         ("4,1000000000", "at most 32 counts"), (",".join(map(str, range(1, 40))), "got 39")])
def test_cache_sweep_rejects_bad_counts(ns: str, message: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--model", "tiny", "--cache-sweep", ns, "--out", str(tmp_path / "x.json")])
    assert message in capsys.readouterr().err
