"""Issue 37, class 2: results are never lost after the work.

``--out`` is checked by doing before the work (a temp file created beside the target, written and
removed; kernel pseudo-filesystems refused by what statfs says; a dangling symbolic link refused, a
link to a file followed), and when the final write still fails the results go to stdout.
"""
from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

import pytest

from kvviz.errors import KVVizError, ResultsNotSaved
from kvviz.safeio import fs_type, out_file_problem, pseudo_fs, save_results, write_atomic
from test_cli_bad_input import cli, cli_subprocess
from test_cli_options import assert_one_error

CURVES = ["kv-curves", "--model", "random:tiny", "--tokens", "16", "--device", "cpu"]


# ----------------------------------------------------------------------------- pseudo-filesystems
@pytest.mark.parametrize("path, fs", [("/proc/version", "proc"), ("/proc/self/x.json", "proc"),
                                      ("/sys/kernel/x.json", "sysfs")])
def test_kernel_pseudo_files_are_refused_by_statfs(path: str, fs: str) -> None:
    """/proc/version is a regular file to stat() and root passes os.access on /proc, so only
    statfs (f_type 0x9fa0 proc, 0x62656572 sysfs) says it is no place for results."""
    assert pseudo_fs(os.path.dirname(path)) == fs
    assert out_file_problem(path) == (f"its folder {os.path.dirname(path)} is on {fs}, a kernel "
                                      "pseudo-filesystem, not a place for files")


def test_an_ordinary_folder_is_not_a_pseudo_filesystem(tmp_path: Path) -> None:
    assert fs_type(tmp_path) is not None and pseudo_fs(tmp_path) == ""
    assert out_file_problem(tmp_path / "r.json") == "" and list(tmp_path.iterdir()) == []  # the probe is gone


@pytest.mark.parametrize("cmd", [["bench-spec", "--model", "random:tiny", "--repeats", "1", "--max-new-tokens", "4"],
                                 ["bench", "--model", "tiny", "--no-hf"], CURVES])
@pytest.mark.parametrize("path", ["/proc/version", "/sys/kernel/x.json"])
def test_the_reported_paths_are_refused_before_any_work(capsys: pytest.CaptureFixture[str], cmd: list[str],
                                                        path: str) -> None:
    code, out, err = cli(capsys, *cmd, "--out", path)
    assert_one_error(code, out, err, f"argument --out: cannot write the results to {path}: its folder")


def test_the_reported_bench_spec_is_refused_in_a_real_process() -> None:
    code, out, err, _ = cli_subprocess("bench-spec", "--model", "random:tiny", "--repeats", "1", "--max-new-tokens",
                                       "4", "--out", "/proc/version")
    assert_one_error(code, out, err, "is on proc, a kernel pseudo-filesystem")


def test_train_refuses_a_pseudo_filesystem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50)
    code, _, err = cli(capsys, "train", "--corpus", str(corpus), "--out", "/proc/kvviz-model", "--device", "cpu")
    assert code == 2 and "--out /proc/kvviz-model is on proc, a kernel pseudo-filesystem" in err, err


# ----------------------------------------------------------------------------- checked by doing
def test_a_folder_that_takes_no_new_file_is_refused_by_trying(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What root's os.access cannot see (a read-only mount, a full inode table): the probe's own
    mkstemp fails, and that is the reason given."""
    def refuse(*args: object, **kwargs: object) -> tuple[int, str]:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    assert out_file_problem(tmp_path / "r.json") == (f"a file cannot be created in its folder {tmp_path} "
                                                     "(Read-only file system)")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a 0o500 folder")
def test_a_read_only_folder_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert "a file cannot be created in its folder" in out_file_problem(ro / "r.json")


# ----------------------------------------------------------------------------- symbolic links
def test_a_dangling_link_is_refused_and_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    link = tmp_path / "r.json"
    link.symlink_to(tmp_path / "gone" / "r.json")
    code, out, err = cli(capsys, *CURVES, "--out", str(link))
    assert_one_error(code, out, err, f"it is a symbolic link to {tmp_path / 'gone' / 'r.json'}, which does not exist")
    assert link.is_symlink() and os.readlink(link) == str(tmp_path / "gone" / "r.json")


def test_a_link_to_a_file_is_followed_and_stays_a_link(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "r.json"
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "real.json"]


# ----------------------------------------------------------------------------- results never lost
def test_save_results_hands_back_the_text_when_the_write_fails(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(src: str, dst: str) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(ResultsNotSaved) as e:
        save_results(tmp_path / "r.json", '{"a": 1}\n')
    assert e.value.text == '{"a": 1}\n' and isinstance(e.value, KVVizError)
    assert str(e.value).endswith("Invalid cross-device link; they are printed on stdout instead")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("as_json", [False, True])
def test_results_go_to_stdout_when_the_final_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    """The disk fills after the check and before the write: the measured curves are printed on
    stdout (one JSON object, equal to what a good run writes) and the error says so."""
    good = tmp_path / "good.json"
    code, _, err = cli(capsys, *CURVES, "--out", str(good))
    assert code == 0, err
    out = tmp_path / "curves.json"

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    code, stdout, err = cli(capsys, *CURVES, "--out", str(out), *(["--json"] if as_json else []))
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].endswith(
        f"cannot write the results to {out}: No space left on device; they are printed on stdout instead")
    printed, written = json.loads(stdout), json.loads(good.read_text())
    printed.pop("seconds"), written.pop("seconds")  # wall-clock times differ; every measured value is the same
    assert printed == written and "perplexity" in printed  # the random:tiny weights are seeded: same curves
    assert not out.exists()


def test_the_training_summary_goes_to_stdout_when_it_cannot_be_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import kvviz.safeio as safeio

    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world, the sea is calm tonight\n" * 40)
    real = safeio.write_atomic

    def no_summary(path: Path | str, data: str | bytes, label: str = "the results") -> None:
        if str(path).endswith("training.json"):
            raise KVVizError(f"cannot write {label} to {path}: No space left on device")
        real(path, data, label)

    monkeypatch.setattr(safeio, "write_atomic", no_summary)
    code, stdout, err = cli(capsys, "train", "--corpus", str(corpus), "--out", str(tmp_path / "m"), "--device", "cpu",
                            "--n-layer", "1", "--n-head", "1", "--n-embd", "8", "--block-size", "8", "--batch-size", "2",
                            "--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--no-final-eval",
                            "--no-progress")
    assert code == 2 and "the training summary" in err and "printed on stdout instead" in err, err
    summary = json.loads(stdout)
    assert summary["steps"] == 2 and summary["model"]["n_embd"] == 8 and not (tmp_path / "m" / "training.json").exists()


def test_a_model_that_cannot_be_saved_names_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The disk fills at the final save: one error line naming the checkpoint to resume from, no traceback."""
    import errno as _errno

    import kvviz.train as train_module

    def full(model: object, folder: object) -> None:
        raise OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC))

    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world, the sea is calm tonight\n" * 40)
    monkeypatch.setattr(train_module, "save_model", full)
    code, _, err = cli(capsys, "train", "--corpus", str(corpus), "--out", str(tmp_path / "m"), "--device", "cpu",
                       "--n-layer", "1", "--n-head", "1", "--n-embd", "8", "--block-size", "8", "--batch-size", "2",
                       "--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--no-final-eval", "--no-progress")
    assert code == 2 and "Traceback" not in err, err
    assert (f"cannot save the trained model to {tmp_path / 'm'}: No space left on device; the checkpoint of step 2 "
            f"is in {tmp_path / 'm' / 'train_state'} (rerun with --resume)") in err
    assert (tmp_path / "m" / "train_state" / "state.safetensors").is_file()


def test_a_checkpoint_that_cannot_be_saved_mid_run_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The disk fills at the second checkpoint: one error line naming the first one, no traceback."""
    import errno as _errno

    import kvviz.train as train_module

    save_state, calls = train_module._save_state, []

    def fills_up(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) > 1:
            raise OSError(_errno.ENOSPC, os.strerror(_errno.ENOSPC))
        save_state(*args, **kwargs)

    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world, the sea is calm tonight\n" * 40)
    monkeypatch.setattr(train_module, "_save_state", fills_up)
    code, _, err = cli(capsys, "train", "--corpus", str(corpus), "--out", str(tmp_path / "m"), "--device", "cpu",
                       "--n-layer", "1", "--n-head", "1", "--n-embd", "8", "--block-size", "8", "--batch-size", "2",
                       "--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--no-final-eval", "--no-progress")
    state = tmp_path / "m" / "train_state"
    assert code == 2 and "Traceback" not in err, err
    assert (f"cannot save the step-4 checkpoint to {state}: No space left on device; the checkpoint of step 2 stays "
            f"in {state} (free space, then rerun with --resume)") in err
