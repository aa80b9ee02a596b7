"""`python -m kvviz generate|eval`: the JSON contract, and argparse-style errors with exit code 2.

Only three tests start a real process (each pays ~3 s of torch import); the rest call
``kvviz.cli.main`` in-process, which runs the same code and raises on any traceback.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvviz
from kvviz.engine.loading.loader import LoadedModel
from kvviz.cli.main import main
from kvviz import CacheSpec, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
RUN_KEYS = {"model", "device", "use_cache", "engine", "prompt_ids", "generated_ids", "text", "stop_reason", "steps"}
STEP_KEYS = {"step", "phase", "token_id", "position", "input_len", "cache_len", "cache_bytes", "latency_ms"}
TINY_BYTES_PER_TOKEN = 2 * 4 * 4 * 64 * 4  # K and V, 4 layers, 4 heads of 64, fp32


def _kvviz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvviz", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _check_contract(obj: dict, n_prompt: int, n_new: int, cached: bool) -> None:
    assert set(obj) == RUN_KEYS
    assert all(set(s) == STEP_KEYS for s in obj["steps"])
    steps = obj["steps"]
    assert [s["step"] for s in steps] == list(range(n_new))
    assert [s["phase"] for s in steps] == ["prefill"] + ["decode"] * (n_new - 1)
    assert [s["token_id"] for s in steps] == obj["generated_ids"]
    assert [s["position"] for s in steps] == list(range(n_prompt, n_prompt + n_new))
    if cached:
        assert [s["input_len"] for s in steps] == [n_prompt] + [1] * (n_new - 1)
        assert [s["cache_len"] for s in steps] == list(range(n_prompt, n_prompt + n_new))
        assert [s["cache_bytes"] for s in steps] == [n * TINY_BYTES_PER_TOKEN for n in range(n_prompt, n_prompt + n_new)]
    else:
        assert [s["input_len"] for s in steps] == list(range(n_prompt, n_prompt + n_new))
        assert [s["cache_len"] for s in steps] == [0] * n_new and [s["cache_bytes"] for s in steps] == [0] * n_new
    assert all(isinstance(s["latency_ms"], float) and s["latency_ms"] > 0 for s in steps)


def test_generate_json_cached(random_models: dict[str, LoadedModel]) -> None:
    p = _kvviz("generate", "--model", "random:tiny", "--prompt", "Hello", "--max-new-tokens", "6", "--json")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 1  # one JSON object on stdout, nothing else
    obj = json.loads(lines[0])
    _check_contract(obj, 5, 6, cached=True)
    ref = kvviz.generate(random_models["tiny"], prompt="Hello", max_new_tokens=6)
    assert obj["model"] == "random:tiny" and obj["device"] == "cpu" and obj["use_cache"] is True
    assert obj["prompt_ids"] == list(b"Hello") and obj["generated_ids"] == ref.generated_ids
    assert obj["text"] == ref.text and obj["stop_reason"] == "max_new_tokens" and obj["engine"] == "fast"


def test_generate_no_fast_runs_the_readable_model_to_the_same_tokens(random_models: dict[str, LoadedModel]) -> None:
    p = _kvviz("generate", "--model", "random:tiny", "--prompt", "Hello", "--max-new-tokens", "6", "--no-fast",
               "--json")
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    _check_contract(obj, 5, 6, cached=True)
    assert obj["engine"] == "readable"
    assert obj["generated_ids"] == kvviz.generate(random_models["tiny"], prompt="Hello", max_new_tokens=6).generated_ids


def test_generate_json_uncached_sampling(random_models: dict[str, LoadedModel]) -> None:
    p = _kvviz("generate", "--model", "random:tiny", "--prompt-ids", "72,105,33", "--max-new-tokens", "5",
               "--no-cache", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3", "--json")
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    _check_contract(obj, 3, 5, cached=False)
    ref = kvviz.generate(random_models["tiny"], prompt=[72, 105, 33], max_new_tokens=5,
                         sampling=SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3),
                         cache=CacheSpec(use_cache=False))
    assert obj["use_cache"] is False and obj["generated_ids"] == ref.generated_ids


def test_generate_error_exits_2_without_traceback() -> None:
    p = _kvviz("generate", "--model", "random:tiny", "--prompt", "a" * 1020, "--max-new-tokens", "10", "--json")
    assert p.returncode == 2 and p.stdout == ""
    assert "kvviz generate: error:" in p.stderr and "Traceback" not in p.stderr
    assert all(n in p.stderr for n in ("1020", "10", "1024"))


def _main_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    return err


@pytest.mark.parametrize("extra, needle", [
    (["--prompt", "hi", "--max-new-tokens", "0"], "expected an integer from 1 to 1,048,576, got 0"),
    (["--prompt", "hi", "--max-new-tokens", "-4"], "expected an integer from 1 to"),
    (["--prompt", "hi", "--max-new-tokens", "many"], "expected an integer from 1 to"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt-ids", "1,x"], "comma-separated token ids"),
    (["--prompt-ids", "999"], r"[0, 256)"),
    (["--prompt", "hi", "--prompt-ids", "1"], "not allowed with argument"),
    (["--prompt", "hi", "--top-k", "5"], "need --temperature"),
    (["--prompt", "hi", "--greedy", "--temperature", "1"], "not allowed with argument"),
    (["--prompt", "hi", "--temperature", "nan"], "finite number"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--temperature", "1", "--top-p", "2"], "top_p"),
    (["--prompt", "hi", "--seed", "-1"], "expected an integer from 0 to"),
    (["--prompt", "hi", "--device", "tpu"], "invalid choice"),
])
def test_generate_bad_arguments(capsys: pytest.CaptureFixture[str], extra: list[str], needle: str) -> None:
    err = _main_error(capsys, "generate", "--model", "random:tiny", *extra)
    assert "kvviz generate: error:" in err and needle in err


@pytest.mark.parametrize("model, needle", [
    ("/no/such/model-folder", "does not exist"),
    ("random:nope", "unknown random shape"),
])
def test_generate_bad_model(capsys: pytest.CaptureFixture[str], model: str, needle: str) -> None:
    err = _main_error(capsys, "generate", "--model", model, "--prompt", "hi")
    assert "kvviz generate: error:" in err and needle in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_generate_cuda_unavailable(capsys: pytest.CaptureFixture[str]) -> None:
    err = _main_error(capsys, "generate", "--model", "random:tiny", "--prompt", "hi", "--device", "cuda")
    assert "no CUDA device" in err


def test_generate_plain_text_output(capsys: pytest.CaptureFixture[str], random_models: dict[str, LoadedModel]) -> None:
    assert main(["generate", "--model", "random:tiny", "--prompt-ids", "104,105", "--max-new-tokens", "4"]) == 0
    ref = kvviz.generate(random_models["tiny"], prompt=[104, 105], max_new_tokens=4)
    assert capsys.readouterr().out == ref.text + "\n"


def test_generate_help_says_what_each_output_holds(capsys: pytest.CaptureFixture[str],
                                                    random_models: dict[str, LoadedModel]) -> None:
    """The help said "report every step", yet without --json only the text is printed (issue 36):
    it now says the steps come with --json, and they do, one record per generated token."""
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "generate text (with --json: and every step's record)" in top and "report every step" not in top
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "every step (phase, position, cache length and bytes, latency); without it only the answer" in helptext
    args = ["generate", "--model", "random:tiny", "--prompt-ids", "104,105", "--max-new-tokens", "4"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert plain == obj["text"] + "\n" and len(obj["steps"]) == 4
    assert [s["position"] for s in obj["steps"]] == [2, 3, 4, 5] and "latency_ms" in obj["steps"][0]


def test_eval_json(capsys: pytest.CaptureFixture[str], tmp_path: Path, random_models: dict[str, LoadedModel]) -> None:
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 3
    f = tmp_path / "t.txt"
    f.write_text(text, encoding="utf-8")
    assert main(["eval", "--model", "random:tiny", "--text-file", str(f), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert {"bits_per_byte", "tokens", "bytes"} <= set(obj)
    n = len(text.encode("utf-8"))
    assert obj["tokens"] == n - 1 and obj["bytes"] == n - 1  # the first byte has no context
    assert 7.0 < obj["bits_per_byte"] < 9.5  # random weights: close to uniform (8 bits)
    assert main(["eval", "--model", "random:tiny", "--text-file", str(f), "--last-fraction", "0.5", "--json"]) == 0
    half = json.loads(capsys.readouterr().out)
    assert half["bytes"] == int(n * 0.5) - 1  # the last int(n * fraction) bytes are read


@pytest.mark.parametrize("extra, needle", [
    (["--text-file", "/no/such/file.txt"], "does not exist"),
    (["--text-file", "{f}", "--last-fraction", "0"], "--last-fraction must be in (0, 1]"),
    (["--text-file", "{f}", "--model", "random:tiny", "--device", "gpu"], "invalid choice"),
])
def test_eval_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str], needle: str) -> None:
    f = tmp_path / "t.txt"
    f.write_text("hello there", encoding="utf-8")
    err = _main_error(capsys, "eval", "--model", "random:tiny", *[a.replace("{f}", str(f)) for a in extra])
    assert "kvviz eval: error:" in err and needle in err


def test_the_subcommand_table_is_the_parser() -> None:
    """Every row of SUBCOMMANDS resolves to real functions, and the parser offers exactly those rows."""
    from kvviz.cli.main import SUBCOMMANDS, build_parser, resolve

    for cmd in SUBCOMMANDS:
        assert callable(resolve(cmd.add)) and callable(resolve(cmd.run)), cmd.name
    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert list(choices) == [c.name for c in SUBCOMMANDS] == [
        "app", "models", "generate", "chat", "bench", "bench-spec", "memory", "eval", "train", "kv-curves", "export",
        "watch", "serve-bench"]
