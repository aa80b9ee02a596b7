"""The suite's subsets are chosen by what a test does: a test that starts a real Python process is
marked `process` (out of `make test-fast`), whether it calls subprocess itself or through a helper."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from suite_markers import starts_a_process


def _runs_the_cli() -> int:
    return subprocess.run([sys.executable, "-c", "pass"], check=True).returncode


def _pure_helper() -> int:
    return 1


def test_direct() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_through_a_helper() -> None:
    assert _runs_the_cli() == 0


def test_in_process() -> None:
    assert _pure_helper() == 1


def _item(fn) -> SimpleNamespace:  # type: ignore[no-untyped-def]
    return SimpleNamespace(function=fn, module=sys.modules[__name__])


def test_a_test_that_starts_a_process_is_marked_and_one_that_does_not_is_not() -> None:
    assert starts_a_process(_item(test_direct))
    assert starts_a_process(_item(test_through_a_helper))
    assert not starts_a_process(_item(test_in_process))
