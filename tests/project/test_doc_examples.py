"""The Python API examples in README.md and docs/usage.md run, as written, with the current call shape.

Every ```python block of their "Python API" sections is executed in order (one namespace per
document, as a reader pastes them one after another), with ``kvviz.load_model`` answering any
model name with the tiny random GPT-2 under a byte chat template (tests/chat_fixtures.py): the
examples' own SmolLM2 and Shakespeare would take minutes to load, and what is tested here is the
call shape (every keyword, every object, every attribute the examples read), not the text.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import kvviz
from chat_fixtures import chat_model

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def api_blocks(doc: str) -> list[str]:
    """The ```python blocks of the "## Python API" section (up to the next "## " heading)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    start = text.index("## Python API")
    end = text.find("\n## ", start + 1)
    return BLOCK.findall(text[start: end if end != -1 else len(text)])


@pytest.fixture(scope="module")
def tiny_chat() -> kvviz.LoadedModel:
    return chat_model(kvviz.load_model("random:tiny", device="cpu"))


@pytest.mark.parametrize("doc", ["README.md", "docs/usage.md"])
def test_the_python_api_examples_run(doc: str, tiny_chat: kvviz.LoadedModel, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    blocks = api_blocks(doc)
    assert blocks, f"{doc} has no ```python block under '## Python API'"
    asked: list[str] = []

    def load_model(name: str = "default", **kw: Any) -> kvviz.LoadedModel:
        asked.append(name)
        return tiny_chat

    kvviz.__getattr__("load_model")  # resolve the lazy name first, so the patch below is what blocks import
    monkeypatch.setattr(kvviz, "load_model", load_model)
    ns: dict[str, Any] = {}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{doc} python block {i + 1}", "exec"), ns)
        except Exception as e:  # name the block and its first line: the doc is what needs fixing
            raise AssertionError(f"{doc}, python block {i + 1} ({code.splitlines()[0]!r}): {e!r}") from e
    assert asked, "the examples load a model"
    assert isinstance(ns.get("run"), kvviz.Run)  # the last generate's Run, whatever its strategy
