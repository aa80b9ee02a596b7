"""Bad input to the calculator: hostile config files and link settings, in the CLI and the page.

(5) ``memory --config`` and the pasted/uploaded config: huge integers, devices, FIFOs, folders,
non-UTF-8 bytes and absurd nesting each give one named problem: exit 2 in the CLI, st.error on
the page; never a traceback, never a hang, never an unbounded read.
(3) Link settings and every user or config value are shown as plain text: no image, no link.
"""
from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from streamlit.testing.v1 import AppTest

from kvviz.cli.main import main
from kvviz.calculator import MAX_CONFIG_BYTES, ConfigError, load_config_file, parse_config_text
from kvviz.ui.common.plain_text import md_plain, unescape

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
HUGE_INT = "9" * 5000
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    """A hang is a failure, not a stuck suite: SIGALRM interrupts a blocking open or read.

    It detects a hang (a FIFO's open blocks forever, /dev/zero never ends), not a speed: each check
    parses a few bytes, so a minute holds at any load."""
    def stop(signum: int, frame: object) -> None:
        raise TimeoutError("hung for 60 s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def cli_error(capsys: pytest.CaptureFixture[str], path: Path | str, *extra: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["memory", "--config", str(path), "--seq-len", "1", "--json", *extra])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "kvviz memory: error:" in err and "Traceback" not in err
    return err


def write(tmp_path: Path, data: str | bytes, name: str = "config.json") -> Path:
    p = tmp_path / name
    p.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return p


# ----------------------------------------------------------------------------- the CLI
def test_5000_digit_integer(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = cli_error(capsys, write(tmp_path, json.dumps(LLAMA)[:-1] + f', "vocab_size": {HUGE_INT}}}'))
    assert "integer with more than 4,300 digits" in err


def test_dev_zero_is_refused_without_reading(capsys: pytest.CaptureFixture[str]) -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero here")
    assert "is a character device, not a regular file" in cli_error(capsys, "/dev/zero")


def test_symlink_to_a_device_is_judged_by_what_it_opens(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero here")
    link = tmp_path / "config.json"
    link.symlink_to("/dev/zero")
    assert "character device" in cli_error(capsys, link)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifo_is_refused_without_blocking(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    assert "is a named pipe (FIFO), not a regular file" in cli_error(capsys, fifo)


def test_odd_paths(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "not a valid path (it holds a NUL character)" in cli_error(capsys, "con\x00fig.json")
    assert "File name too long" in cli_error(capsys, tmp_path / ("x" * 5000))
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    assert "cannot be opened" in cli_error(capsys, loop)


def test_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "is a folder, not a config.json file" in cli_error(capsys, tmp_path)


def test_non_utf8_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = cli_error(capsys, write(tmp_path, b'{"model_type": "\xff\xfe"}'))
    assert "is not UTF-8 text (byte 16 is 0xff)" in err


def test_nesting_100000_deep(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "nested too deeply" in cli_error(capsys, write(tmp_path, DEEP))
    assert "nested too deeply" in cli_error(capsys, write(tmp_path, '{"a": ' * 100_000 + "1" + "}" * 100_000))


def test_oversized_and_empty_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert f"a config.json is at most {MAX_CONFIG_BYTES:,} bytes" in cli_error(
        capsys, write(tmp_path, " " * (MAX_CONFIG_BYTES + 1)))
    assert "is empty" in cli_error(capsys, write(tmp_path, ""))


@pytest.mark.parametrize("value,message", [
    ("NaN", "must be an integer (got nan)"), ("1e400", "must be an integer (got inf)"),
    ("[" * 500 + "]" * 500, "must be an integer (got a JSON array of 1 items)"),
    ('"' + "x" * 100_000 + '"', "must be an integer (got '" + "x" * 36 + "...)"),
])
def test_absurd_values_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path, value: str, message: str) -> None:
    text = json.dumps(LLAMA)[:-1] + f', "num_key_value_heads": {value}}}'
    assert f"num_key_value_heads {message}" in cli_error(capsys, write(tmp_path, text))


def test_the_reader_caps_bytes_when_the_size_lies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # /proc files and devices report st_size 0: the cap must hold whatever fstat says.
    p = write(tmp_path, " " * (MAX_CONFIG_BYTES + 10))
    real_fstat = os.fstat

    def lying_fstat(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, 0,
                               st.st_atime, st.st_mtime, st.st_ctime))

    monkeypatch.setattr(os, "fstat", lying_fstat)
    with pytest.raises(ConfigError, match="more than 1,000,000 bytes"):
        load_config_file(p)


def test_parse_errors_are_config_errors_for_bytes_and_text() -> None:
    for data in (HUGE_INT, "{" + f'"x": {HUGE_INT}' + "}", DEEP, b"\x80", "", "nul\x00l"):
        with pytest.raises(ConfigError):
            parse_config_text(data)


# ----------------------------------------------------------------------------- the page
def _script() -> None:
    from kvviz.ui.pages.calculator.calculator import page

    page()


def page(**query: str) -> AppTest:
    at = AppTest.from_function(_script, default_timeout=60)
    for k, v in query.items():
        at.query_params[k] = v
    return at.run()


def inert(markdown: str) -> bool:
    """Renders to no link and no image, and keeps no autolink trigger once the escapes are gone."""
    html = MarkdownIt("commonmark").render(markdown)
    plain = markdown.replace("\\", "")
    return "<a " not in html and "<img" not in html and "://" not in plain and "www." not in plain


def every_text(at: AppTest) -> list[str]:
    return [e.value for kind in ("warning", "error", "caption", "markdown", "info") for e in at.get(kind)]


def test_link_settings_are_echoed_as_plain_text() -> None:
    image, phish = "![](http://evil.example/x.png)", "[Session expired: click here](https://evil.example/login)"
    at = page(mem_seq_len=image, mem_batch=phish, mem_gpu=HUGE_INT, mem_compare="www.evil.example,x@evil.example")
    assert not at.exception and at.metric  # the page still computes, with the defaults
    warned = [w.value for w in at.warning]
    assert len(warned) == 4 and all(inert(w) for w in warned)
    shown = [unescape(w) for w in warned]
    assert any(f"mem_seq_len={image!r}" in w for w in shown)
    assert any(f"mem_batch={phish[:40]!r}" in w for w in shown)
    assert all(inert(t) for t in every_text(at) if "evil" in t.replace("\\", ""))


def test_pasted_config_values_are_plain_text() -> None:
    at = page(mem_source="import")
    cfg = {**LLAMA, "model_type": "https://evil.example/<b>x</b>", "_name_or_path": "![x](http://evil.example/x.png)"}
    at.text_area(key="mem_config_text").input(json.dumps(cfg)).run()
    assert not at.exception and not at.error and at.metric
    hostile = [t for t in every_text(at) if "evil" in t.replace("\\", "")]
    assert len(hostile) >= 2 and all(inert(t) for t in hostile)  # the name and the note: shown, as text


@pytest.mark.parametrize("text,problem", [
    ('{"num_hidden_layers": ' + HUGE_INT + "}", "more than 4,300 digits"),
    (DEEP, "nested too deeply"),
    ("[1]", "must hold a JSON object"),
])
def test_pasted_config_failures_are_named(text: str, problem: str) -> None:
    at = page(mem_source="import")
    at.text_area(key="mem_config_text").input(text).run()
    assert not at.exception and len(at.error) == 1 and not at.metric
    assert problem in unescape(at.error[0].value)


def test_uploaded_config_failures_are_named_and_file_names_are_plain() -> None:
    at = page(mem_source="import")
    name = "[click](https://evil.example).json"
    at.get("file_uploader")[0].set_value((name, b'{"model_type": "\xff"}', "application/json")).run()
    assert not at.exception and len(at.error) == 1
    msg = at.error[0].value
    assert "is not UTF-8 text" in unescape(msg) and name in unescape(msg) and inert(msg)
    at.get("file_uploader")[0].set_value(("config.json", json.dumps(LLAMA).encode(), "application/json")).run()
    assert not at.exception and not at.error and at.metric


def test_md_plain_round_trips_and_cuts() -> None:
    for s in ("a_b*c", "<script>x</script>", "$x$ :red[y] :material/home:", "[a](b) ![c](d)", "a@b.co www.x.y"):
        assert unescape(md_plain(s)) == s and inert(md_plain(s))
    assert unescape(md_plain("x" * 50, 10)) == "x" * 9 + "…"
    assert "\n" not in md_plain("two\nlines")
