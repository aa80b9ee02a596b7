"""Session and process state: the shared model loader, the allowed model folders, the run store.

- ``get_model`` is ``@st.cache_resource``: one read-only model per (spec, device, dtype, file
  stamp), shared by every session. Caches and generators are per run, never on the model.
- Model folders and ``.gguf`` files are *listed* from one allowed directory (``models/`` or
  ``$KVVIZ_MODELS_DIR``); the app never takes a free-form path, and every resolved path is
  checked to stay inside it. A GGUF is named by its family, read from its header alone.
- ``RunStore`` keeps the last runs of a session in ``st.session_state`` (a plain mapping here,
  so it is testable without Streamlit) and keeps their captures under a byte budget.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from kvviz import KVVizError, LoadedModel, Run, load_model
from kvviz.engine.loading.loader import (
    RANDOM_SHAPES, SHAKESPEARE_DIR, config_from_json, default_model_name, read_config, resolve_device,
)
from kvviz.engine.generation.flops import weight_bytes
from kvviz.engine.loading.gemma3_package import part_paths as gemma3_parts
from kvviz.engine.loading.gguf_checks import model_family
from kvviz.fast.heap import freeze_once
from kvviz.engine.models.config import GPTConfig
from kvviz.ui.common.budget import SESSION_CAPTURE_BUDGET, strip_captures
from kvviz.units import fmt_bytes

REPO_ROOT = Path(__file__).resolve().parents[2]
FOLDER_PREFIX = "folder:"
GGUF_PREFIX = "gguf:"
FALLBACK_MODEL = "random:tiny"


# --- model choices ---------------------------------------------------------------------------

def models_root() -> Path:
    """The one directory whose sub-folders may be loaded as models."""
    env = os.environ.get("KVVIZ_MODELS_DIR")
    return Path(env) if env else REPO_ROOT / "models"


def _offered_entries() -> list[Path]:
    """The entries of models_root() that may be offered: not hidden, and not a link that leads
    outside the folder (a symlink pointing elsewhere is never offered); sorted by name."""
    root = models_root()
    try:
        real_root = root.resolve(strict=True)
        entries = sorted(root.iterdir(), key=lambda p: p.name)
    except OSError:
        return []
    return [p for p in entries if not p.name.startswith(".") and p.resolve().is_relative_to(real_root)]


def list_model_folders() -> list[str]:
    """Names of the model folders under models_root(); hidden folders and escaping links skipped."""
    return [p.name for p in _offered_entries() if p.is_dir()]


def list_model_ggufs() -> list[str]:
    """Names of the regular ``.gguf`` files directly in models_root(); hidden files and links that
    lead outside it skipped (a FIFO or device named .gguf is not a regular file: never listed)."""
    return [p.name for p in _offered_entries() if p.name.lower().endswith(".gguf") and p.is_file()]


def resolve_model_gguf(name: str) -> Path:
    """The path of a listed GGUF file, verified to stay inside models_root()."""
    if name not in list_model_ggufs():  # only names the app itself listed, so no "..", no "/"
        raise KVVizError(f"GGUF file {name!r} is not in {models_root()}")
    root = models_root().resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root) or path.parent != root:
        raise KVVizError(f"GGUF file {name!r} resolves outside {root}")
    return path


def resolve_model_folder(name: str) -> Path:
    """The path of a listed folder, verified to stay inside models_root()."""
    if name not in list_model_folders():  # only names the app itself listed, so no "..", no "/"
        raise KVVizError(f"model folder {name!r} is not in {models_root()}")
    root = models_root().resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root) or path == root:
        raise KVVizError(f"model folder {name!r} resolves outside {root}")
    return path


def default_model_present() -> bool:
    return (SHAKESPEARE_DIR / "model.safetensors").is_file()


def smollm2_present() -> bool:
    return default_model_name() == "smollm2"


def gemma3_present() -> bool:
    """Whether Gemma 3's four chunk packages are installed (found, not joined: that waits for a load)."""
    try:
        gemma3_parts()
    except KVVizError:
        return False
    return True


def model_choices() -> list[str]:
    choices = ["smollm2"] if smollm2_present() else []
    choices += ["gemma3"] if gemma3_present() else []
    choices += ["shakespeare"] if default_model_present() else []
    choices += [f"random:{name}" for name in RANDOM_SHAPES]
    choices += [FOLDER_PREFIX + name for name in list_model_folders()]
    choices += [GGUF_PREFIX + name for name in list_model_ggufs()]
    return choices


def default_choice(choices: list[str]) -> str:
    """$KVVIZ_DEFAULT_MODEL when it is offered (tests use random:tiny), else SmolLM2, else the
    shipped byte model."""
    env = os.environ.get("KVVIZ_DEFAULT_MODEL", "")
    if env in choices:
        return env
    return next((c for c in ("smollm2", "shakespeare") if c in choices), FALLBACK_MODEL)


def spec_for(choice: str) -> str:
    """What load_model takes for a choice: a built-in name, 'random:NAME' or a verified folder path."""
    if choice.startswith(FOLDER_PREFIX):
        return str(resolve_model_folder(choice[len(FOLDER_PREFIX):]))
    if choice.startswith(GGUF_PREFIX):
        return str(resolve_model_gguf(choice[len(GGUF_PREFIX):]))
    if choice in ("smollm2", "gemma3", "shakespeare") or choice.startswith("random:"):
        return choice
    raise KVVizError(f"unknown model choice {choice!r}")


def choice_config(choice: str) -> GPTConfig:
    """The config of a choice without loading weights (for labels and bounds)."""
    if choice.startswith("random:"):
        name = choice.split(":", 1)[1]
        if name not in RANDOM_SHAPES:
            raise KVVizError(f"unknown random shape {name!r}")
        return RANDOM_SHAPES[name]
    folder = SHAKESPEARE_DIR if choice == "shakespeare" else Path(spec_for(choice))
    cfg, _ = config_from_json(read_config(folder), f"{folder.name}/config.json")
    return cfg


BUILTIN_LABELS = {
    "smollm2": "smollm2: SmolLM2-135M-Instruct (chat)",  # short: the sidebar is narrow
    "gemma3": "gemma3: Gemma 3 270M (base, sliding + global)",
}


def param_count(cfg: GPTConfig) -> int:
    """Parameters of a config without building it: the weights plus the position embeddings."""
    return weight_bytes(cfg, 1) + cfg.block_size * cfg.n_embd


def human_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def choice_label(choice: str) -> str:
    """The picker's plain-text label: the size in parameters, or 'unreadable' and why.

    The picker labels every folder on every rerun, so one bad folder must cost a label, never the
    page: ``read_config``/``config_from_json`` turn every failure into a KVVizError; OSError and
    ValueError (KVVizError is one) are caught as the last line before the page.
    """
    if choice in BUILTIN_LABELS:
        return BUILTIN_LABELS[choice]
    if choice.startswith(GGUF_PREFIX):
        return gguf_label(choice)
    try:
        params = human_count(param_count(choice_config(choice)))
    except (OSError, ValueError) as e:
        try:  # a Llama folder: its config is read by the Llama loader, at load time
            if read_config(Path(spec_for(choice))).get("model_type") == "llama":
                return f"{choice} (Llama)"
        except (OSError, ValueError):
            pass
        # The label names the folder already; the reason starts at its file ("config.json: ...").
        why = str(e).removeprefix(f"{choice.removeprefix(FOLDER_PREFIX)}/")
        return f"{choice} (unreadable: {why[:80]}{'…' if len(why) > 80 else ''})"
    if choice == "shakespeare":
        return f"shakespeare: byte-level, {params}"
    return f"{choice} ({params} params)"


def gguf_label(choice: str) -> str:
    """'gguf:NAME (family, size)' from the file's header, or why it cannot load, in one line."""
    try:
        path = Path(spec_for(choice))
        return f"{choice} ({_gguf_family(str(path), path.stat().st_mtime)}, {fmt_bytes(path.stat().st_size)})"
    except (OSError, ValueError) as e:  # KVVizError is a ValueError: a damaged or foreign file
        why = str(e)  # room for the whole list of supported architectures
        return f"{choice} (unreadable: {why[:160]}{'…' if len(why) > 160 else ''})"


@functools.lru_cache(maxsize=64)
def _gguf_family(path: str, mtime: float) -> str:
    """The header walk, once per file version: the picker labels every choice on every rerun."""
    return model_family(Path(path))


def available_devices() -> list[str]:
    """auto, cpu, and cuda only where a CUDA device exists right now."""
    out = ["auto", "cpu"]
    try:
        resolve_device("cuda")
        out.append("cuda")
    except KVVizError:
        pass
    return out


def _file_stamp(spec: str) -> float:
    """The weights' modification time, so a retrained or replaced model is loaded afresh."""
    if spec in ("smollm2", "gemma3"):
        return 0.0  # an installed package's file: it changes only with a reinstall (a restart)
    if spec.lower().endswith(".gguf"):
        try:
            return Path(spec).stat().st_mtime
        except OSError:
            return 0.0
    folder = SHAKESPEARE_DIR if spec == "shakespeare" else Path(spec)
    try:
        return (folder / "model.safetensors").stat().st_mtime
    except OSError:
        return 0.0


# Shown by cache_resource only while a model really loads (a cache miss), so a rerun adds nothing
# to the page; one text for every model, since the decorator's text cannot depend on the call.
LOAD_MESSAGE = ("Loading the model, once per server: reading its file (SmolLM2: a 93.8 MiB GGUF file, its 30 "
                "layers dequantized to the chosen dtype), then building its tokenizer. A few seconds.")


@st.cache_resource(max_entries=4, show_spinner=LOAD_MESSAGE)
def _load(spec: str, device: str, dtype: str, stamp: float) -> LoadedModel:
    model = load_model(spec, device=device, dtype=dtype)
    freeze_once()  # torch's heap out of full GC walks; once, before any session holds a stream (kvviz.fast.heap)
    return model


def get_model(choice: str, device: str = "auto", dtype: str = "fp32") -> LoadedModel:
    """The shared, read-only model for a sidebar choice. Raises KVVizError with a message for users."""
    spec = spec_for(choice)
    stamp = 0.0 if spec.startswith("random:") else _file_stamp(spec)
    return _load(spec, device, dtype, stamp)


# --- live runs across sessions ---------------------------------------------------------------------

class LiveRuns:
    """How many live runs this server process is drawing now, over every session.

    The live loop spaces its redraws by this number, so N generating sessions send about what one
    would: under load, browsers that cannot keep up stop reading their WebSocket, the server's
    keepalive ping then times out and the connection drops (measured: docs/load-test.md).
    """

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._n

    def __enter__(self) -> "LiveRuns":
        with self._lock:
            self._n += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._n -= 1


@st.cache_resource
def live_runs() -> LiveRuns:
    """The process-wide counter (one object shared by every session, like the model cache)."""
    return LiveRuns()


# --- the run store -------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoredRun:
    id: int  # per session, from 1; also part of every chart key of this run
    run: Run
    stepping: bool = False  # a step-mode run that can still advance
    captures_dropped: bool = False  # older run whose captures were dropped to fit the budget

    @property
    def label(self) -> str:
        status = "stepping" if self.stepping else (self.run.stop_reason or "running")
        if status == "stopped" and self.run.note:  # why: "stopped by the user", "ended when a setting changed"
            status = self.run.note
        return f"#{self.id} · {self.run.label()} · {status}"


class RunStore:
    """The last ``keep`` runs of one session, newest last, captures under ``budget`` bytes.

    It holds a plain dict that lives in the session state. Methods touch only that dict, never
    ``st.session_state`` itself: when a click interrupts a live run, Streamlit starts the new run
    on another thread at once and makes every session-state access of the old one raise, so the
    old run's ``finally`` can still record its partial run here (and ``live`` tells the new run
    to wait for that).
    """

    def __init__(self, state: MutableMapping[str, Any], name: str = "live", keep: int = 8,
                 budget: int = SESSION_CAPTURE_BUDGET) -> None:
        key = f"kvviz_runs_{name}"
        if key not in state:
            state[key] = {"next_id": 1, "runs": []}
        self._data: dict[str, Any] = state[key]
        self._data.setdefault("live", None)
        self._data.setdefault("inbox", {})
        self.keep = keep
        self.budget = budget

    # --- a live run in progress (possibly on another thread) ---
    def begin_live(self, run_id: int) -> None:
        self._data["live"] = (run_id, threading.Event())

    def end_live(self) -> None:
        live = self._data.get("live")
        self._data["live"] = None
        if live is not None:
            live[1].set()

    def wait_live(self, timeout: float = 5.0) -> bool:
        """Block until a live run that a click interrupted has stored its partial run."""
        live = self._data.get("live")
        return True if live is None else live[1].wait(timeout)

    # --- messages for the next script run (set where session state cannot be written) ---
    def post(self, name: str, value: Any) -> None:
        self._data["inbox"][name] = value

    def take(self, name: str) -> Any:
        return self._data["inbox"].pop(name, None)

    def new_id(self) -> int:
        rid = self._data["next_id"]
        self._data["next_id"] = rid + 1
        return rid

    def runs(self) -> list[StoredRun]:
        return list(self._data["runs"])

    def get(self, run_id: int | None) -> StoredRun | None:
        return next((r for r in self._data["runs"] if r.id == run_id), None)

    def latest(self) -> StoredRun | None:
        runs = self._data["runs"]
        return runs[-1] if runs else None

    def put(self, run_id: int, run: Run, stepping: bool = False, trim: bool = True) -> StoredRun:
        """Add or replace run ``run_id``, then drop the oldest runs and captures that do not fit.

        ``trim=False`` skips the byte accounting (a live run updates its entry on every token).
        """
        entry = StoredRun(run_id, run, stepping)
        runs = [r for r in self._data["runs"] if r.id != run_id] + [entry]
        runs = runs[-self.keep:]
        if not trim:
            self._data["runs"] = runs
            return entry
        # Oldest first: strip captures until the session fits (the newest run always keeps its own).
        total = sum(r.run.capture_nbytes() for r in runs)
        for i, r in enumerate(runs[:-1]):
            if total <= self.budget:
                break
            nbytes = r.run.capture_nbytes()
            if nbytes:
                runs[i] = dataclasses.replace(r, run=strip_captures(r.run), captures_dropped=True)
                total -= nbytes
        self._data["runs"] = runs
        return entry

    def capture_nbytes(self) -> int:
        return sum(r.run.capture_nbytes() for r in self._data["runs"])


def run_store(name: str = "live") -> RunStore:
    """This session's store (pages share it by name)."""
    return RunStore(st.session_state, name)
