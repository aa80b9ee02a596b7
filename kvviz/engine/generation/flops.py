"""Analytic FLOP and byte counts for one forward pass of kvviz's models, GPT-2 and Llama (pure Python, no torch).

Counted: the matrix multiplies (2 FLOPs per multiply-add) of the QKV projection, attention
scores (QK^T), attention-weighted values (AV), the output projection, the MLP and the LM head.
Not counted: LayerNorm, GELU, softmax, residual adds and embeddings (a few % at these sizes).
Attention counts only the causal work: query at position p attends to p + 1 keys.

Bytes (for arithmetic intensity) count what a forward must move at least once: every weight
read once, the K/V cache read once, the new K/V written. Activations are not counted.
"""
from __future__ import annotations

from typing import Any, Protocol

from kvviz.units import kv_bytes_per_token


class Shape(Protocol):  # GPTConfig satisfies it; so does any object with these fields
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int

    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def _dims(c: Any) -> tuple[int, int, int, int, int]:
    return c.n_layer, c.n_embd, c.kv_heads * c.head_dim, c.vocab_size, c.n_head


def _is_llama(c: Any) -> bool:
    """The Llama family (SwiGLU MLP of ``intermediate_size``); GPT-2 has a 4x GELU MLP."""
    return getattr(c, "intermediate_size", None) is not None


def forward_flops(c: Shape, n_new: int, start: int = 0, n_logits: int = 1, batch: int = 1) -> int:
    """FLOPs of one forward: ``n_new`` tokens at positions start..start+n_new-1.

    A cached decode step is (n_new=1, start=t-1); an uncached step over t tokens is
    (n_new=t, start=0). ``n_logits`` is how many positions get LM-head logits.
    """
    L, C, kvd, V, nh = _dims(c)
    qd = nh * c.head_dim  # query width: C for GPT-2, may differ for Llama (head_dim != C / n_head)
    T = n_new
    # Sum over queries of the keys each one sees: sum_{i=0}^{T-1} (start + i + 1), each capped at
    # a sliding window W where the model has one (Mistral): min(start + i + 1, W).
    keys_seen = T * start + T * (T + 1) // 2
    W = getattr(c, "sliding_window", None)
    if W is not None and start + T > W:
        first_full = max(0, W - 1 - start)  # queries before this one still see fewer than W keys
        keys_seen = first_full * start + first_full * (first_full + 1) // 2 + (T - first_full) * W
    if _is_llama(c):  # SwiGLU: gate and up (C -> I), down (I -> C)
        mlp = 3 * 2 * T * C * c.intermediate_size
    else:  # GPT-2: up (C -> 4C) and down (4C -> C)
        mlp = 2 * 2 * T * C * 4 * C
    per_layer = (
        2 * T * C * (qd + 2 * kvd)  # q, k, v projections
        + 2 * 2 * qd * keys_seen  # QK^T and AV, over all query heads
        + 2 * T * qd * C  # attention output projection
        + mlp
    )
    return batch * (L * per_layer + 2 * n_logits * C * V)


def weight_bytes(c: Shape, dtype_bytes: int) -> int:
    """Bytes of the weights a forward reads (matmul weights, biases, norms, the LM head once)."""
    L, C, kvd, V, nh = _dims(c)
    if _is_llama(c):
        qd, inter = nh * c.head_dim, c.intermediate_size
        per_layer = C * (qd + 2 * kvd) + qd * C + 3 * C * inter + 2 * C  # + the two RMSNorm weights
        if getattr(c, "attention_bias", False):
            per_layer += qd + 2 * kvd + C
        elif getattr(c, "qkv_bias", False):  # Qwen2: q, k, v only
            per_layer += qd + 2 * kvd
        per_layer += 2 * c.head_dim * bool(getattr(c, "qk_norm", False))  # Qwen3's q_norm and k_norm
        per_layer += (2 * inter + C) * bool(getattr(c, "mlp_bias", False))
        head = 0 if getattr(c, "tie_word_embeddings", True) else V * C
        return dtype_bytes * (L * per_layer + V * C + head + C)
    per_layer = C * (C + 2 * kvd) + (C + 2 * kvd) + C * C + C + 8 * C * C + 5 * C + 4 * C
    return dtype_bytes * (L * per_layer + V * C + 2 * C)


def forward_bytes(c: Shape, n_new: int, start: int = 0, dtype_bytes: int = 4, batch: int = 1,
                  cached: bool = True) -> int:
    """Minimum bytes moved by one forward (weights once + K/V read + K/V written)."""
    per_token = int(kv_bytes_per_token(c.n_layer, c.kv_heads, c.head_dim, dtype_bytes, batch)) if cached else 0
    return weight_bytes(c, dtype_bytes) + per_token * (start + n_new)  # K/V read once + the new K/V written


def arithmetic_intensity(c: Shape, n_new: int, start: int = 0, dtype_bytes: int = 4, batch: int = 1) -> float:
    """FLOPs per byte moved for one cached forward."""
    return forward_flops(c, n_new, start, 1, batch) / forward_bytes(c, n_new, start, dtype_bytes, batch)


def generation_flops(c: Shape, prompt_len: int, new_tokens: int, cached: bool) -> list[int]:
    """Per-step FLOPs of a whole generation (step 0 = prefill), cached or recomputing."""
    out = [forward_flops(c, prompt_len, 0)]
    for i in range(1, new_tokens):
        t = prompt_len + i  # tokens in the sequence fed at this step
        out.append(forward_flops(c, 1, t - 1) if cached else forward_flops(c, t, 0))
    return out
