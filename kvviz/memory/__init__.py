"""KV-cache memory calculator: exact bytes for real model configs. Pure Python on purpose.

It imports only the standard library, ``kvviz.errors`` and ``kvviz.units`` (no torch, no
streamlit, no engine), so the CLI, the page and the tests call the same functions and a
config.json can be sized without a deep-learning stack. kvviz's own model shapes are handed in
by a higher layer (see ``presets.builtin_specs``).

Modules:
- ``spec``: ModelSpec, MemoryRequest, MemoryResult and the errors (the vocabulary);
- ``formulas``: the arithmetic (bytes per token and layer, the cache, weights, the GPU fit);
- ``config_file``: reading a config.json safely (bounded, regular files only);
- ``hf_fields``, ``hf_config``, ``hf_params``: config.json -> ModelSpec for each family;
- ``presets``: the shipped presets and kvviz's own models;
- ``report``: the human-readable summary.
"""
from kvviz.memory.config_file import MAX_CONFIG_BYTES, parse_json_text, read_config_bytes
from kvviz.memory.formulas import (
    COUNTED, NOT_COUNTED, attention_variants, calculate, context_curve, formula_lines, kv_bytes, layer_token_bytes,
    max_seq_len_for, mha_layer_token_bytes, stored_tokens, weight_bytes,
)
from kvviz.memory.hf_config import load_config_file, parse_config, parse_config_text
from kvviz.memory.hf_fields import KVVIZ_MODEL_TYPE, SUPPORTED_MODEL_TYPES
from kvviz.memory.presets import (
    BUILTIN_PREFIX, PRESETS_PATH, builtin_specs, find_preset, load_presets, with_builtins,
)
from kvviz.memory.report import summary_text
from kvviz.memory.spec import (
    DEFAULT_BLOCK_SIZE, DEFAULT_GROUP_SIZE, DEFAULT_RESERVE, DTYPES, GPU_PRESETS_GIB, GROUPED_DTYPES, MAX_BATCH,
    MAX_SEQ_LEN, MLA, SCALE_DTYPE_BYTES, CalcError, ConfigError, Fit, KVFormat, MemoryRequest, MemoryResult, ModelSpec,
    request_problems,
)
from kvviz.units import DTYPE_BITS, GB, GIB

__all__ = [
    "BUILTIN_PREFIX", "COUNTED", "DEFAULT_BLOCK_SIZE", "DEFAULT_GROUP_SIZE", "DEFAULT_RESERVE", "DTYPES", "DTYPE_BITS",
    "GB", "GIB", "GPU_PRESETS_GIB", "GROUPED_DTYPES", "KVVIZ_MODEL_TYPE", "MAX_BATCH", "MAX_CONFIG_BYTES", "MAX_SEQ_LEN",
    "MLA", "NOT_COUNTED", "PRESETS_PATH", "SCALE_DTYPE_BYTES", "SUPPORTED_MODEL_TYPES", "CalcError", "ConfigError",
    "Fit", "KVFormat", "MemoryRequest", "MemoryResult", "ModelSpec", "attention_variants", "builtin_specs",
    "calculate", "context_curve", "find_preset", "formula_lines", "kv_bytes", "layer_token_bytes",
    "load_config_file", "load_presets", "max_seq_len_for", "mha_layer_token_bytes", "parse_config",
    "parse_config_text", "parse_json_text", "read_config_bytes", "request_problems", "stored_tokens",
    "summary_text", "weight_bytes", "with_builtins",
]
