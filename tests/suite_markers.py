"""Which subset a test belongs to, from what its code does (tests/conftest.py marks with it).

A module name of its own: under ``pytest tests`` two folders hold a ``conftest``, and a test that
imports ``conftest`` may get the browser one.
"""
from __future__ import annotations

import ast
import functools
import inspect
import sys
from typing import Any

import pytest


@functools.cache
def _module_functions(module: Any) -> dict[str, tuple[bool, frozenset[str]]]:
    """Each function of a module (tests and helpers, methods too) by name: whether its code reaches
    ``subprocess.<x>`` itself, and the bare names it calls. One parse per module."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return {}
    out = {}
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nodes = list(ast.walk(f))
            direct = any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "subprocess"
                         for n in nodes)
            called = frozenset(n.func.id for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
            out[f.name] = (direct, called)
    return out


def _direct(fn: Any) -> bool:
    """A function whose own code calls subprocess (looked up in the module that defines it)."""
    home = sys.modules.get(getattr(fn, "__module__", ""), None)
    return home is not None and _module_functions(home).get(fn.__name__, (False, frozenset()))[0]


def starts_a_process(item: pytest.Item) -> bool:
    """The test's own code calls subprocess, or calls a helper (its module's or imported) that does."""
    fn, module = getattr(item, "function", None), getattr(item, "module", None)
    if fn is None or module is None:
        return False
    direct, called = _module_functions(module).get(fn.__name__, (False, frozenset()))
    return direct or any(inspect.isfunction(h := getattr(module, name, None)) and _direct(h) for name in called)
