"""Bad input through the CLI: every bad input ends in one ``kvviz <cmd>: error: ...`` line (exit 2).

Most cases run ``kvviz.cli.main`` in-process (any exception but SystemExit(2) fails the test, the
same as a traceback would). The cases where a traceback, a hang or memory would only show in a
real process run ``python -m kvviz`` in a subprocess with a timeout, reporting its peak RSS.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from kvviz import LoadedModel
from kvviz.cli.main import main
from kvviz.engine.loading.loader import SHAKESPEARE_DIR
from kvviz.engine.loading.save import save_model

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60  # a case that needs this long has hung: each one finishes in seconds
MAX_RSS_MB = 600  # torch + the CLI is ~300 MB; these cases once went past 3 GB

# Runs the CLI and reports the process's own peak RSS on stderr, even after sys.exit. VmHWM, not
# getrusage's ru_maxrss: Linux carries ru_maxrss across fork + exec, so a child of a large pytest
# process (SmolLM2 loaded earlier in the session) would report the parent's size.
_WRAPPER = ("import atexit, runpy, sys\n"
            "def _hwm():\n"
            "    with open('/proc/self/status') as f:\n"
            "        return next(int(l.split()[1]) for l in f if l.startswith('VmHWM:'))\n"
            "atexit.register(lambda: print('PEAK_RSS_KB', _hwm(), file=sys.stderr))\n"
            "sys.argv = ['kvviz'] + sys.argv[1:]\n"
            "runpy.run_module('kvviz', run_name='__main__')\n")


def cli_subprocess(*args: str) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr without the RSS line, peak RSS in MB) of ``python -m kvviz ARGS``."""
    p = subprocess.run([sys.executable, "-c", _WRAPPER, *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    lines = p.stderr.splitlines()
    rss = [int(line.split()[1]) for line in lines if line.startswith("PEAK_RSS_KB")]
    err = "\n".join(line for line in lines if not line.startswith("PEAK_RSS_KB"))
    return p.returncode, p.stdout, err, (rss[-1] / 1024 if rss else float("nan"))


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``kvviz.cli.main(args)`` in this process."""
    try:
        code = main(list(args))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvviz ") and ": error: " in last and needle in last, err


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory, make_model: Callable[..., LoadedModel]) -> Path:
    folder = tmp_path_factory.mktemp("m") / "good"
    save_model(make_model().model, folder)
    return folder / "model.safetensors"


def folder(root: Path, weights: Path | None, config: Any, name: str = "bad") -> Path:
    f = root / name
    f.mkdir()
    if weights is not None:
        os.link(weights, f / "model.safetensors")
    (f / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return f


GOOD = dict(model_type="kvviz-gpt", vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32)


# ----------------------------------------------------------------------------- model folders
@pytest.mark.parametrize("config, needle", [
    ({**GOOD, "eos_token_id": "abc"}, "eos_token_id must be a token id"),
    ({**GOOD, "layer_norm_epsilon": "abc"}, "layer_norm_epsilon must be a number"),
    ({**GOOD, "layer_norm_epsilon": -1.0}, "layer_norm_epsilon must be a number"),
    ({**GOOD, "bias": "no"}, "bias must be true or false"),
    ({"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_layer": 2, "n_head": 4, "n_embd": 32,
      "eos_token_id": {"x": 1}}, "eos_token_id must be a token id"),
    ({"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_layer": 2, "n_head": 4, "n_embd": 32,
      "n_inner": "big"}, "n_inner='big' is not supported"),
    ({**GOOD, "model_type": ["gpt2"]}, "model_type ['gpt2'] is not supported"),
    ("[" * 100_000 + "]" * 100_000, "nested 100,000 levels deep"),
    ('{"model_type": "kvviz-gpt", "n_layer": ' + "7" * 5000 + "}", "5,000-digit integer"),
    ({**GOOD, "n_layer": 3}, "does not match its config.json: missing tensors: transformer.h.2"),
    ({**GOOD, "n_embd": 64}, "c_attn.weight has shape (32, 96), config.json implies (64, 192)"),
])
def test_bad_model_folders(tmp_path: Path, weights: Path, capsys: pytest.CaptureFixture[str], config: Any,
                           needle: str) -> None:
    f = folder(tmp_path, weights, config)
    code, out, err = cli(capsys, "generate", "--model", str(f), "--prompt", "hi", "--json")
    assert_refused(code, err, needle)
    assert out == ""


def test_model_paths_get_precise_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.mkfifo(tmp_path / "pipe")
    for model, needle in (("", "no model given"), (str(tmp_path / "pipe"), "is a FIFO (named pipe), not a folder"),
                          ("/dev/null", "is a character device, not a folder"),
                          (str(tmp_path / "missing"), "does not exist")):
        code, _, err = cli(capsys, "generate", "--model", model, "--prompt", "hi")
        assert_refused(code, err, needle)


# In subprocesses: the hostile files that once crashed or hung, with a timeout and the peak RSS.
@pytest.mark.parametrize("case", ["bigint", "deep", "million_layers", "fifo_config", "dev_zero_config"])
def test_hostile_files_in_a_real_process(tmp_path: Path, weights: Path, case: str) -> None:
    if case == "bigint":
        f, needle = folder(tmp_path, None, '{"model_type": "kvviz-gpt", "n_layer": ' + "9" * 5000 + "}"), "5,000-digit"
    elif case == "deep":
        f, needle = folder(tmp_path, None, "[" * 100_000 + "]" * 100_000), "nested"
    elif case == "million_layers":
        f, needle = folder(tmp_path, weights, {**GOOD, "n_layer": 1_000_000}), "n_layer is 1,000,000"
    else:
        f = tmp_path / "bad"
        f.mkdir()
        if case == "fifo_config":
            os.mkfifo(f / "config.json")
            needle = "config.json is a FIFO"
        else:
            os.symlink("/dev/zero", f / "config.json")
            needle = "config.json is a character device"
    code, out, err, rss_mb = cli_subprocess("generate", "--model", str(f), "--prompt", "hi", "--json")
    assert_refused(code, err, needle)
    assert rss_mb < MAX_RSS_MB, f"{rss_mb:.0f} MB"


def test_a_config_that_lies_about_layers_allocates_nothing(tmp_path: Path, weights: Path) -> None:
    """Within the bounds (100 layers of 1024: 1.3B parameters), over 4-layer weights: refused from the header."""
    f = folder(tmp_path, weights, {**GOOD, "n_layer": 100, "n_embd": 1024, "n_head": 16})
    code, _, err, rss_mb = cli_subprocess("generate", "--model", str(f), "--prompt", "hi")
    assert_refused(code, err, "does not match its config.json")
    assert rss_mb < MAX_RSS_MB, f"{rss_mb:.0f} MB"


# ----------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("args", [["--temperature", "1e-45"], ["--temperature", "0.7", "--top-p", "1e-300"],
                                  ["--temperature", "1e-320", "--top-k", "1", "--top-p", "1e-300"]])
def test_extreme_sampling_values_generate(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    code, out, err = cli(capsys, "generate", "--model", "random:tiny", "--prompt", "hi", "--max-new-tokens", "3",
                         "--device", "cpu", "--json", *args)
    assert code == 0, err
    assert len(json.loads(out)["generated_ids"]) == 3


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "nan"], "expected a finite number"),
    (["--temperature", "-1"], "temperature must be in"),
    (["--temperature", "1e9"], "temperature must be in"),
    (["--temperature", "1", "--top-p", "0"], "top_p must be in"),
    (["--temperature", "1", "--top-p", "2"], "top_p must be in"),
])
def test_out_of_range_sampling_values_are_refused(capsys: pytest.CaptureFixture[str], args: list[str],
                                                  needle: str) -> None:
    code, _, err = cli(capsys, "generate", "--model", "random:tiny", "--prompt", "hi", "--device", "cpu", *args)
    assert_refused(code, err, needle)


def test_a_model_that_overflows_says_nan_at_its_step(tmp_path: Path, weights: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(weights))
    sd["transformer.h.1.ln_2.weight"].fill_(3e38)  # finite, but float32 overflows on the first step
    f = folder(tmp_path, None, (weights.parent / "config.json").read_text())
    save_file(sd, str(f / "model.safetensors"))
    for args in ([], ["--temperature", "0.9"]):
        code, out, err = cli(capsys, "generate", "--model", str(f), "--prompt", "hi", "--max-new-tokens", "4", "--json",
                             *args)
        assert_refused(code, err, "the model produced NaN at step 0, first in layer 1 (transformer.h.1.ln_2)")
        assert "device" not in err.strip().splitlines()[-1] and out == ""


# ----------------------------------------------------------------------------- eval
def test_eval_json_reports_dropped_bytes_and_refuses_odd_files(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(b"To be, or not to be \xff\xfe that is the question\n" * 4)
    code, out, err = cli(capsys, "eval", "--model", "random:tiny", "--text-file", str(text), "--device", "cpu",
                         "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["dropped_bytes"] == 8 and all(isinstance(v, (int, float)) for v in res.values())
    os.mkfifo(tmp_path / "pipe")
    for path, needle in ((tmp_path / "pipe", "is a FIFO"), (Path("/dev/zero"), "is a character device"),
                         (tmp_path / "none.txt", "does not exist"), (tmp_path, "is a folder")):
        code, _, err = cli(capsys, "eval", "--model", "random:tiny", "--text-file", str(path), "--json")
        assert_refused(code, err, needle)


# ----------------------------------------------------------------------------- train
@pytest.mark.parametrize("args, needle", [
    (["--batch-size", "1000000000"], "--batch-size must be an integer in [1, 4,096]"),
    (["--n-layer", "1000000000"], "n_layer is 1,000,000,000"),
    (["--block-size", "1000000000"], "block_size is 1,000,000,000"),
    (["--threads", "1000000"], "argument --threads: expected an integer from 0 to"),
    (["--n-embd", "16384", "--n-layer", "200", "--n-head", "16"], "parameters; kvviz allows at most"),
    (["--batch-size", "4096", "--block-size", "131072"], "for training"),
    (["--lr", "0"], "--lr must be a number in (0, 10]"),
    (["--eval-batches", "100000000"], "--eval-batches must be an integer"),
])
def test_train_refuses_absurd_sizes_up_front(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                             needle: str) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50)
    code, _, err = cli(capsys, "train", "--corpus", str(corpus), "--out", str(tmp_path / "out"), "--device", "cpu",
                       *args)
    assert_refused(code, err, needle)
    assert not (tmp_path / "out").exists()  # refused before anything was created


def test_train_checks_out_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = cli(capsys, "train", "--corpus", str(corpus), "--out", str(a_file), "--device", "cpu")
    assert_refused(code, err, "is a regular file, not a folder")
    code, _, err = cli(capsys, "train", "--corpus", str(corpus), "--out", str(a_file / "sub"), "--device", "cpu")
    assert_refused(code, err, "is not writable")
    code, _, err = cli(capsys, "train", "--corpus", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o"))
    assert_refused(code, err, "does not exist")


def test_a_bare_train_never_targets_the_shipped_model() -> None:
    from kvviz.cli.main import build_parser

    args = build_parser().parse_args(["train", "--corpus", "c.txt"])
    assert Path(args.out).resolve() != SHAKESPEARE_DIR.resolve()


# ----------------------------------------------------------------------------- GGUF files (kvviz/engine/loading/gguf_llama.py)
def _gguf_header(tensors: int, kvs: int) -> bytes:
    return b"GGUF" + (3).to_bytes(4, "little") + tensors.to_bytes(8, "little") + kvs.to_bytes(8, "little")


@pytest.mark.parametrize("case", ["fifo", "dev_zero", "folder", "empty", "junk", "lying_counts", "truncated_kv"])
def test_bad_gguf_paths_in_a_real_process(tmp_path: Path, case: str) -> None:
    """Whatever sits at a .gguf path: one error line, no traceback, no hang, bounded memory."""
    path = tmp_path / "model.gguf"
    if case == "fifo":
        os.mkfifo(path)
    elif case == "dev_zero":
        os.symlink("/dev/zero", path)
    elif case == "folder":
        path.mkdir()
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "junk":
        path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 64)
    elif case == "lying_counts":  # 2^62 tensors and key-values promised by a 24-byte file
        path.write_bytes(_gguf_header(2**62, 2**62))
    else:  # one key-value whose string length claims 2^60 bytes
        path.write_bytes(_gguf_header(0, 1) + (4).to_bytes(8, "little") + b"name" + (8).to_bytes(4, "little")
                         + (2**60).to_bytes(8, "little") + b"x" * 16)
    code, out, err, rss_mb = cli_subprocess("generate", "--model", str(path), "--prompt", "hi", "--json")
    assert code == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvviz generate: error: "), err
    assert out == "" and rss_mb < MAX_RSS_MB, (out, rss_mb)
