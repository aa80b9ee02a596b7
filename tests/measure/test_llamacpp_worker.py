"""llama.cpp in its own venv (measure/llamacpp.py, llamacpp_worker.py): the bench's subprocess way
in, with a stand-in ``llama_cpp`` package on the worker's path (CI does not compile llama.cpp; the
real one ran in docs/benchmarks.md's rows). The worker must load the file once with the bench's
threads, answer each run with exactly n greedy tokens from the prompt given, and a worker that
cannot start must say why, not hang or print a traceback."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvviz.errors import KVVizError
from kvviz.measure import llamacpp

FAKE = '''
import json, os
LOG = os.environ["FAKE_LLAMA_LOG"]
class Llama:
    def __init__(self, model_path, n_threads, n_ctx, verbose):
        with open(LOG, "a") as f:
            f.write(json.dumps({"model_path": model_path, "n_threads": n_threads, "n_ctx": n_ctx}) + "\\n")
    def reset(self):
        pass
    def generate(self, tokens, temp, top_k, reset):
        with open(LOG, "a") as f:
            f.write(json.dumps({"prompt": list(tokens), "temp": temp, "top_k": top_k}) + "\\n")
        t = sum(tokens)
        while True:  # never stops by itself: the worker takes n tokens
            t = (t * 7 + 1) % 101
            yield t
'''


def fake_venv(tmp_path: Path, body: str = FAKE) -> Path:
    """A 'Python of the llama.cpp venv': this interpreter with a stand-in llama_cpp on its path."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "llama_cpp.py").write_text(body)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "site"}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


def test_the_worker_runs_llama_cpp_in_its_own_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setenv(llamacpp.ENV_PYTHON, str(fake_venv(tmp_path)))
    monkeypatch.setattr(llamacpp, "importable", lambda: False)  # as in kvviz's venv, which has no llama_cpp
    assert llamacpp.available()
    run = llamacpp.runner("/models/x.gguf", [3, 4, 5], 6, 2)
    want, t = [], 12
    for _ in range(6):
        t = (t * 7 + 1) % 101
        want.append(t)
    assert run() == want and run() == want  # one request per timed run, the same greedy tokens
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines[0] == {"model_path": "/models/x.gguf", "n_threads": 2, "n_ctx": 3 + 6 + 8}  # loaded once
    assert lines[1:] == [{"prompt": [3, 4, 5], "temp": 0.0, "top_k": 1}] * 2


def test_a_worker_that_cannot_start_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(llamacpp.ENV_PYTHON, str(fake_venv(tmp_path, "raise ImportError('libllama.so: cannot open')")))
    monkeypatch.setattr(llamacpp, "importable", lambda: False)
    with pytest.raises(KVVizError, match="did not start: ImportError: libllama.so: cannot open"):
        llamacpp.runner("/models/x.gguf", [1], 2, 1)


def test_without_llama_cpp_the_bench_keeps_its_quoted_figures(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.delenv(llamacpp.ENV_PYTHON, raising=False)
    monkeypatch.setattr(llamacpp, "importable", lambda: False)
    monkeypatch.setattr(llamacpp, "checkout_root", lambda: tmp_path)  # no .venv-llamacpp/.installed here
    assert llamacpp.venv_python() is None and not llamacpp.available()
    (tmp_path / llamacpp.VENV).mkdir()
    (tmp_path / llamacpp.VENV / ".installed").touch()  # make bench-llamacpp finished
    assert llamacpp.venv_python() == tmp_path / llamacpp.VENV / "bin" / "python"
