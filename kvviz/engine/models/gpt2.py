"""GPT-2, written to be read (nanoGPT style): one forward for prefill, decode and chunked prefill.

Parameter names follow GPT-2 (``transformer.wte``, ``h.{i}.attn.c_attn``, ...) and the linear
layers keep GPT-2's Conv1D ``(in, out)`` weight layout, so a Hugging Face GPT-2 checkpoint loads
one to one, without transposes.

The forward pass never advances a cache: it writes the K/V of the positions it is given at
``cache.pos`` and reads everything up to ``cache.pos + T``; the generator calls ``cache.advance``.

This file has no performance branches. The accelerator (``kvviz.fast``) runs the same maths
flat, beside the model, and the generation loop says which of the two runs a step.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvviz.engine.models.attention import attention_mask
from kvviz.engine.generation.capture import ForwardCapture
from kvviz.engine.models.gpt2_config import GPTConfig

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.engine.kvcache.dense import KVCache


class Conv1D(nn.Module):
    """GPT-2's "Conv1D": a linear layer whose weight is stored (in, out).

    Same maths as nn.Linear; the (in, out) layout is GPT-2's own, so Hugging Face checkpoints
    load without a transpose (and it streams faster for one-row matmuls on CPU, which
    ``kvviz.fast`` relies on).
    """

    def __init__(self, n_in: int, n_out: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))  # (in, out)
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight  # (B, T, in) @ (in, out) -> (B, T, out)
        return y if self.bias is None else y + self.bias


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.head_dim
        self.kv_dim = self.n_kv_head * self.head_dim
        # One fused projection for q, k and v, as in GPT-2; with GQA k and v are narrower.
        self.c_attn = Conv1D(config.n_embd, config.n_embd + 2 * self.kv_dim, bias=config.bias)
        self.c_proj = Conv1D(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(
        self,
        x: torch.Tensor,
        cache: "KVCache | None",
        mask: torch.Tensor | None,
        is_causal: bool,
        capture: ForwardCapture | None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x)  # (B, T, C + 2*kv_dim)
        q, k, v = qkv.split([C, self.kv_dim, self.kv_dim], dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if cache is not None:
            # Writes the new positions and returns every cached position: (B, nkv, S, hs).
            k, v = cache.update(self.layer_idx, k, v)
        if capture is not None and self.layer_idx in capture.layers:
            capture.q_last[self.layer_idx] = q[:, :, -1:, :]
            capture.k[self.layer_idx] = k
            capture.v[self.layer_idx] = v
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=self.n_kv_head != self.n_head
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, nh, hs) -> (B, T, C): heads side by side
        y = self.c_proj(y)
        return F.dropout(y, self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = Conv1D(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new" is the tanh approximation; exact GELU would break HF parity.
        y = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        return F.dropout(y, self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache, mask, is_causal, capture):  # type: ignore[no-untyped-def]
        x = x + self.attn(self.ln_1(x), cache, mask, is_causal, capture)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def freeze(self) -> "GPT":
        """Eval mode and no grads: a loaded model is shared read-only (across app sessions too)."""
        self.eval()
        self.requires_grad_(False)
        return self

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 0.02
                with torch.no_grad():
                    p.normal_(0.0, std, generator=generator)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self,
        idx: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        cache: "KVCache | None" = None,
        capture: ForwardCapture | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for ``idx`` (B, T).

        input_pos: (T,) absolute positions of the tokens; defaults to ``cache.pos + arange(T)``.
        cache: with one, K/V of the new positions are written at ``cache.pos`` and attention
            covers every cached position (prefill, decode, or chunked prefill). Without one the
            whole sequence is processed under a causal mask.
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
        # Built once per forward, not per layer; a chunked prefill needs it explicit (engine/models/attention.py).
        mask, is_causal = attention_mask(T, start, input_pos)
        x = self.transformer.wte(idx) + self.transformer.wpe(input_pos)  # (B, T, C)
        x = F.dropout(x, self.config.dropout, self.training)
        for block in self.transformer.h:
            x = block(x, cache, mask, is_causal, capture)
        if last_only:
            x = x[:, -1:, :]  # (B, 1, C)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (B, T|1, V)
