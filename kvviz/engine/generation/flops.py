"""Analytic FLOP and byte counts for one forward pass of kvviz's models, GPT-2 and Llama (pure Python, no torch).

Counted: the matrix multiplies (2 FLOPs per multiply-add) of the QKV projection, attention
scores (QK^T), attention-weighted values (AV), the output projection, the MLP and the LM head.
Not counted: LayerNorm, GELU, softmax, residual adds and embeddings (a few % at these sizes).
Attention counts only the causal work: query at position p attends to p + 1 keys, or to at most
``sliding_window`` of them on a sliding-window layer (Gemma 3: every layer its ``layer_types``
does not mark "full").

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


def _keys_seen(T: int, start: int, window: int | None) -> int:
    """Keys the queries at positions start..start+T-1 see in all: sum of min(p + 1, window)."""
    lo, hi = start + 1, start + T  # each query's causal key count
    if window is None or hi <= window:
        return (lo + hi) * T // 2
    capped = hi - max(lo - 1, window)  # queries that see exactly `window` keys
    below = max(0, window - lo + 1)  # queries still under the window: lo..window keys
    return (lo + window) * below // 2 + capped * window


def _layer_windows(c: Any) -> list[int | None]:
    """Each layer's attention span: None (every earlier key) or its sliding window."""
    kinds = getattr(c, "layer_types", None)
    window = getattr(c, "sliding_window", None)
    if window is None:
        return [None] * c.n_layer
    if kinds is None:  # one window on every layer (Mistral)
        return [window] * c.n_layer
    return [None if k == "full" else window for k in kinds]


def forward_flops(c: Shape, n_new: int, start: int = 0, n_logits: int = 1, batch: int = 1) -> int:
    """FLOPs of one forward: ``n_new`` tokens at positions start..start+n_new-1.

    A cached decode step is (n_new=1, start=t-1); an uncached step over t tokens is
    (n_new=t, start=0). ``n_logits`` is how many positions get LM-head logits.
    """
    L, C, kvd, V, nh = _dims(c)
    qd = nh * c.head_dim  # query width: C for GPT-2, may differ for Llama (head_dim != C / n_head)
    T = n_new
    # Sum over layers and queries of the keys each one sees (start + i + 1, or the window's span).
    keys_seen = sum(_keys_seen(T, start, w) for w in _layer_windows(c))
    if _is_llama(c):  # SwiGLU: gate and up (C -> I), down (I -> C)
        mlp = 3 * 2 * T * C * c.intermediate_size
    else:  # GPT-2: up (C -> 4C) and down (4C -> C)
        mlp = 2 * 2 * T * C * 4 * C
    per_layer = (
        2 * T * C * (qd + 2 * kvd)  # q, k, v projections
        + 2 * T * qd * C  # attention output projection
        + mlp
    )
    attention = 2 * 2 * qd * keys_seen  # QK^T and AV, over all query heads and layers
    return batch * (L * per_layer + attention + 2 * n_logits * C * V)


def weight_bytes(c: Shape, dtype_bytes: int) -> int:
    """Bytes of the weights a forward reads (matmul weights, biases, norms, the LM head once)."""
    L, C, kvd, V, nh = _dims(c)
    if _is_llama(c):
        qd, inter = nh * c.head_dim, c.intermediate_size
        per_layer = C * (qd + 2 * kvd) + qd * C + 3 * C * inter + 2 * C  # + the two RMSNorm weights
        if getattr(c, "model_type", None) == "gemma3":  # two more norms around them, and q/k norms per head
            per_layer += 2 * C + 2 * c.head_dim
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
