"""KV-cache memory calculator: exact bytes for real model configs. Pure Python on purpose.

It imports only the standard library, ``kvviz.errors`` and ``kvviz.units`` (no torch, no
streamlit, no engine), so the CLI, the page and the tests call the same functions and a
config.json can be sized without a deep-learning stack. kvviz's own model shapes are handed in
by a higher layer (see ``presets.builtin_specs``).

Modules:
- ``spec``: ModelSpec (a kind per layer, the linear state), MemoryRequest and the errors;
- ``result``: MemoryResult, its per-kind breakdown, the fit and the cost (the JSON contract);
- ``formulas``: the arithmetic (bytes per token, layer and GPU, the cache, the state, weights);
- ``cost``: the decode bandwidth roofline and the GPU presets;
- ``calculate``: one request in, one result out;
- ``config_file``: reading a config.json safely (bounded, regular files only);
- ``hf_fields``, ``hf_config``, ``layouts``, ``hf_params``: config.json -> ModelSpec per family;
- ``presets``: the shipped presets and kvviz's own models;
- ``report``: the formula text and the human-readable summary;
- ``compressed``: the bytes of kvviz's own quantized and windowed caches, step by step;
- ``cache_window``: a run-time cache window (S sinks + the last W) applied to any model;
- ``hf_provenance``: where each shape figure came from (config field, class default, rule);
- ``server_vllm``, ``server_llamacpp``, ``server_sglang``: what each engine allocates, in its own log
  lines; ``server_log``: a vLLM startup log reconciled; ``server_mix``: a real length mix on vLLM's
  blocks; ``servers``: the one entry the CLI and the page call (imported from there, not re-exported).
"""
from kvviz.calculator.cache_window import MAX_SINKS, cache_window_problems, with_cache_window
from kvviz.calculator.calculate import calculate, layer_groups
from kvviz.calculator.config_file import MAX_CONFIG_BYTES, parse_json_text, read_config_bytes
from kvviz.calculator.cost import GPUPreset, batch_steps, cost_curve, decode_cost, load_gpus, request_cost
from kvviz.calculator.formulas import (
    attention_variants, cache_saturates, context_curve, kv_bytes, kv_heads_per_gpu, kv_replication,
    layer_token_bytes, max_seq_len_for, mha_layer_token_bytes, state_bytes, state_layer_bytes, stored_tokens,
    token_slots, tokens_held, tp_problems, weight_bytes, weights_per_gpu,
)
from kvviz.calculator.hf_config import load_config_file, parse_config, parse_config_text
from kvviz.calculator.hf_fields import KVVIZ_MODEL_TYPE, SUPPORTED_MODEL_TYPES
from kvviz.calculator.layouts import LAYER_TYPES
from kvviz.calculator.presets import (
    BUILTIN_PREFIX, PRESETS_PATH, builtin_specs, find_preset, load_presets, with_builtins,
)
from kvviz.calculator.report import COUNTED, NOT_COUNTED, formula_lines, no_cost_reason, summary_text
from kvviz.calculator.result import Cost, Fit, LayerGroup, MemoryResult
from kvviz.calculator.spec import (
    DEFAULT_BLOCK_SIZE, DEFAULT_EFFICIENCY, DEFAULT_GROUP_SIZE, DEFAULT_RESERVE, DTYPES, FULL, GPU_PRESETS_GIB,
    GROUPED_DTYPES, LAYER_KINDS, MAX_BATCH, MAX_SEQ_LEN, MAX_TP, MLA, SCALE_DTYPE_BYTES, STATE_DTYPES, CalcError,
    ConfigError, KVFormat, Layer, MemoryRequest, ModelSpec, StateShape, request_problems,
)
from kvviz.units import DTYPE_BITS, GB, GIB

__all__ = [
    "BUILTIN_PREFIX", "COUNTED", "DEFAULT_BLOCK_SIZE", "DEFAULT_EFFICIENCY", "DEFAULT_GROUP_SIZE",
    "DEFAULT_RESERVE", "DTYPE_BITS", "DTYPES", "FULL", "GB", "GIB", "GPU_PRESETS_GIB", "GROUPED_DTYPES",
    "KVVIZ_MODEL_TYPE", "LAYER_KINDS", "LAYER_TYPES", "MAX_BATCH", "MAX_CONFIG_BYTES", "MAX_SEQ_LEN", "MAX_SINKS", "MAX_TP",
    "MLA", "NOT_COUNTED", "PRESETS_PATH", "SCALE_DTYPE_BYTES", "STATE_DTYPES", "SUPPORTED_MODEL_TYPES",
    "attention_variants", "batch_steps", "cache_window_problems", "builtin_specs", "cache_saturates", "CalcError", "calculate",
    "ConfigError", "context_curve", "Cost", "cost_curve", "decode_cost", "find_preset", "Fit", "formula_lines",
    "GPUPreset", "kv_bytes", "kv_heads_per_gpu", "kv_replication", "KVFormat", "Layer", "layer_groups",
    "layer_token_bytes", "LayerGroup", "load_config_file", "load_gpus", "load_presets", "max_seq_len_for",
    "MemoryRequest", "MemoryResult", "mha_layer_token_bytes", "ModelSpec", "parse_config", "parse_config_text",
    "parse_json_text", "read_config_bytes", "request_cost", "request_problems", "state_bytes", "state_layer_bytes",
    "StateShape", "no_cost_reason", "stored_tokens", "summary_text", "token_slots", "tokens_held", "tp_problems", "weight_bytes",
    "weights_per_gpu", "with_builtins", "with_cache_window",
]
