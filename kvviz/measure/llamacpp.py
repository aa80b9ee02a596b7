"""llama.cpp on the same GGUF file as kvviz, for ``python -m kvviz bench`` (issue 42).

Two ways in, tried in this order: ``llama-cpp-python`` importable in kvviz's own environment (it
runs in this process), or the separate ``.venv-llamacpp`` that ``make bench-llamacpp`` compiles
it into for this machine's CPU (or any Python named by ``$KVVIZ_LLAMACPP_PYTHON``): llama.cpp then
runs in a subprocess of that Python (``llamacpp_worker.py``), started once per case, with the same
file, the same thread count and the same prompt ids, one request per timed run, so the bench
interleaves its runs with kvviz's exactly as it does in-process. The time a run takes includes one
line of JSON each way through a pipe, tens of microseconds against the hundreds of milliseconds of
a 64-token run. Never a kvviz dependency: without either, the bench quotes issue 17's figures.
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from kvviz.errors import KVVizError
from kvviz.paths import checkout_root

VENV = ".venv-llamacpp"  # make bench-llamacpp's venv, at the checkout's root
ENV_PYTHON = "KVVIZ_LLAMACPP_PYTHON"
WORKER = Path(__file__).with_name("llamacpp_worker.py")
START_TIMEOUT_S = 300  # loading a GGUF is seconds; a hang detector for a loaded 2-core machine, not a speed


def importable() -> bool:
    """llama-cpp-python in this process's environment."""
    if sys.modules.get("llama_cpp") is not None:
        return True
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return False


def venv_python() -> Path | None:
    """The Python of llama.cpp's own venv: ``$KVVIZ_LLAMACPP_PYTHON``, else the checkout's
    ``.venv-llamacpp`` once ``make bench-llamacpp`` finished it (its stamp), else None."""
    named = os.environ.get(ENV_PYTHON)
    if named:
        return Path(named)
    root = checkout_root()
    if root is None or not (root / VENV / ".installed").is_file():
        return None
    return root / VENV / "bin" / "python"


def available() -> bool:
    return importable() or venv_python() is not None


def in_process(model_path: str, prompt: list[int], n: int, threads: int) -> Callable[[], list[int]]:
    """llama.cpp on the file, greedy, n tokens, no stop at the end token (as kvviz's variants on
    the bench's story, which never reaches one)."""
    from llama_cpp import Llama as LlamaCpp  # type: ignore[import-not-found]

    llm = LlamaCpp(model_path=model_path, n_threads=threads, n_ctx=len(prompt) + n + 8, verbose=False)

    def run_llama_cpp() -> list[int]:
        llm.reset()
        out: list[int] = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if len(out) == n:
                break
        return out
    return run_llama_cpp


class Worker:
    """The worker process: one request a run; closed at exit (or by ``close``)."""

    def __init__(self, python: Path, model_path: str, threads: int, n_ctx: int) -> None:
        self.proc = subprocess.Popen([str(python), str(WORKER), model_path, str(threads), str(n_ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        atexit.register(self.close)
        if self._line() != "ready":
            raise KVVizError(f"llama.cpp's worker ({python}) did not start: {self._stderr()}")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        return line.strip()

    def _stderr(self) -> str:
        """The worker's last line of stderr, once it has ended (ended here if it has not)."""
        try:
            _, err = self.proc.communicate(timeout=30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
            err = ""
        return ((err or "").strip().splitlines() or ["no message"])[-1]

    def run(self, prompt: list[int], n: int) -> list[int]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"prompt": prompt, "n": n}) + "\n")
            self.proc.stdin.flush()
            return [int(t) for t in json.loads(self._line())["tokens"]]
        except (OSError, ValueError, KeyError) as e:
            raise KVVizError(f"llama.cpp's worker stopped: {self._stderr() or e}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.communicate("\n", timeout=30)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def runner(model_path: str, prompt: list[int], n: int, threads: int) -> Callable[[], list[int]]:
    """A run of llama.cpp on the file: in this process when importable, else in its venv's."""
    if importable():
        return in_process(model_path, prompt, n, threads)
    python = venv_python()
    if python is None:
        raise KVVizError(f"no llama.cpp: pip install llama-cpp-python, or make bench-llamacpp ({VENV})")
    worker = Worker(python, model_path, threads, len(prompt) + n + 8)
    return lambda: worker.run(prompt, n)
