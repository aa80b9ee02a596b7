"""Gemma 3 (text): hybrid attention, sliding-window layers between global ones, one K/V head.

What differs from Llama (models/llama.py), each as transformers' ``Gemma3ForCausalLM`` does it:
- RMSNorm scales by ``1 + w`` (the weight is stored centred on zero), computed in fp32;
- four norms per layer: before and after attention, before and after the MLP;
- Q and K are RMS-normed per head (``q_norm``/``k_norm`` over head_dim) before RoPE;
- embeddings are multiplied by sqrt(hidden), rounded to the weight dtype first;
- the MLP is gated GELU (tanh approximation) instead of SwiGLU;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``;
- layer kinds: every ``sliding_pattern``-th layer (i + 1 divisible by it) is global and sees every
  position with RoPE base ``rope_theta``; the others are sliding: a query at position p sees only
  keys at p - window + 1 .. p, with RoPE base ``rope_local_theta``;
- optional final logit soft-capping (``cap * tanh(logits / cap)``), absent from Gemma 3 270M.

Parameter names are transformers' (``model.layers.{i}.self_attn.q_norm``, ...), with the norms
holding transformers' ``w`` (a GGUF file stores ``1 + w``; the reader subtracts the 1 as
transformers' GGUF loader does, so the fp32 rounding is the same).

The static cache keeps a ring of the window's rows for a sliding layer (``KVCache.ring_positions``
names the position each row holds; ``attention.ring_mask`` masks a chunk over them) and every
position for a global one; the paged cache lets go of a sliding layer's blocks once they are wholly out of the
window and names the held rows' positions the same way. The concat cache holds every position of
every layer; there a sliding layer's window is a mask over them (``attention.sliding_mask``). A
run-time window cache (``WindowKVCache``: S sinks + a ring of W, the same rows on every layer) names
its rows' positions the same way once full, so a sliding layer masks the rows outside its own
window (``layer_inputs``) and a global one sees all S + W. The forward/cache/capture contract is
Llama's: ``cache.update`` writes post-RoPE K, the generator advances the cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvviz.engine.models.attention import attention_mask, keys_by_position, window_mask
from kvviz.engine.models.gpt2_config import ConfigDict, bound_problems, positive_int
from kvviz.engine.models.llama import (MAX_BLOCK, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, last_rows,
                                       rotate_half)

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.engine.kvcache.dense import KVCache
    from kvviz.engine.generation.capture import ForwardCapture

FULL, SLIDING = "full", "sliding"


@dataclass(frozen=True)
class Gemma3Config(ConfigDict):
    model_type: ClassVar[str] = "gemma3"  # the family, as GGUF names it

    vocab_size: int = 262144  # tokens in the vocabulary (rows of embed_tokens; the head is tied)
    block_size: int = 8192  # the context kvviz runs at: rows of a static cache (the model's own is context_length)
    context_length: int = 32768  # the context the model was trained for (gemma3.context_length)
    n_layer: int = 18  # decoder layers
    n_head: int = 4  # query heads per attention layer
    n_kv_head: int = 1  # K/V heads: 1 = MQA, every query head shares it
    n_embd: int = 640  # residual stream width
    head_dim: int = 256  # width of one head (n_head * head_dim need not equal n_embd)
    intermediate_size: int = 2048  # gated-GELU hidden width
    rope_theta: float = 1_000_000.0  # RoPE base on global layers
    rope_local_theta: float = 10_000.0  # RoPE base on sliding layers
    rms_norm_eps: float = 1e-6  # epsilon inside RMSNorm's rsqrt
    sliding_window: int = 512  # keys a sliding layer's query sees, itself included
    sliding_pattern: int = 6  # layer i is global when (i + 1) % sliding_pattern == 0
    query_pre_attn_scalar: float = 256.0  # scores are scaled by its inverse square root
    final_logit_softcapping: float | None = None  # cap * tanh(logits / cap) when set
    eos_token_id: int | None = 1  # end-of-sequence token
    tie_word_embeddings: ClassVar[bool] = True  # Gemma's head is always the embedding

    def __post_init__(self) -> None:
        problems = config_problems(self)
        if problems:
            raise ValueError("invalid Gemma3Config: " + "; ".join(problems))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's kind, FULL (global) or SLIDING, as transformers' ``layer_types``."""
        return tuple(FULL if (i + 1) % self.sliding_pattern == 0 else SLIDING for i in range(self.n_layer))



def config_problems(c: Gemma3Config) -> list[str]:
    """Every problem with a config, as sentences; empty when it is valid."""
    out: list[str] = []
    bounds = {"vocab_size": MAX_VOCAB, "block_size": MAX_BLOCK, "context_length": MAX_BLOCK, "n_layer": MAX_LAYERS,
              "n_head": MAX_HEADS, "n_kv_head": MAX_HEADS, "n_embd": MAX_WIDTH, "head_dim": MAX_HEAD_DIM,
              "intermediate_size": 4 * MAX_WIDTH, "sliding_window": MAX_BLOCK, "sliding_pattern": MAX_LAYERS}
    out += bound_problems(c, bounds)
    for name in ("rope_theta", "rope_local_theta", "rms_norm_eps", "query_pre_attn_scalar", "final_logit_softcapping"):
        v = getattr(c, name)
        if v is None and name == "final_logit_softcapping":
            continue  # no soft-capping (Gemma 3)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            out.append(f"{name} must be a positive finite number (got {v!r})")
        elif name == "rms_norm_eps" and v >= 1:
            out.append(f"rms_norm_eps must be below 1 (got {v!r})")
    if c.eos_token_id is not None and (not isinstance(c.eos_token_id, int) or isinstance(c.eos_token_id, bool)):
        out.append(f"eos_token_id must be an integer or None (got {c.eos_token_id!r})")
    if out:
        return out
    if c.n_head % c.n_kv_head:
        out.append(f"n_kv_head ({c.n_kv_head}) must divide n_head ({c.n_head})")
    if c.head_dim % 2:
        out.append(f"head_dim ({c.head_dim}) must be even: RoPE rotates pairs of dimensions")
    return out


def param_shapes(c: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, as in transformers' Gemma3ForCausalLM (the head is tied)."""
    C, q_out, kv_out, H = c.n_embd, c.n_head * c.head_dim, c.kv_heads * c.head_dim, c.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, C)}
    for i in range(c.n_layer):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (q_out, C), p + "self_attn.k_proj.weight": (kv_out, C),
            p + "self_attn.v_proj.weight": (kv_out, C), p + "self_attn.o_proj.weight": (C, q_out),
            p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,),
            p + "mlp.gate_proj.weight": (H, C), p + "mlp.up_proj.weight": (H, C), p + "mlp.down_proj.weight": (C, H),
            p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
            p + "pre_feedforward_layernorm.weight": (C,), p + "post_feedforward_layernorm.weight": (C,),
        })
    out["model.norm.weight"] = (C,)
    return out


def inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies, (head_dim/2,) fp32, with transformers' ops in its order."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope(freqs: torch.Tensor, input_pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, head_dim) for the given positions, computed per forward as transformers does
    (a table for a 32k context would be 64 MB per base)."""
    angles = input_pos.float()[:, None] * freqs.float()[None, :]  # (T, hs/2)
    emb = torch.cat((angles, angles), dim=-1)  # (T, hs): the half-split layout
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: normalised in fp32 and scaled by (1 + w) in fp32, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(nn.Module):
    def __init__(self, config: Gemma3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding = config.layer_types[layer_idx] == SLIDING
        self.window = config.sliding_window
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.scale = config.query_pre_attn_scalar ** -0.5
        C = config.n_embd
        self.q_proj = nn.Linear(C, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(C, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(C, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, C, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: "KVCache | None",
                mask: torch.Tensor | None, is_causal: bool, capture: "ForwardCapture | None") -> torch.Tensor:
        y = self.attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin, cache, mask, is_causal, capture)
        return self.o_proj(y)  # (B, T, C)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: "KVCache | None", mask: torch.Tensor | None, is_causal: bool,
               capture: "ForwardCapture | None") -> torch.Tensor:
        """Everything between the projections and o_proj: q (B, T, nh*hs), k and v (B, T, nkv*hs)
        -> the heads' outputs side by side (B, T, nh*hs)."""
        B, T, _ = q.shape
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        q = self.q_norm(q.view(B, T, nh, hs).transpose(1, 2))  # (B, nh, T, hs)
        k = self.k_norm(k.view(B, T, nkv, hs).transpose(1, 2))  # (B, nkv, T, hs)
        v = v.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return self.attend_rotated(q, k, v, cache, mask, is_causal, capture)

    def attend_rotated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: "KVCache | None",
                       mask: torch.Tensor | None, is_causal: bool, capture: "ForwardCapture | None") -> torch.Tensor:
        """The cache write, the capture and the attention: q (B, nh, T, hs) and k (B, nkv, T, hs)
        already normed and rotated, v (B, nkv, T, hs) -> (B, T, nh*hs). The accelerator
        (kvviz.fast.gemma3_flat) norms and rotates in its q|k|v call and calls this, so both
        share one attention."""
        B, _, T, _ = q.shape
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # every cached position: (B, nkv, S, hs)
        if capture is not None and self.layer_idx in capture.layers:
            capture.q_last[self.layer_idx] = q[:, :, -1:, :]  # (B, nh, 1, hs), post-norm, post-RoPE
            S = (cache.pos if cache is not None else 0) + T  # positions so far, this step's included
            if cache is not None and cache.kind == "window" and k.shape[2] != S:
                kk, vv = k, v  # a full window cache's S + W rows in slot order, as Llama's capture has them
            else:
                kk, vv = keys_by_position(k, v, cache, self.window, T)  # a ring's rows at their positions
                if self.sliding and S > self.window:
                    capture.key_from[self.layer_idx] = S - self.window  # the newest query's window
            capture.k[self.layer_idx] = kk
            capture.v[self.layer_idx] = vv
        if cache is not None and cache.ragged:  # each request over its own blocks, by its layer's window
            y = cache.attend(self.layer_idx, q, k, v, self.scale)  # (1, nh, N, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                               enable_gqa=nkv != nh)  # (B, nh, T, hs)
        return y.transpose(1, 2).reshape(B, T, nh * hs)  # (B, T, nh*hs)


class Gemma3MLP(nn.Module):
    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        C, H = config.n_embd, config.intermediate_size
        self.gate_proj = nn.Linear(C, H, bias=False)
        self.up_proj = nn.Linear(C, H, bias=False)
        self.down_proj = nn.Linear(H, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GeGLU: the tanh-approximated GELU of the gate scales the linear branch.
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_idx: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.n_embd, eps)
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.n_embd, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.n_embd, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = RMSNorm(config.n_embd, eps)

    def forward(self, x, cos, sin, cache, mask, is_causal, capture):  # type: ignore[no-untyped-def]
        h = self.self_attn(self.input_layernorm(x), cos, sin, cache, mask, is_causal, capture)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3(nn.Module):
    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.config = config
        table = torch.empty(config.vocab_size, config.n_embd)  # filled by a checkpoint (see Llama)
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.n_embd, _weight=table),
                layers=nn.ModuleList([Gemma3DecoderLayer(config, i) for i in range(config.n_layer)]),
                norm=RMSNorm(config.n_embd, config.rms_norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_state_dict(cls, config: Gemma3Config, sd: dict[str, torch.Tensor]) -> "Gemma3":
        """A model that adopts the given tensors (no copy, no random init), as ``Llama.from_state_dict``."""
        with torch.device("meta"):
            model = cls(config)
        sd = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}
        model.load_state_dict(sd, strict=True, assign=True)
        model.lm_head.weight = model.model.embed_tokens.weight
        return model

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def freeze(self) -> "Gemma3":
        self.eval()
        self.requires_grad_(False)
        return self

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """N(0, 0.02) matrices and zero norm weights (a scale of exactly 1), as transformers initialises."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=generator)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, the tied head counted once (non_embedding changes nothing: the head is tied)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        cache: "KVCache | None" = None,
        capture: "ForwardCapture | None" = None,
        last_only: bool | torch.Tensor = False,
    ) -> torch.Tensor:
        """Logits for ``idx`` (B, T); the same arguments and cache contract as ``Llama.forward``."""
        x = self.hidden(idx, input_pos, cache, capture, last_only)  # (B, 1|K|T, C)
        return softcap(self.config, self.lm_head(self.model.norm(x)))  # (B, T|1, V)

    def hidden(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None, cache: "KVCache | None" = None,
               capture: "ForwardCapture | None" = None, last_only: bool | torch.Tensor = False) -> torch.Tensor:
        """The last layer's residual stream at the rows ``last_only`` keeps, before the final norm:
        ``forward`` without its head (the accelerator puts the head on the file's codes)."""
        c = self.config
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        end = start + T
        if end > c.block_size and not (cache is not None and cache.ragged):
            raise ValueError(f"sequence of {end} tokens exceeds block_size {c.block_size}")
        if input_pos is None:
            input_pos = torch.arange(start, end, device=idx.device)
        x = self.embed(idx)  # (B, T, C)
        full, local = layer_inputs(c, T, start, input_pos, cache, x.dtype)
        for layer in self.model.layers:
            mask, is_causal, cos, sin = local if layer.self_attn.sliding else full
            x = layer(x, cos, sin, cache, mask, is_causal, capture)
        return last_rows(x, last_only)  # (B, 1|K|T, C)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The scaled embeddings of ``idx`` (B, T) -> (B, T, C)."""
        x = self.model.embed_tokens(idx)  # (B, T, C)
        # sqrt(hidden) rounded to the weight dtype first, as transformers does (bf16: 25.25, not 25.298).
        return x * torch.tensor(self.config.n_embd ** 0.5, device=x.device).to(x.dtype)


LayerInputs = tuple[torch.Tensor | None, bool, torch.Tensor, torch.Tensor]  # mask, is_causal, cos, sin


def layer_inputs(c: Gemma3Config, T: int, start: int, input_pos: torch.Tensor, cache: "KVCache | None",
                 dtype: torch.dtype) -> tuple[LayerInputs, LayerInputs]:
    """One mask and one RoPE pair per layer kind (global, sliding), built once per forward. The
    frequencies are recomputed (64 numbers each) rather than kept as buffers: .to(bf16) would
    round them, and transformers keeps them fp32."""
    dev = input_pos.device
    ragged = cache is not None and cache.ragged  # the ragged cache masks each request by its layer's window
    full = (*((None, False) if ragged else attention_mask(T, start, input_pos)),
            *rope(inv_freq(c.rope_theta, c.head_dim).to(dev), input_pos, dtype))
    local = (*((None, False) if ragged else window_mask(T, start, input_pos, c.sliding_window, cache)),
             *rope(inv_freq(c.rope_local_theta, c.head_dim).to(dev), input_pos, dtype))
    return full, local  # type: ignore[return-value]


def softcap(c: Gemma3Config, logits: torch.Tensor) -> torch.Tensor:
    """cap * tanh(logits / cap) when the config sets a final soft-cap (Gemma 2), else the logits."""
    if c.final_logit_softcapping is None:
        return logits
    cap = c.final_logit_softcapping
    return torch.tanh(logits / cap) * cap
