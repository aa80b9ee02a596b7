"""Typed, bounded reads of config.json fields, and the key names and defaults the families share.

The reader collects every problem instead of stopping at the first, so one message can name
them all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kvviz.calculator.spec import MAX_DIM, is_int
from kvviz.units import fmt_count

LLAMA_LIKE = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"})
KVVIZ_MODEL_TYPE = "kvviz-gpt"
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "falcon", "opt",
    "deepseek_v2", "deepseek_v3", "gpt_oss", "llama4_text", "qwen3_next", "jamba", "granitemoehybrid",
    KVVIZ_MODEL_TYPE,
)
# A multimodal wrapper's language model, when its text_config does not name its own model_type.
NESTED_TYPES = {"gemma3": "gemma3_text", "llama4": "llama4_text", "mistral3": "mistral", "llava": "llama"}
# transformers writes a nested text_config as a diff against its config class's defaults (to_diff_dict),
# so a field equal to the default is left out: these are those defaults, for the families it happens to.
NESTED_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131_072, "sliding_window": 4096, "tie_word_embeddings": True},
    "llama4_text": {"vocab_size": 202_048, "hidden_size": 5120, "intermediate_size": 8192,
                    "intermediate_size_mlp": 16_384, "num_hidden_layers": 48, "num_attention_heads": 40,
                    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131_072,
                    "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                    "attention_chunk_size": 8192, "tie_word_embeddings": False},
    "llama": {"vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 11_008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048, "tie_word_embeddings": False},
}
# Generic fallbacks, first present key wins.
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_head", "n_head_kv", "n_kv_heads")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
POS_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx", "block_size")
# Defaults of the transformers config classes, used when a key is absent from config.json.
TIE_DEFAULT = {"gemma": True, "gemma2": True, "gemma3_text": True, "falcon": True, "opt": True, "gpt2": True,
               KVVIZ_MODEL_TYPE: True}


def short(v: Any) -> str:
    """A config value for a message: short, and never a repr of a deep container (which could recurse)."""
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'array'} of {len(v):,} items"
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


class Reader:
    """Reads typed fields from a raw config, collecting every problem instead of stopping at the first."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self.problems: list[str] = []

    def _find(self, keys: Sequence[str]) -> tuple[str, Any]:
        for k in keys:
            if self.raw.get(k) is not None:
                return k, self.raw[k]
        return keys[0], None

    def int(self, keys: str | Sequence[str], required: bool = True, default: int | None = None,
            minimum: int = 1, maximum: int = MAX_DIM) -> int | None:
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        k, v = self._find(keys)
        if v is None:
            if required and default is None:
                names = " / ".join(keys[:3])
                self.problems.append(f"missing {names}")
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not is_int(v):
            self.problems.append(f"{k} must be an integer (got {short(v)})")
            return None
        if v < minimum:
            what = "positive" if minimum == 1 else f">= {minimum}"
            self.problems.append(f"{k} must be {what} (got {fmt_count(v)})")
            return None
        if v > maximum:
            self.problems.append(f"{k} = {fmt_count(v)} is implausibly large (limit {maximum:,})")
            return None
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.problems.append(f"{key} must be true or false (got {short(v)})")
            return default
        return v


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    kv: int
    head_dim: int
    hidden: int
