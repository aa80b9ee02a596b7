"""The one-token decode step, written flat: the hot loop of cached generation.

Same maths as ``GPT.forward`` with a cache and T=1 (tests hold the two allclose, and both to a
float64 reference and to transformers). It exists because a decode step of a small model is
bound by per-op overhead, not by arithmetic: on tiny, the module path spends more time in
Python, ``nn.Module.__call__`` and tiny kernels than in streaming the 12.9 MB of weights.
What this path does differently, each measured on tiny (2-core EPYC, fp32, in one process):

- it calls the functional ops directly: no ``Module.__call__`` (39 of them per step on tiny);
- every weight's per-thread column blocks (see ``kvviz.matmul``) are views prepared once
  in a ``DecodePlan``, not rebuilt with five view ops per matmul per step;
- on CPU in fp32 the one query row's attention is three ops (scaled scores, softmax, weighted
  sum). Inside a step, SDPA's CPU flash kernel cost ~60 us per call against ~30 us for these.
  CUDA and half precision keep SDPA (one fused kernel, fp32 accumulation).

Together: 0.77 vs 1.67 ms per step on tiny (module path), with the weight matmuls alone at ~0.5 ms.

A plan holds views of the weights, so it must be rebuilt after weights move or are replaced;
``GPT.freeze()`` (called after the final ``.to()``) does that, and ``plan_for`` rebuilds when
the intra-op thread count changes, since the split depends on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvviz.matmul import split_blocks

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.cache import KVCache
    from kvviz.model import GPT, Conv1D, ForwardCapture


@dataclass(frozen=True)
class PreparedMatmul:
    """One weight, ready for ``x @ w + b`` on (B, 1, in) rows."""

    w: torch.Tensor  # (in, out)
    bias: torch.Tensor | None  # (out,)
    blocks: torch.Tensor | None  # (s, in, out/s) column blocks of w (a view), when one row splits
    bias_blocks: torch.Tensor | None  # (s, 1, out/s) view of bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        B, _, n_in = x.shape  # (B, 1, in)
        if B == 1 and self.blocks is not None:
            rows = x.expand(self.blocks.shape[0], 1, n_in)  # (s, 1, in), no copy
            if self.bias_blocks is None:
                y = torch.bmm(rows, self.blocks)  # (s, 1, out/s)
            else:
                y = torch.baddbmm(self.bias_blocks, rows, self.blocks)  # (s, 1, out/s)
            return y.view(1, 1, -1)  # the blocks are the output's columns, in order
        x2 = x.view(B, n_in)  # (B, in)
        y = x2 @ self.w if self.bias is None else torch.addmm(self.bias, x2, self.w)  # (B, out)
        return y.view(B, 1, -1)


def prepare(w: torch.Tensor, bias: torch.Tensor | None, threads: int) -> PreparedMatmul:
    split = split_blocks(w, bias, threads)
    blocks, bias_blocks = split if split is not None else (None, None)
    return PreparedMatmul(w, bias, blocks, bias_blocks)


def _conv(m: "Conv1D", threads: int) -> PreparedMatmul:
    return prepare(m.weight.detach(), None if m.bias is None else m.bias.detach(), threads)


def _opt(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


@dataclass(frozen=True)
class LayerPlan:
    ln_1: tuple[torch.Tensor, torch.Tensor | None]  # LayerNorm weight, bias
    c_attn: PreparedMatmul  # (C, C + 2*kv_dim)
    c_proj: PreparedMatmul  # (C, C)
    ln_2: tuple[torch.Tensor, torch.Tensor | None]
    c_fc: PreparedMatmul  # (C, 4C)
    mlp_proj: PreparedMatmul  # (4C, C)


@dataclass(frozen=True)
class DecodePlan:
    threads: int  # torch.get_num_threads() the splits were made for
    wte: torch.Tensor  # (V, C)
    wpe: torch.Tensor  # (block_size, C)
    layers: tuple[LayerPlan, ...]
    ln_f: tuple[torch.Tensor, torch.Tensor | None]
    head: PreparedMatmul  # (C, V + pad): the padded, transposed copy of wte
    explicit_attention: bool  # three-op attention (CPU fp32) instead of SDPA
    zero: torch.Tensor  # () placeholder input of baddbmm(beta=0)


def build_plan(gpt: "GPT", threads: int) -> DecodePlan:
    assert gpt.lm_head_t is not None, "build_plan needs a frozen model"
    t = gpt.transformer
    layers = tuple(
        LayerPlan(
            ln_1=(b.ln_1.weight.detach(), _opt(b.ln_1.bias)),
            c_attn=_conv(b.attn.c_attn, threads),
            c_proj=_conv(b.attn.c_proj, threads),
            ln_2=(b.ln_2.weight.detach(), _opt(b.ln_2.bias)),
            c_fc=_conv(b.mlp.c_fc, threads),
            mlp_proj=_conv(b.mlp.c_proj, threads),
        )
        for b in t.h
    )
    w = t.wte.weight
    return DecodePlan(
        threads=threads, wte=w.detach(), wpe=t.wpe.weight.detach(), layers=layers,
        ln_f=(t.ln_f.weight.detach(), _opt(t.ln_f.bias)), head=prepare(gpt.lm_head_t, None, threads),
        explicit_attention=w.device.type == "cpu" and w.dtype == torch.float32,
        zero=torch.zeros((), dtype=w.dtype, device=w.device),
    )


def plan_for(gpt: "GPT") -> DecodePlan:
    """The model's plan for the current thread count (rebuilt, cheaply, when it changed)."""
    threads = torch.get_num_threads()
    plan = gpt.decode_plan
    if plan is None or plan.threads != threads:
        plan = gpt.decode_plan = build_plan(gpt, threads)  # a benign race: both builds are equal
    return plan


def decode_step(gpt: "GPT", idx: torch.Tensor, input_pos: torch.Tensor, cache: "KVCache",
                capture: "ForwardCapture | None") -> torch.Tensor:
    """Logits (B, 1, V) for one new token per row, idx (B, 1) at input_pos (1,), through the cache."""
    p = plan_for(gpt)
    c = gpt.config
    B = idx.shape[0]
    C, nh, nkv, hs = c.n_embd, c.n_head, c.kv_heads, c.head_dim
    g = nh // nkv  # query heads per K/V head
    eps = c.layer_norm_epsilon
    scale = 1.0 / math.sqrt(hs)
    # torch.embedding / torch.layer_norm: the ATen ops without F's Python argument checks.
    x = torch.embedding(p.wte, idx) + torch.embedding(p.wpe, input_pos)  # (B, 1, C)
    for i, lp in enumerate(p.layers):
        h = torch.layer_norm(x, (C,), lp.ln_1[0], lp.ln_1[1], eps)  # (B, 1, C)
        qkv = lp.c_attn(h)  # (B, 1, C + 2*kv_dim)
        if nkv == nh:
            q, k, v = qkv.view(B, 3, nh, 1, hs).unbind(1)  # each (B, nh, 1, hs): T=1 needs no permute
        else:
            q, k, v = qkv.split([C, nkv * hs, nkv * hs], dim=2)
            q = q.view(B, nh, 1, hs)  # (B, nh, 1, hs)
            k = k.view(B, nkv, 1, hs)  # (B, nkv, 1, hs)
            v = v.view(B, nkv, 1, hs)
        k, v = cache.update(i, k, v)  # every cached position: (B, nkv, S, hs)
        if capture is not None and i in capture.layers:
            capture.q_last[i], capture.k[i], capture.v[i] = q, k, v
        if p.explicit_attention:
            S = k.shape[2]
            # Query head h reads K/V head h // g, so the g heads of a group are one bmm row block.
            q3 = q.reshape(B * nkv, g, hs)  # (B*nkv, g, hs), a view when B == 1
            scores = torch.baddbmm(p.zero, q3, k.reshape(B * nkv, S, hs).transpose(1, 2),
                                   beta=0.0, alpha=scale)  # (B*nkv, g, S)
            y = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(B * nkv, S, hs))  # (B*nkv, g, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=nkv != nh)  # (B, nh, 1, hs)
        x = x + lp.c_proj(y.view(B, 1, C))  # heads in order are the C columns
        h = torch.layer_norm(x, (C,), lp.ln_2[0], lp.ln_2[1], eps)
        x = x + lp.mlp_proj(F.gelu(lp.c_fc(h), approximate="tanh"))  # GPT-2's gelu_new
    x = torch.layer_norm(x, (C,), p.ln_f[0], p.ln_f[1], eps)
    return p.head(x)[..., : c.vocab_size]  # (B, 1, V): the padding columns dropped
