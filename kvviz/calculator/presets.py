"""Presets: published config.json excerpts shipped in assets/memory_presets.json, plus kvviz's
own model shapes, which a higher layer (the CLI, the page) reads from the engine and hands in.

memory/ never imports the engine (it imports torch); the shapes arrive as plain dicts.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from kvviz.paths import ASSETS as _ASSETS
from kvviz.calculator.hf_config import load_config_file, parse_config
from kvviz.calculator.hf_fields import KVVIZ_MODEL_TYPE
from kvviz.calculator.spec import CalcError, ConfigError, ModelSpec

ASSETS = _ASSETS  # the checkout's assets/, or the installed wheel's kvviz/assets
PRESETS_PATH = ASSETS / "memory_presets.json"
BUILTIN_PREFIX = "kvviz:"


@lru_cache(maxsize=4)
def load_presets(path: Path = PRESETS_PATH) -> dict[str, ModelSpec]:
    """Preset key -> ModelSpec, parsed from the shipped config excerpts (same parser as imports)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    out: dict[str, ModelSpec] = {}
    for entry in data["presets"]:
        out[entry["key"]] = parse_config(entry["config"], f"preset {entry['key']}", name=entry["name"],
                                         source=entry["source"], key=entry["key"])
    return out


def builtin_specs(shapes: Mapping[str, Mapping[str, Any]], shipped_config: Path | None = None,
                  shapes_source: str = "kvviz RANDOM_SHAPES") -> dict[str, ModelSpec]:
    """kvviz's own models as calculator entries, keyed 'kvviz:...'.

    ``shapes``: random-shape name -> its GPTConfig as a dict (``GPTConfig.to_dict()``);
    ``shipped_config``: the shipped model's config.json, listed first when it exists.
    """
    out: dict[str, ModelSpec] = {}
    if shipped_config is not None and shipped_config.is_file():
        # "shakespeare", not "default": the app's default is SmolLM2 when installed (the calculator
        # lists SmolLM2 as the published preset smollm2-135m).
        key = BUILTIN_PREFIX + "shakespeare"
        try:
            out[key] = load_config_file(shipped_config, name="kvviz shakespeare (shipped byte model)", key=key,
                                        source="assets/models/shakespeare/config.json")
        except ConfigError:
            pass  # half-written while the model trains: list the other built-ins anyway
    for shape, cfg in shapes.items():
        key = f"{BUILTIN_PREFIX}random:{shape}"
        out[key] = parse_config({"model_type": KVVIZ_MODEL_TYPE, **cfg}, key, name=f"kvviz random:{shape}",
                                source=shapes_source, key=key)
    return out


def with_builtins(builtins: Mapping[str, ModelSpec], presets: Mapping[str, ModelSpec] | None = None) -> dict[str, ModelSpec]:
    """Published presets first, then kvviz's own models."""
    return {**(load_presets() if presets is None else presets), **builtins}


def find_preset(name: str, presets: Mapping[str, ModelSpec]) -> ModelSpec:
    """Case-insensitive lookup by key or display name."""
    want = name.strip().lower()
    for key, spec in presets.items():
        if want in (key.lower(), spec.name.lower()):
            return spec
    close = [k for k in presets if want and (want in k.lower() or k.lower() in want)]
    hint = f"; did you mean {', '.join(close[:5])}?" if close else f"; choose one of {', '.join(presets)}"
    raise CalcError([f"unknown preset {name!r}{hint}"])
