"""The one safetensors reader: the header (``safetensors_header``) and the tensors (``read_tensors``),
for GPT-2 and Llama folders and the training state alike; and a GPT-2 checkpoint's header checked
against its config before anything is loaded.

Reading a header costs a few KB; building the model or reading the tensors of a config that lies
about its size (a million layers over a 4-layer file) could cost gigabytes. So names, dtypes and
shapes are compared first, and a mismatch is a KVVizError naming what differs.
"""
from __future__ import annotations

import stat
from pathlib import Path

import torch

from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.engine.models.gpt2 import GPT
from kvviz.errors import KVVizError
from kvviz.safeio import describe_path, kind_of
from kvviz.units import SAFETENSORS_FLOAT_DTYPES as FLOAT_DTYPES


_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # GPT-2's old mask buffers, not weights


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, reading no tensor data.

    ``safe_open`` parses the 8-byte length and the JSON header and checks that every tensor's
    offsets fit its dtype, its shape and the file; it maps nothing into memory yet.
    """
    from safetensors import SafetensorError, safe_open

    where = f"{path.parent.name}/{path.name}"
    mode, why = describe_path(path, where)
    if mode is None:
        raise KVVizError(why)
    if not stat.S_ISREG(mode):
        raise KVVizError(f"{where} is {kind_of(mode)}, not a regular file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out = {}
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
            return out
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise KVVizError(f"{where} is not a valid safetensors file ({e})") from None


def read_tensors(path: Path, names: list[str] | None = None,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{name: tensor} for ``names`` (every tensor when None), cast to ``dtype`` when given, on the CPU.

    ``safetensors.torch.load_file`` is this same loop over every key; a truncated or lying file is
    one KVVizError naming it, as the header reader words it."""
    from safetensors import SafetensorError, safe_open

    where = f"{path.parent.name}/{path.name}"
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = list(f.keys()) if names is None else names
            return {k: f.get_tensor(k) if dtype is None else f.get_tensor(k).to(dtype) for k in keys}
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise KVVizError(f"{where} is not a valid safetensors file ({e})") from None
    except OSError as e:
        raise KVVizError(f"{where} cannot be read ({e})") from None


def expected_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """kvviz's tensor names and shapes for a (validated, bounded) config, allocating nothing.

    The model is built on the meta device: the one definition of the layout, no storage.
    """
    with torch.device("meta"):
        gpt = GPT(cfg)
    return {k: tuple(v.shape) for k, v in gpt.state_dict().items() if k != "lm_head.weight"}


def match_header(header: dict[str, tuple[str, tuple[int, ...]]], cfg: GPTConfig, where: str) -> dict[str, str]:
    """{checkpoint name: kvviz name}, after checking every name, dtype and shape against the config.

    Runs before the model is built or a tensor read, so a config that lies about its size (a
    million layers over a 4-layer file) is refused at the cost of reading a header.
    """
    expected = expected_shapes(cfg)
    names: dict[str, str] = {}
    for key in header:
        if key.endswith(_IGNORED_SUFFIXES) or key == "lm_head.weight":
            continue  # lm_head is tied to wte (checked against it once loaded)
        names[key] = key if key.startswith("transformer.") else "transformer." + key
    got = {dst: header[src] for src, dst in names.items()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
    for k in sorted(set(expected) & set(got)):
        dtype, shape = got[k]
        if dtype not in FLOAT_DTYPES:
            problems.append(f"{k} holds {dtype} values, not floating-point weights")
        if shape != expected[k]:
            problems.append(f"{k} has shape {shape}, config.json implies {expected[k]}")
    head = header.get("lm_head.weight")
    if head is not None and head[1] != expected["transformer.wte.weight"]:
        problems.append(f"lm_head.weight has shape {head[1]}, config.json implies "
                        f"{expected['transformer.wte.weight']}")
    if problems:
        more = f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
        raise KVVizError(f"{where}/model.safetensors does not match its config.json: " + "; ".join(problems[:6]) + more)
    return names
