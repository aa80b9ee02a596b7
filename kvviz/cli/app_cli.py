"""``kvviz app [--port N]``: the Streamlit app, from wherever kvviz is installed.

``streamlit run`` reads ``.streamlit/config.toml`` from the working folder only, so from an
installed wheel the app's own settings would be lost (the file watcher that walks every folder,
the hidden tracebacks, the theme). Every setting of kvviz's config file (kvviz/paths.py finds the
checkout's or the wheel's copy) is passed as a ``--section.option`` flag instead, which outranks
any config file, and XSRF and CORS protection are passed on last so that no user config file
turns them off.
"""
from __future__ import annotations

import argparse
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import kvviz.cli.argtypes as types
from kvviz import paths
from kvviz.errors import KVVizError

PROTECTIONS = {"server.enableXsrfProtection": "true", "server.enableCORS": "true"}


def add_app_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=types.port, default=8501, help="the port to serve on (default 8501)")
    p.add_argument("--address", default="localhost",
                   help="the address to listen on (default localhost; 0.0.0.0 serves every network you are on)")
    p.add_argument("--print-command", action="store_true", help="print the streamlit command instead of running it")


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _flag_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


def config_flags(config: Path | None = None) -> list[str]:
    """kvviz's Streamlit settings as ``--section.option=value`` flags, the protections last."""
    path = config or paths.STREAMLIT_CONFIG
    try:
        settings = _flatten(tomllib.loads(path.read_text(encoding="utf-8")))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise KVVizError(f"cannot read the app's settings {path} ({e}); reinstall kvviz") from None
    settings.update(PROTECTIONS)
    return [f"--{k}={_flag_value(v)}" for k, v in settings.items()]


def streamlit_command(port: int, address: str = "localhost") -> list[str]:
    if not paths.APP_SCRIPT.is_file():
        raise KVVizError(f"the app script {paths.APP_SCRIPT} is missing; reinstall kvviz")
    return [sys.executable, "-m", "streamlit", "run", str(paths.APP_SCRIPT), *config_flags(),
            f"--server.port={port}", f"--server.address={address}"]


def run_app(args: argparse.Namespace) -> int:
    cmd = streamlit_command(args.port, args.address)
    if args.print_command:
        print(" ".join(cmd))
        return 0
    print(f"kvviz: serving the app on http://{args.address}:{args.port} (Ctrl-C stops it)", file=sys.stderr,
          flush=True)
    # Streamlit replaces this process (same pid), so a signal sent to `kvviz app` (Ctrl-C, a service
    # manager's SIGTERM) reaches the server itself: a child would be orphaned and keep the port.
    os.execv(cmd[0], cmd)
    return 0  # not reached
