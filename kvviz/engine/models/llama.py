"""The Llama family (SmolLM2, TinyLlama, Llama 2/3 without rope scaling): RMSNorm, RoPE, SwiGLU, GQA,
and its close kin, each a flag on the same config rather than a copy of the model:
- Qwen2: biases on q/k/v (not on o_proj) (``qkv_bias``);
- Qwen3: an RMSNorm over each head of q and k before RoPE (``qk_norm``), an explicit head_dim;
- Mistral: every layer attends to the last ``sliding_window`` positions only, and every cache keeps
  only those (a ring of W rows in the static and quantized caches, the blocks the window reaches in
  the paged one: ``kvcache.dense.layer_windows``), as Gemma 3's sliding layers; the concat cache
  keeps every position and the window is a mask over them (``attention.window_mask`` picks which).

Parameter names are transformers' ``LlamaForCausalLM`` names (``model.embed_tokens``,
``model.layers.{i}.self_attn.q_proj``, ..., ``model.norm``, ``lm_head``), so a Hugging Face
safetensors folder loads without renaming; the GGUF reader maps llama.cpp's names onto them.

Same contract as the GPT-2 family: ``forward(idx, input_pos, cache, capture, last_only)``
writes the new K/V through ``cache.update`` and never advances the cache (the generator does).
The K written to the cache is post-RoPE, as in transformers, so a cached key is never rotated
twice and the captured q/k give the attention weights the model really used.
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

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.engine.kvcache.dense import KVCache
    from kvviz.engine.generation.capture import ForwardCapture

# Bounds that no real Llama comes near; a config past them is a lying header or a typo, and
# refusing it early avoids a multi-GB allocation (the RoPE tables alone are block_size x head_dim).
MAX_VOCAB = 1 << 21
MAX_BLOCK = 1 << 20
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_WIDTH = 1 << 16
MAX_HEAD_DIM = 1024
MAX_ROPE_ENTRIES = 1 << 27  # block_size * head_dim: 1 GiB of fp32 cos + sin tables
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class LlamaConfig(ConfigDict):
    model_type: ClassVar[str] = "llama"  # the family, as config.json and GGUF name it

    vocab_size: int = 49152  # tokens in the vocabulary (rows of embed_tokens and lm_head)
    block_size: int = 2048  # maximum context (max_position_embeddings): rows of the RoPE tables
    n_layer: int = 30  # decoder layers (num_hidden_layers)
    n_head: int = 9  # query heads per attention layer (num_attention_heads)
    n_kv_head: int | None = None  # K/V heads; None = n_head (MHA), fewer = GQA, 1 = MQA
    n_embd: int = 576  # residual stream width (hidden_size)
    head_dim: int | None = None  # width of one head; None = n_embd // n_head (may differ, e.g. Gemma-style)
    intermediate_size: int = 1536  # SwiGLU hidden width (gate/up rows, down columns)
    rope_theta: float = 10000.0  # RoPE base: frequencies are theta^(-2i/head_dim)
    rms_norm_eps: float = 1e-5  # epsilon inside RMSNorm's rsqrt
    tie_word_embeddings: bool = True  # lm_head shares embed_tokens' weight (SmolLM2 does; Llama 2 does not)
    attention_bias: bool = False  # biases on q/k/v/o projections (transformers' attention_bias)
    mlp_bias: bool = False  # biases on gate/up/down projections (transformers' mlp_bias)
    eos_token_id: int | None = None  # end-of-sequence token, if the tokenizer has one
    family: str = "llama"  # what to call it: llama, mistral, qwen2 or qwen3 (names only; the flags decide the maths)
    qkv_bias: bool = False  # biases on q/k/v only, o_proj without (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE (Qwen3's q_norm, k_norm)
    sliding_window: int | None = None  # each query sees its last W positions, itself included (Mistral); None: all

    def __post_init__(self) -> None:
        # A frozen dataclass still needs its derived defaults filled in; object.__setattr__ is the idiom.
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.head_dim is None and positive_int(self.n_embd) and positive_int(self.n_head):
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        problems = config_problems(self)
        if problems:
            raise ValueError("invalid LlamaConfig: " + "; ".join(problems))

    @property
    def kv_heads(self) -> int:
        assert self.n_kv_head is not None
        return self.n_kv_head



def config_problems(c: LlamaConfig) -> list[str]:
    """Every problem with a config, as sentences; empty when it is valid."""
    out: list[str] = []
    bounds = {"vocab_size": MAX_VOCAB, "block_size": MAX_BLOCK, "n_layer": MAX_LAYERS, "n_head": MAX_HEADS,
              "n_kv_head": MAX_HEADS, "n_embd": MAX_WIDTH, "head_dim": MAX_HEAD_DIM,
              "intermediate_size": 4 * MAX_WIDTH}
    out += bound_problems(c, bounds)
    for name, hi in (("rope_theta", math.inf), ("rms_norm_eps", 1.0)):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            out.append(f"{name} must be a positive finite number (got {v!r})")
        elif v >= hi:
            out.append(f"{name} must be below {hi} (got {v!r})")
    if c.family not in FAMILIES:
        out.append(f"family must be one of {', '.join(FAMILIES)} (got {c.family!r})")
    if c.sliding_window is not None and not positive_int(c.sliding_window):
        out.append(f"sliding_window must be a positive integer or None (got {c.sliding_window!r})")
    for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias", "qk_norm"):
        if not isinstance(getattr(c, name), bool):
            out.append(f"{name} must be true or false (got {getattr(c, name)!r})")
    if c.eos_token_id is not None and (not isinstance(c.eos_token_id, int) or isinstance(c.eos_token_id, bool)):
        out.append(f"eos_token_id must be an integer or None (got {c.eos_token_id!r})")
    if out:
        return out
    assert c.n_kv_head is not None and c.head_dim is not None
    if c.n_head % c.n_kv_head:
        out.append(f"n_kv_head ({c.n_kv_head}) must divide n_head ({c.n_head})")
    if c.head_dim % 2:
        out.append(f"head_dim ({c.head_dim}) must be even: RoPE rotates pairs of dimensions")
    if c.block_size * c.head_dim > MAX_ROPE_ENTRIES:
        out.append(f"block_size x head_dim = {c.block_size * c.head_dim:,} is over kvviz's limit of "
                   f"{MAX_ROPE_ENTRIES:,} for the precomputed RoPE tables")
    return out


def param_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, as in transformers' LlamaForCausalLM (lm_head only if untied).

    The loaders check a checkpoint against this before allocating anything.
    """
    assert c.head_dim is not None
    C, q_out, kv_out, H = c.n_embd, c.n_head * c.head_dim, c.kv_heads * c.head_dim, c.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, C)}
    for i in range(c.n_layer):
        p = f"model.layers.{i}."
        linears = {"self_attn.q_proj": (q_out, C), "self_attn.k_proj": (kv_out, C),
                   "self_attn.v_proj": (kv_out, C), "self_attn.o_proj": (C, q_out),
                   "mlp.gate_proj": (H, C), "mlp.up_proj": (H, C), "mlp.down_proj": (C, H)}
        for name, shape in linears.items():
            out[p + name + ".weight"] = shape
            if _has_bias(c, name):
                out[p + name + ".bias"] = shape[:1]
        if c.qk_norm:  # one weight per head dimension, shared by every head (Qwen3)
            out[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        out[p + "input_layernorm.weight"] = (C,)
        out[p + "post_attention_layernorm.weight"] = (C,)
    out["model.norm.weight"] = (C,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, C)
    return out


def _has_bias(c: LlamaConfig, name: str) -> bool:
    """Whether projection ``name`` ("self_attn.q_proj", "mlp.up_proj", ...) carries a bias."""
    if name.startswith("mlp."):
        return c.mlp_bias
    return c.attention_bias or (c.qkv_bias and name != "self_attn.o_proj")


def rope_tables(c: LlamaConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position 0..block_size-1, each (block_size, head_dim), in fp32.

    Computed exactly as transformers' default rotary embedding (same fp32 ops in the same
    order), so the tables match its on-the-fly values bit for bit.
    """
    assert c.head_dim is not None
    hs = c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.int64, device=device).float() / hs))
    pos = torch.arange(c.block_size, device=device).float()
    freqs = torch.outer(pos, inv_freq)  # (block_size, hs/2): one rounding, like HF's (hs/2, 1) @ (1, T)
    emb = torch.cat((freqs, freqs), dim=-1)  # (block_size, hs): HF's half-split layout, not interleaved
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, nh, T, hs) by the angles of its positions; cos/sin are (T, hs)."""
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 and cast back before the scale, exactly as transformers does, so
        # bf16/fp16 runs round at the same points as the reference.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        assert config.head_dim is not None
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window  # Mistral: the cache may hold a ring of this many rows
        C, b = config.n_embd, lambda name: _has_bias(config, "self_attn." + name)
        self.q_proj = nn.Linear(C, self.n_head * self.head_dim, bias=b("q_proj"))
        self.k_proj = nn.Linear(C, self.n_kv_head * self.head_dim, bias=b("k_proj"))
        self.v_proj = nn.Linear(C, self.n_kv_head * self.head_dim, bias=b("v_proj"))
        self.o_proj = nn.Linear(self.n_head * self.head_dim, C, bias=b("o_proj"))
        # Qwen3 normalises each head's q and k (over head_dim) before RoPE; None elsewhere.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: "KVCache | None",
        mask: torch.Tensor | None,
        is_causal: bool,
        capture: "ForwardCapture | None",
    ) -> torch.Tensor:
        B, T, _ = x.shape
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over the last dim, hs: each head on its own
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(self.attend_rotated(q, k, v, cache, mask, is_causal, capture))  # (B, T, C)

    def attend_rotated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: "KVCache | None",
                       mask: torch.Tensor | None, is_causal: bool, capture: "ForwardCapture | None") -> torch.Tensor:
        """The cache write, the capture and the attention: q (B, nh, T, hs) and k (B, nkv, T, hs)
        already normed (Qwen3) and rotated, v (B, nkv, T, hs) -> (B, T, nh*hs). The accelerator on
        block codes (kvviz.fast.llama_codes) rotates in its q|k|v call and calls this, so both
        share one attention."""
        B, _, T, _ = q.shape
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        if cache is not None:
            # Writes the new positions and returns every cached position (B, nkv, S, hs); with a
            # window, the rows the cache still holds (ring_positions names their positions).
            k, v = cache.update(self.layer_idx, k, v)
        if capture is not None and self.layer_idx in capture.layers:
            capture.q_last[self.layer_idx] = q[:, :, -1:, :]  # (B, nh, 1, hs), post-RoPE
            kk, vv = k, v
            if self.window is not None:
                kk, vv = keys_by_position(k, v, cache, self.window, T)  # (B, nkv, pos+T, hs)
                S = kk.shape[2]
                if S > self.window:
                    capture.key_from[self.layer_idx] = S - self.window  # the newest query's window
            capture.k[self.layer_idx] = kk
            capture.v[self.layer_idx] = vv
        # enable_gqa lets SDPA share each K/V head across n_head / n_kv_head query heads
        # without materialising repeated K/V.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=nkv != nh)  # (B, nh, T, hs)
        return y.transpose(1, 2).reshape(B, T, nh * hs)  # (B, T, nh*hs)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        C, H, b = config.n_embd, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(C, H, bias=b)
        self.up_proj = nn.Linear(C, H, bias=b)
        self.down_proj = nn.Linear(H, C, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SwiGLU: the SiLU-gated branch scales the linear one.
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, cache, mask, is_causal, capture):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask, is_causal, capture)
        return x + self.mlp(self.post_attention_layernorm(x))


def forward_mask(c: LlamaConfig, T: int, start: int, input_pos: torch.Tensor,
                 cache: "KVCache | None") -> tuple[torch.Tensor | None, bool]:
    """The attention mask of a forward over T new tokens after ``start`` cached ones, built once per
    forward, not per layer (the readable model and the accelerator on block codes share it). A
    chunked prefill needs it explicit, and so does a sliding window once the keys outgrow it, over
    the rows a windowed cache still holds (engine/models/attention.py)."""
    window = c.sliding_window
    if window is None:
        return attention_mask(T, start, input_pos)
    if cache is not None and cache.kind == "window":
        # A run-time window cache (WindowKVCache) evicts by its own rule, not the model's window,
        # and names no positions for the mask; every other kind keeps the model's window.
        raise ValueError("a sliding-window model keeps its own window in the cache; a run-time windowed "
                         "cache on top of it is not supported")
    return window_mask(T, start, input_pos, window, cache)


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # The embedding starts uninitialised (init_weights or a checkpoint fills it): nn.Embedding's
        # own normal_ init, run on the meta device by from_state_dict, would import torch's Python
        # decompositions (sympy and co.), ~2 s of cold start for a table about to be replaced.
        table = torch.empty(config.vocab_size, config.n_embd)
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(config.vocab_size, config.n_embd, _weight=table),
                layers=nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.n_layer)]),
                norm=RMSNorm(config.n_embd, config.rms_norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        # Derived, not learned: non-persistent, so they stay out of the state dict, follow .to(),
        # and are cast with the model (transformers also casts cos/sin to the activations' dtype).
        # Computed on the CPU even inside a meta-device context (same import cost as above).
        cos, sin = rope_tables(config, "cpu")
        self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, hs)
        self.register_buffer("rope_sin", sin, persistent=False)  # (block_size, hs)

    @classmethod
    def from_state_dict(cls, config: LlamaConfig, sd: dict[str, torch.Tensor]) -> "Llama":
        """A model that adopts the given tensors (no copy, no random init).

        Built on the meta device so the random weights of __init__ are never allocated; the
        tensors must already have the shapes of ``param_shapes(config)`` (the loaders check).
        """
        with torch.device("meta"):
            model = cls(config)
        if config.tie_word_embeddings:
            sd = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}
        model.load_state_dict(sd, strict=True, assign=True)
        model.tie_weights()  # assign gave lm_head its own Parameter; share embed_tokens' again
        like = sd["model.embed_tokens.weight"]
        model.rope_cos = model.rope_cos.to(like.device, like.dtype)
        model.rope_sin = model.rope_sin.to(like.device, like.dtype)
        return model

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def freeze(self) -> "Llama":
        """Eval mode and no grads: the model is shared read-only across app sessions."""
        self.eval()
        self.requires_grad_(False)
        return self

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """transformers' Llama initialisation: N(0, 0.02) matrices, zero biases, unit norms."""
        for name, p in self.named_parameters():  # a tied lm_head is listed once, as embed_tokens
            with torch.no_grad():
                if name.endswith("bias"):
                    p.zero_()
                elif name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=generator)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, a tied head counted once. non_embedding drops the input table when the
        LM head does not reuse it (Llama has no position embeddings to drop)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.config.tie_word_embeddings:
            n -= self.model.embed_tokens.weight.numel()
        return n

    def forward(
        self,
        idx: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        cache: "KVCache | None" = None,
        capture: "ForwardCapture | None" = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for ``idx`` (B, T).

        input_pos: (T,) absolute positions of the tokens; defaults to ``cache.pos + arange(T)``.
            They index the RoPE tables and, in a chunked prefill, the mask.
        cache: with one, K/V of the new positions are written at ``cache.pos`` and attention
            covers every cached position (prefill, decode, or chunked prefill); with a
            ``sliding_window``, the window of each query among the rows the cache holds. Without
            one the whole sequence is processed under a causal (or sliding) mask.
        last_only: compute logits for the last position only (all generation needs).
        Returns (B, T, V), or (B, 1, V) with last_only.
        """
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        end = start + T
        if end > self.config.block_size:
            raise ValueError(f"sequence of {end} tokens exceeds block_size {self.config.block_size}")
        if input_pos is None:
            input_pos = torch.arange(start, end, device=idx.device)
        mask, is_causal = forward_mask(self.config, T, start, input_pos, cache)
        cos = self.rope_cos.index_select(0, input_pos)  # (T, hs)
        sin = self.rope_sin.index_select(0, input_pos)  # (T, hs)
        x = self.model.embed_tokens(idx)  # (B, T, C)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, mask, is_causal, capture)
        if last_only:
            x = x[:, -1:, :]  # (B, 1, C)
        x = self.model.norm(x)
        return self.lm_head(x)  # (B, T|1, V)
