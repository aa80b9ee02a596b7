"""The model menu: which models the sidebar offers, and their labels (no model is loaded here).

Model folders and ``.gguf`` files are *listed* from one allowed directory (``models/`` or
``$KVVIZ_MODELS_DIR``); the app never takes a free-form path, and every resolved path is checked
to stay inside it. A GGUF is named by its family, read from its header alone.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from kvviz import KVVizError, paths
from kvviz.engine.loading.loader import (
    RANDOM_SHAPES, SHAKESPEARE_DIR, config_from_json, default_model_name, read_config, resolve_device,
)
from kvviz.engine.generation.flops import weight_bytes
from kvviz.engine.loading.gemma3_package import part_paths as gemma3_parts
from kvviz.engine.loading.gguf_checks import model_family
from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.units import fmt_bytes

FOLDER_PREFIX = "folder:"
GGUF_PREFIX = "gguf:"
FALLBACK_MODEL = "random:tiny"


def models_root() -> Path:
    """The one directory whose sub-folders may be loaded as models."""
    env = os.environ.get("KVVIZ_MODELS_DIR")
    return Path(env) if env else paths.models_dir()


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
    # Short: the sidebar's box shows about 28 characters ("smollm2: SmolLM2-135M-Instruc" at 1366 px);
    # the caption under it names the model in full. Each starts with its choice's name.
    "smollm2": "smollm2: 135M, chat",
    "gemma3": "gemma3: 270M, base",
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
