"""A model ready to run: the loader's readable model with its accelerator built beside it.

The one place where ``engine/loading`` (checkpoints -> the readable model) and ``kvviz.fast``
(the readable model -> an accelerator) meet, above both: no loader imports the accelerator, and
the accelerator reads no file. ``load_model`` is ``kvviz.load_model``; ``wrap_model`` finishes a
hand-built model (tests, ``train``) the same way.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import torch

from kvviz.engine.loading.gguf_codes import BlockCodes
from kvviz.engine.loading.llama_loader import weights_bytes
from kvviz.engine.loading.loader import LoadedModel, load_readable, wrap_readable
from kvviz.engine.models.gemma3 import Gemma3
from kvviz.engine.models.gpt2 import GPT
from kvviz.engine.models.llama import Llama
from kvviz.engine.tokenize.tokenizer import Tokenizer
from kvviz.fast import build as build_fast


def with_accelerator(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` with kvviz.fast's accelerator for its model (None for a family it does not know),
    built from the readable model and the file's block codes the loader kept."""
    return replace(loaded, fast=build_fast(loaded.model, loaded.codes or None))


def load_model(name_or_path: str | Path = "default", device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """The named model (see ``engine.loading.loader``: default, shakespeare, random:NAME, smollm2,
    gemma3, a .gguf file, a folder) with its accelerator."""
    t0 = time.perf_counter()
    out = with_accelerator(load_readable(name_or_path, device, dtype))
    # What loading cost, stamped here alone, for every family: seconds (the accelerator's build
    # included), and the resident bytes of the weights, each storage once (a tied head shares the
    # embedding's).
    out.info["load_seconds"] = time.perf_counter() - t0
    out.info["weights_bytes"] = weights_bytes(out.model)
    return out


def wrap_model(net: GPT | Llama | Gemma3, tokenizer: Tokenizer, name: str, device: torch.device = torch.device("cpu"),
               dtype: torch.dtype = torch.float32, has_tokenizer: bool = True, source: str = "",
               info: dict[str, Any] | None = None, *, codes: Mapping[str, BlockCodes] | None = None) -> LoadedModel:
    """A built model (any family) as a LoadedModel, the way every loader finishes one (moved to the
    device and dtype, frozen), and given its accelerator. Tests wrap their hand-built models here."""
    return with_accelerator(wrap_readable(net, tokenizer, name, device, dtype, has_tokenizer, source, info,
                                          codes=codes))
