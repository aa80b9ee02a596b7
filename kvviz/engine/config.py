"""Model configs: one frozen dataclass per family, each field commented, validated on creation.

A config is what the cache, the FLOP model and the views read: every family exposes
``vocab_size, block_size, n_layer, n_head, kv_heads, head_dim, n_embd, eos_token_id``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class GPTConfig:
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPTConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


def config_problems(c: GPTConfig) -> list[str]:
    """Every problem with a config, as sentences; empty when it is valid."""
    out: list[str] = []
    if not isinstance(c.dropout, (int, float)) or not 0.0 <= c.dropout < 1.0:
        out.append(f"dropout must be in [0, 1) (got {c.dropout!r})")
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            out.append(f"{name} must be a positive integer (got {v!r})")
    if out:
        return out
    if c.n_embd % c.n_head:
        out.append(f"n_head ({c.n_head}) must divide n_embd ({c.n_embd})")
    kv = c.n_kv_head
    if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0:
        out.append(f"n_kv_head must be a positive integer (got {kv!r})")
    elif c.n_head % kv:
        out.append(f"n_kv_head ({kv}) must divide n_head ({c.n_head})")
    return out
