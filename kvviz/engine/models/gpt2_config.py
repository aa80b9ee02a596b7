"""Model configs: one frozen dataclass per family, each field commented, validated on creation.

A config is what the cache, the FLOP model and the views read: every family exposes
``vocab_size, block_size, n_layer, n_head, kv_heads, head_dim, n_embd, eos_token_id``. GPT-2's
config lives here; Llama's and Gemma 3's beside their models, in the same style: each is a
``ConfigDict`` (one way to and from a plain dict) whose ``__post_init__`` raises ValueError with
every problem ``config_problems`` finds, the dimensions checked first by ``bound_problems``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


class ConfigDict:
    """What every family's frozen config dataclass shares: a plain dict out (config.json, the
    views) and back in, keys the family does not know dropped."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class GPTConfig(ConfigDict):
    vocab_size: int = 256  # tokens in the vocabulary (256 for the byte-level tokenizer)
    block_size: int = 512  # maximum context: number of learned position embeddings
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # query heads per attention layer
    n_kv_head: int | None = None  # K/V heads; None = n_head (MHA), fewer = GQA, 1 = MQA
    n_embd: int = 256  # residual stream width; head_dim = n_embd // n_head
    bias: bool = True  # biases in Linear and LayerNorm, as in GPT-2
    layer_norm_epsilon: float = 1e-5  # GPT-2's LayerNorm epsilon
    eos_token_id: int | None = None  # end-of-sequence token, if the tokenizer has one
    dropout: float = 0.0  # training only (embeddings and residual branches); eval ignores it

    def __post_init__(self) -> None:
        # A frozen dataclass still needs the default filled in; object.__setattr__ is the idiom.
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        problems = config_problems(self)
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        assert self.n_kv_head is not None
        return self.n_kv_head



# Upper bounds on every dimension, checked before anything is allocated. Generous for a CPU
# visualiser (GPT-2 XL: 48 layers, 1,600 wide, 1,024 positions, 50,257 tokens fits with room), and
# far below what would exhaust a shared app server: a config is data, and 1,000,000 layers is a typo
# or an attack, never a model.
BOUNDS: dict[str, int] = {
    "vocab_size": 1_048_576,  # 2^20; the biggest real vocabularies are ~260K
    "block_size": 131_072,  # positions: the position-embedding table and the static cache's length
    "n_layer": 256,
    "n_head": 1_024,
    "n_embd": 32_768,
}
MAX_PARAMS = 2_000_000_000  # 8 GB of fp32 weights; more does not belong on this app's CPU server


def approx_params(c: GPTConfig) -> int:
    """Weights a GPT-2-shaped config implies (embeddings + blocks), in exact integer arithmetic."""
    C, kv_dim = c.n_embd, c.kv_heads * c.head_dim
    per_layer = C * (C + 2 * kv_dim) + C * C + 8 * C * C + 4 * C  # c_attn, c_proj, mlp, two LayerNorms
    return c.vocab_size * C + c.block_size * C + c.n_layer * per_layer + 2 * C


def show(v: Any) -> str:
    """A value for an error message, short and safe: a 5,000-digit int's repr would itself raise."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"an integer of about {int(v.bit_length() * 0.30103):,} digits"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int to Python, not to a config


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def bound_problems(c: Any, bounds: dict[str, int]) -> list[str]:
    """Each named dimension a positive integer no larger than its bound, as sentences: the check
    every family's config runs first (absurd sizes are refused before anything is allocated)."""
    out: list[str] = []
    for name, limit in bounds.items():
        v = getattr(c, name)
        if not _is_int(v) or v <= 0:
            out.append(f"{name} must be a positive integer (got {show(v)})")
        elif v > limit:
            out.append(f"{name} is {v:,}; kvviz allows at most {limit:,}" if v < 10**30 else
                       f"{name} is {show(v)}; kvviz allows at most {limit:,}")
    return out


def positive_int(v: Any) -> bool:
    return _is_int(v) and v > 0


def config_problems(c: GPTConfig) -> list[str]:
    """Every problem with a config (each field's type, range and bound), as sentences; empty when valid."""
    out = bound_problems(c, BOUNDS)
    if not isinstance(c.bias, bool):
        # "no" or 0 would read as a truth value; a config must say true or false.
        out.append(f"bias must be true or false (got {show(c.bias)})")
    eps = c.layer_norm_epsilon
    if not _is_number(eps) or not math.isfinite(eps) or not 0.0 < eps <= 1.0:
        out.append(f"layer_norm_epsilon must be a number in (0, 1] (got {show(eps)})")
    if not _is_number(c.dropout) or not 0.0 <= c.dropout < 1.0:
        out.append(f"dropout must be in [0, 1) (got {show(c.dropout)})")
    eos = c.eos_token_id
    if eos is not None and (not _is_int(eos) or eos < 0):
        out.append(f"eos_token_id must be a token id (an integer >= 0) or null (got {show(eos)})")
    kv = c.n_kv_head
    if not _is_int(kv) or kv <= 0:
        out.append(f"n_kv_head must be a positive integer (got {show(kv)})")
    if out:
        return out
    if c.n_embd % c.n_head:
        out.append(f"n_head ({c.n_head}) must divide n_embd ({c.n_embd})")
    elif c.n_head % kv:
        out.append(f"n_kv_head ({kv}) must divide n_head ({c.n_head})")
    elif (n := approx_params(c)) > MAX_PARAMS:
        out.append(f"these dimensions make {n:,} parameters; kvviz allows at most {MAX_PARAMS:,}")
    return out
