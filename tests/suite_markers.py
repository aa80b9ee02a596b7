"""Which subset a test belongs to, from what its code does (tests/conftest.py marks with it).

A module name of its own: under ``pytest tests`` two folders hold a ``conftest``, and a test that
imports ``conftest`` may get the browser one.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import pytest


def _calls_subprocess(fn: Any) -> bool:
    try:
        return "subprocess." in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def starts_a_process(item: pytest.Item) -> bool:
    """The test's own code calls subprocess, or calls a helper (its module's or imported) that does."""
    fn, module = getattr(item, "function", None), getattr(item, "module", None)
    if fn is None or module is None:
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    if "subprocess." in ast.unparse(tree):
        return True
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return any(inspect.isfunction(h := getattr(module, name, None)) and _calls_subprocess(h) for name in called)
