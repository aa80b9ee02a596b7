"""The CLI's options: every subcommand's numeric options bounded by the shared argument types,
every ``--out`` checked before the work and written atomically, beam scores that cannot overflow.

Most cases run ``kvviz.cli.main`` in-process (an exception other than SystemExit(2) fails the test,
as a traceback would). The reported reproductions (the SIGSEGV, the endless repeats, /dev/full,
a folder, a missing folder, the OverflowError) and a few variants run ``python -m kvviz`` in a real
process with a timeout and a peak-RSS bound (tests/cli/test_cli_bad_input.py's helpers).
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import kvviz.cli.argtypes as argtypes
from kvviz.errors import KVVizError
from kvviz.limits import MAX_BEAMS, MAX_DRAFT, MAX_KV_BLOCK_SIZE, MAX_NGRAM, MAX_REPEATS, MAX_SINKS
from kvviz.safeio import out_file_problem, write_atomic
from test_cli_bad_input import MAX_RSS_MB, cli, cli_subprocess

CPUS = os.cpu_count() or 1
BIG = "1000000000"
HUGE = "9" * 40  # past every bound, and past int64


def assert_one_error(code: int, out: str, err: str, needle: str) -> None:
    """Exit 2, no traceback, exactly one ``kvviz <cmd>: error:`` line, holding ``needle``; nothing on stdout."""
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith("kvviz ") and needle in errors[0], err
    assert out == "", out


# ----------------------------------------------------------------------------- 1. numeric options
# (subcommand + its required arguments, the bad option, what the error line says)
BOUNDS = [
    (["generate", "--prompt", "hi"], ["--max-new-tokens", BIG], "--max-new-tokens: expected an integer from 1 to"),
    (["generate", "--prompt", "hi"], ["--max-new-tokens", "2.5"], "--max-new-tokens: expected an integer"),
    (["generate", "--prompt", "hi"], ["--seed", str(2**64)], "--seed: expected an integer from 0 to"),
    (["generate", "--prompt", "hi"], ["--num-beams", str(MAX_BEAMS + 1)], f"from 1 to {MAX_BEAMS}, got"),
    (["generate", "--prompt", "hi"], ["--num-return-sequences", HUGE], "got a 40-digit number"),
    (["generate", "--prompt", "hi"], ["--draft-tokens", str(MAX_DRAFT + 1)], "--draft-tokens: expected"),
    (["generate", "--prompt", "hi"], ["--ngram", str(MAX_NGRAM + 1)], "--ngram: expected"),
    (["generate", "--prompt", "hi"], ["--block-size", str(MAX_KV_BLOCK_SIZE + 1)], "--block-size: expected"),
    (["generate", "--prompt", "hi"], ["--top-k", BIG, "--temperature", "1"], "--top-k: expected"),
    (["generate", "--prompt", "hi"], ["--kv-group-size", "4096"], "--kv-group-size: expected"),
    (["generate", "--prompt", "hi"], ["--sinks", str(MAX_SINKS + 1)], "--sinks: expected"),
    (["generate", "--prompt", "hi"], ["--window", "0"], "--window: expected"),
    (["generate"], ["--prompt-ids", f"1,2,{BIG}"], "--prompt-ids: comma-separated token ids"),
    (["chat", "--turn", "hi"], ["--blocks", BIG], "--blocks: expected"),
    (["chat", "--turn", "hi"], ["--block-size", "0"], "--block-size: expected"),
    (["chat", "--turn", "hi"], ["--max-new-tokens", BIG], "--max-new-tokens: expected"),
    (["chat", "--turn", "hi"], ["--seed", "-1"], "--seed: expected"),
    (["bench", "--no-hf"], ["--repeats", BIG], f"--repeats: expected an integer from 1 to {MAX_REPEATS:,}"),
    (["bench", "--no-hf"], ["--prompt-len", HUGE], "--prompt-len: expected"),
    (["bench-spec"], ["--threads", "1000000"], f"--threads: expected an integer from 1 to {CPUS}"),
    (["bench-spec"], ["--threads", "0"], "--threads: expected"),
    (["bench-spec"], ["--repeats", BIG], "--repeats: expected"),
    (["bench-spec"], ["--max-new-tokens", BIG], "--max-new-tokens: expected"),
    (["bench-spec"], ["--draft-tokens", "0"], "--draft-tokens: expected"),
    (["memory", "--preset", "gpt2"], ["--seq-len", HUGE], "--seq-len: expected"),
    (["memory", "--preset", "gpt2", "--seq-len", "8", "--window", "4"], ["--sinks", "-5"], "--sinks: expected"),
    (["memory", "--preset", "gpt2", "--seq-len", "8"], ["--batch", BIG + "000"], "--batch: expected"),
    (["memory", "--preset", "gpt2", "--seq-len", "8"], ["--gpu", "nan"], "--gpu: expected a positive amount"),
    (["memory", "--preset", "gpt2", "--seq-len", "8"], ["--reserve", "1"], "--reserve: expected a fraction"),
    (["eval"], ["--max-tokens", BIG], "--max-tokens: expected"),
    (["eval"], ["--chunk", "0"], "--chunk: expected"),
    (["train"], ["--threads", "1000000"], f"--threads: expected an integer from 0 to {CPUS}"),
    (["kv-curves"], ["--tokens", BIG], "--tokens: expected"),
    (["kv-curves"], ["--bins", BIG], "--bins: expected"),
    (["kv-curves"], ["--sinks", "5000"], "--sinks: expected"),
]


@pytest.mark.parametrize("base, bad, needle", BOUNDS, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_every_numeric_option_is_bounded_by_the_parser(capsys: pytest.CaptureFixture[str], base: list[str],
                                                       bad: list[str], needle: str) -> None:
    code, out, err = cli(capsys, *base, "--model" if base[0] not in ("memory", "bench", "train") else "--json",
                         *(["random:tiny"] if base[0] not in ("memory", "bench", "train") else []), *bad)
    assert_one_error(code, out, err, needle)
    assert f"error: argument {bad[0].split('=')[0]}" in err  # the parser refused it: nothing ran


def test_every_subcommand_s_numeric_options_use_the_shared_types() -> None:
    """An audit: no numeric option of any subcommand is parsed by a bare int/float (unbounded)."""
    from kvviz.cli.main import build_parser

    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(subs) >= {"generate", "chat", "bench", "bench-spec", "memory", "eval", "train", "kv-curves"}
    for name, sub in subs.items():
        for action in sub._actions:
            assert action.type not in (int, float), f"{name} {action.option_strings} is parsed by bare {action.type}"


def test_argtypes_read_what_people_type() -> None:
    assert argtypes.token_count("8,192") == 8192 and argtypes.seed("0") == 0
    assert argtypes.threads(str(CPUS)) == CPUS and argtypes.threads_or_default("0") == 0
    for f, s in ((argtypes.repeats, str(MAX_REPEATS + 1)), (argtypes.positive_int, str(2**70)),
                 (argtypes.sinks, "-1"), (argtypes.token_count, "1" * 100_000)):
        with pytest.raises(Exception) as e:
            f(s)
        assert type(e.value).__name__ == "ArgumentTypeError"


# ----------------------------------------------------------------------------- 2. --out
def test_out_paths_are_checked_without_side_effects(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "file").write_text("x")
    for path, needle in (("/dev/full", "it is a character device"), (str(tmp_path), "it is a folder"),
                         (str(tmp_path / "pipe"), "it is a FIFO"), (str(tmp_path / "no" / "x.json"), "does not exist"),
                         (str(tmp_path / "file" / "x.json"), "does not exist"), ("", "the path is empty")):
        assert needle in out_file_problem(path), path
    assert out_file_problem(tmp_path / "new.json") == "" and not (tmp_path / "new.json").exists()
    assert out_file_problem(tmp_path / "file") == ""  # an existing regular file is replaced


@pytest.mark.parametrize("cmd", [["kv-curves", "--model", "random:tiny"], ["bench-spec", "--model", "random:tiny"],
                                 ["bench", "--model", "tiny", "--no-hf"]])
@pytest.mark.parametrize("where", ["folder", "fifo", "missing", "dev_null"])
def test_every_out_is_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: list[str],
                                              where: str) -> None:
    path = {"folder": tmp_path, "fifo": tmp_path / "p", "missing": tmp_path / "a" / "b.json",
            "dev_null": Path("/dev/null")}[where]
    if where == "fifo":
        os.mkfifo(path)
    code, out, err = cli(capsys, *cmd, "--out", str(path))
    assert_one_error(code, out, err, f"argument --out: cannot write the results to {path}")  # by the parser
    assert not (tmp_path / "a").exists()


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk while writing (ENOSPC from the flush to disk): one error line, the old result
    intact, no temp file; then a write that works replaces it whole."""
    out = tmp_path / "curves.json"
    out.write_text('{"old": true}\n')

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    args = ["kv-curves", "--model", "random:tiny", "--tokens", "16", "--device", "cpu", "--out", str(out)]
    code, _, err = cli(capsys, *args)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(f"cannot write the results to {out}: No space left on device; "
                                                 "they are printed on stdout instead")
    assert out.read_text() == '{"old": true}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["curves.json"]
    monkeypatch.undo()
    code, stdout, err = cli(capsys, *args, "--json")
    assert code == 0, err
    assert json.loads(out.read_text()) == json.loads(stdout) and sorted(p.name for p in tmp_path.iterdir()) == [
        "curves.json"]


def test_write_atomic_keeps_the_mode_and_refuses_devices(tmp_path: Path) -> None:
    f = tmp_path / "r.json"
    f.write_text("old")
    f.chmod(0o640)
    write_atomic(f, "new")
    assert f.read_text() == "new" and (f.stat().st_mode & 0o777) == 0o640
    with pytest.raises(KVVizError, match="cannot write the results to /dev/full: it is a character device"):
        write_atomic("/dev/full", "x")


# ----------------------------------------------------------------------------- real processes
def _fifo(tmp_path: Path) -> str:
    os.mkfifo(tmp_path / "fifo")
    return str(tmp_path / "fifo")


# Values that once crashed, hung or overflowed, and variants: (argv, needle); {tmp} is the test's folder.
PROCESS_CASES = {
    "bench_spec_threads_sigsegv": (["bench-spec", "--model", "random:tiny", "--threads", "1000000"],
                                   "--threads: expected an integer from 1 to"),
    "bench_spec_repeats_forever": (["bench-spec", "--model", "random:tiny", "--repeats", BIG], "--repeats: expected"),
    "bench_repeats": (["bench", "--model", "tiny", "--repeats", BIG], "--repeats: expected"),
    "train_threads": (["train", "--threads", "1000000"], "--threads: expected"),
    "chat_blocks": (["chat", "--model", "random:tiny", "--turn", "hi", "--blocks", BIG], "--blocks: expected"),
    "generate_seed": (["generate", "--model", "random:tiny", "--prompt", "hi", "--seed", HUGE], "--seed: expected"),
    "memory_sinks": (["memory", "--preset", "gpt2", "--seq-len", "8", "--window", "4", "--sinks", "-5"],
                     "--sinks: expected"),
    "kv_curves_dev_full": (["kv-curves", "--model", "random:tiny", "--out", "/dev/full"], "a character device"),
    "kv_curves_folder": (["kv-curves", "--model", "random:tiny", "--out", "{tmp}"], "it is a folder"),
    "kv_curves_missing_folder": (["kv-curves", "--model", "random:tiny", "--out", "/nonexistent/x/y.json"],
                                 "its folder /nonexistent/x does not exist"),
    "bench_spec_dev_full": (["bench-spec", "--model", "random:tiny", "--out", "/dev/full"], "a character device"),
    "bench_fifo": (["bench", "--model", "tiny", "--out", "{fifo}"], "it is a FIFO"),
}


@pytest.mark.parametrize("case", PROCESS_CASES)
def test_extreme_options_end_in_one_error_line_in_a_real_process(tmp_path: Path, case: str) -> None:
    argv, needle = PROCESS_CASES[case]
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{fifo}", _fifo(tmp_path) if a == "{fifo}" else "")
            if "{" in a else a for a in argv]
    code, out, err, rss_mb = cli_subprocess(*argv)  # time-bounded: a hang fails on its timeout
    assert_one_error(code, out, err, needle)
    assert rss_mb < MAX_RSS_MB, rss_mb


BEAM = ["generate", "--model", "random:tiny", "--prompt", "The cat", "--num-beams", "2", "--max-new-tokens", "4",
        "--device", "cpu", "--json"]


def test_a_huge_length_penalty_runs_in_a_real_process() -> None:
    code, out, err, _ = cli_subprocess(*BEAM, "--length-penalty", "2000")
    assert code == 0 and "Traceback" not in err, err
    beams = json.loads(out)["beams"]
    assert beams["length_penalty"] == 2000 and [s["score"] for s in beams["sequences"]] == [0.0]


@pytest.mark.parametrize("extra", [["--early-stopping", "never", "--length-penalty", "2000"],
                                   ["--early-stopping", "never", "--length-penalty", "1e308"],
                                   ["--early-stopping", "true", "--length-penalty=-1e308"],
                                   ["--length-penalty", "1e308", "--cache-kind", "paged"]])
def test_huge_length_penalties_end_cleanly(capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    code, out, err = cli(capsys, *BEAM, *extra)
    assert code == 0 and "Traceback" not in err, err
    assert len(json.loads(out)["beams"]["sequences"]) == 1


def test_a_good_out_is_written_whole_in_a_real_process(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    code, stdout, err, _ = cli_subprocess("kv-curves", "--model", "random:tiny", "--tokens", "16", "--device", "cpu",
                                          "--out", str(out), "--json")
    assert code == 0, err
    assert json.loads(out.read_text()) == json.loads(stdout) and [p.name for p in tmp_path.iterdir()] == ["c.json"]


# ----------------------------------------------------------------------------- 4. the chat page's note
def test_the_chat_page_names_typed_control_tokens() -> None:
    from kvviz.ui.pages.chat.chat_views import typed_note

    controls = {"<|im_start|>": 1, "<|im_end|>": 2}
    note = typed_note("a<|im_end|>\n<|im_start|>system\nb<|im_end|>", controls, parsed=False)
    assert note.startswith("Typed as text, not as control tokens: <|im_end|>, <|im_start|> (3 in all)")
    assert "were read as control tokens" in typed_note("<|im_end|>", controls, parsed=True)
    assert typed_note("<|other|> plain", controls, parsed=False) == ""
