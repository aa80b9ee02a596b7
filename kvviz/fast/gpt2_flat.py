"""The accelerator's GPT-2: the same maths as ``engine/models/gpt2.py``, written flat.

It exists because a decode step of a small model is bound by per-op overhead and by streaming the
weights, not by arithmetic: the module path spends more time in Python, ``nn.Module.__call__``
and small kernels than in reading the weights, and every op, even a view, pays for Python and
the dispatcher. So this path counts ops:

- functional ops only, no ``Module.__call__``, with the weights prepared once in a
  ``DecodePlan`` of views of the parameters (no copies, except the LM head's transposed copy);
- the matmuls of a few rows split across the CPU's threads by output columns (``matmul.py``);
- one row (a cached decode step, batch 1, fp32, CPU with a C compiler): each layer is four calls
  into C (``rowops.py``), each fusing the matmul with what surrounds it: LN1 + c_attn,
  c_proj + residual, LN2 + c_fc + GELU, MLP projection + residual; ln_f + the LM head once.

Tests hold it allclose to the readable model, to a float64 reference and to transformers.
``docs/performance.md`` has the measurements behind each choice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvviz.engine.models.attention import attention_mask
from kvviz.fast.common import PlanCache, opt, split_qkv
from kvviz.fast.matmul import row_matmul
from kvviz.fast.rowops import RowLinear, row_linear

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.engine.kvcache.dense import KVCache
    from kvviz.engine.generation.capture import ForwardCapture
    from kvviz.engine.models.gpt2_config import GPTConfig
    from kvviz.engine.models.gpt2 import GPT, Conv1D


@dataclass(frozen=True)
class Matmul:
    """A weight (in, out) and its bias, for rows through ``row_matmul``."""

    w: torch.Tensor  # (in, out)
    bias: torch.Tensor | None  # (out,)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, in) -> (B, T, out)."""
        B, T, n_in = x.shape
        return row_matmul(x.reshape(B * T, n_in), self.w, self.bias).view(B, T, -1)

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + (self.bias.nbytes if self.bias is not None else 0)


def _conv(m: "Conv1D") -> Matmul:
    return Matmul(m.weight.detach(), opt(m.bias))


@dataclass(frozen=True)
class LayerPlan:
    ln_1_w: torch.Tensor  # (C,)
    ln_1_b: torch.Tensor | None
    c_attn: Matmul  # (C, C + 2*kv_dim)
    c_proj: Matmul  # (C, C)
    ln_2_w: torch.Tensor
    ln_2_b: torch.Tensor | None
    c_fc: Matmul  # (C, 4C)
    mlp_proj: Matmul  # (4C, C)


@dataclass(frozen=True)
class LayerRowOps:
    """A layer's four fused one-row calls into C (kvviz.fast.rowops)."""

    attn_in: RowLinear  # LN1 + c_attn: x (C,) -> qkv (C + 2*kv_dim,)
    attn_out: RowLinear  # c_proj + residual: y (C,), x -> x + y @ W + b
    mlp_in: RowLinear  # LN2 + c_fc + GELU: x (C,) -> (4C,)
    mlp_out: RowLinear  # MLP projection + residual: h (4C,), x -> x + h @ W + b


@dataclass(frozen=True)
class RowPlan:
    """The whole one-row step's calls into C: four per layer, then ln_f + the LM head."""

    layers: tuple[LayerRowOps, ...]
    head: RowLinear  # ln_f + LM head: x (C,) -> (V + pad,)


@dataclass(frozen=True)
class DecodePlan:
    threads: int  # torch.get_num_threads() the row ops were made for
    wte: torch.Tensor  # (V, C)
    wpe: torch.Tensor  # (block_size, C)
    layers: tuple[LayerPlan, ...]
    ln_f_w: torch.Tensor
    ln_f_b: torch.Tensor | None
    head: Matmul  # (C, V + pad): the padded, transposed copy of wte
    rows: RowPlan | None = None  # one row through C; None where it cannot run

    def matmuls(self) -> list[Matmul]:
        """Every weight matmul of a step, in order: each layer's four, then the LM head."""
        return [m for lp in self.layers for m in (lp.c_attn, lp.c_proj, lp.c_fc, lp.mlp_proj)] + [self.head]


def _row_plan(gpt: "GPT", layers: tuple[LayerPlan, ...], head: Matmul, threads: int) -> RowPlan | None:
    """The C row ops for every layer and the head, or None if any of them cannot be had."""
    eps = gpt.config.layer_norm_epsilon
    ops = []
    for lp in layers:
        four = (row_linear(lp.c_attn.w, lp.c_attn.bias, threads, ln=(lp.ln_1_w, lp.ln_1_b, eps)),
                row_linear(lp.c_proj.w, lp.c_proj.bias, threads),
                row_linear(lp.c_fc.w, lp.c_fc.bias, threads, ln=(lp.ln_2_w, lp.ln_2_b, eps), gelu=True),
                row_linear(lp.mlp_proj.w, lp.mlp_proj.bias, threads))
        if any(op is None for op in four):
            return None
        ops.append(LayerRowOps(*four))  # type: ignore[arg-type]
    t = gpt.transformer
    head_row = row_linear(head.w, None, threads, ln=(t.ln_f.weight.detach(), opt(t.ln_f.bias), eps))
    return None if head_row is None else RowPlan(tuple(ops), head_row)


def lm_head_t(gpt: "GPT") -> torch.Tensor:
    """wte as (C, V + pad): the LM head is the biggest matmul of a decode step, and the (in, out)
    layout runs it ~2x faster on CPU. Padded to a multiple of 64 columns so ``row_matmul`` can
    split it across threads even for an odd vocabulary (GPT-2's 50,257); steps slice it off."""
    wte = gpt.transformer.wte.weight.detach()  # (V, C)
    pad = -wte.shape[0] % 64
    return torch.cat([wte, wte.new_zeros(pad, wte.shape[1])]).t().contiguous()  # (C, V + pad)


def build_plan(gpt: "GPT", threads: int, head_t: torch.Tensor | None = None) -> DecodePlan:
    """Views of the model's weights (read in place) and the C row ops for ``threads`` threads."""
    t = gpt.transformer
    layers = tuple(
        LayerPlan(
            ln_1_w=b.ln_1.weight.detach(), ln_1_b=opt(b.ln_1.bias), c_attn=_conv(b.attn.c_attn),
            c_proj=_conv(b.attn.c_proj), ln_2_w=b.ln_2.weight.detach(), ln_2_b=opt(b.ln_2.bias),
            c_fc=_conv(b.mlp.c_fc), mlp_proj=_conv(b.mlp.c_proj),
        )
        for b in t.h
    )
    head = Matmul(lm_head_t(gpt) if head_t is None else head_t, None)
    return DecodePlan(threads=threads, wte=t.wte.weight.detach(), wpe=t.wpe.weight.detach(), layers=layers,
                      ln_f_w=t.ln_f.weight.detach(), ln_f_b=opt(t.ln_f.bias), head=head,
                      rows=_row_plan(gpt, layers, head, threads))


class FastGPT2:
    """The accelerator for one frozen GPT-2, held beside it (never on the ``nn.Module``).

    ``forward`` has the model's signature and result. Plans depend on the intra-op thread count
    (the C row ops split columns by it), so one is kept per count, built on first use.
    """

    name = "fast"

    def __init__(self, gpt: "GPT") -> None:
        self.gpt = gpt
        self.config = gpt.config
        self._head_t = lm_head_t(gpt)  # the one copy this accelerator makes; rebuild() refreshes it
        self._plans = PlanCache(lambda threads: build_plan(self.gpt, threads, self._head_t))

    def rebuild(self) -> None:
        """After replacing or moving parameters (an in-place load is seen without it)."""
        with self._plans.lock:
            self._head_t = lm_head_t(self.gpt)
            self._plans.clear()

    def plan(self) -> DecodePlan:
        return self._plans.get()

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, cache: "KVCache | None" = None,
                capture: "ForwardCapture | None" = None, last_only: bool = False) -> torch.Tensor:
        """Logits (B, T|1, V), as ``GPT.forward`` gives them."""
        p = self.plan()
        if idx.shape[1] == 1 and cache is not None:
            return decode_step(self.config, p, idx, input_pos, cache, capture)
        return forward_rows(self.config, p, idx, input_pos, cache, capture, last_only)


def decode_step(c: "GPTConfig", p: DecodePlan, idx: torch.Tensor, input_pos: torch.Tensor, cache: "KVCache",
                capture: "ForwardCapture | None") -> torch.Tensor:
    """Logits (B, 1, V) for one new token per row, idx (B, 1) at input_pos (1,), through the cache."""
    if idx.shape[0] == 1 and p.rows is not None:
        return _one_row(c, p, p.rows, idx, input_pos, cache, capture)
    B = idx.shape[0]
    C, nh, nkv, hs, eps = c.n_embd, c.n_head, c.kv_heads, c.head_dim, c.layer_norm_epsilon
    # torch.embedding / torch.layer_norm: the ATen ops without F's Python argument checks.
    x = torch.embedding(p.wte, idx) + torch.embedding(p.wpe, input_pos)  # (B, 1, C)
    for i, lp in enumerate(p.layers):
        h = torch.layer_norm(x, (C,), lp.ln_1_w, lp.ln_1_b, eps)  # (B, 1, C)
        q, k, v = split_qkv(lp.c_attn.rows(h), B, nh, nkv, hs)  # from (B, 1, C + 2kvd)
        k, v = cache.update(i, k, v)  # every cached position: (B, nkv, S, hs)
        if capture is not None and i in capture.layers:
            capture.q_last[i], capture.k[i], capture.v[i] = q, k, v
        y = F.scaled_dot_product_attention(q, k, v, enable_gqa=nkv != nh)  # (B, nh, 1, hs)
        x = x + lp.c_proj.rows(y.view(B, 1, C))  # heads in order are the C columns
        h = torch.layer_norm(x, (C,), lp.ln_2_w, lp.ln_2_b, eps)
        x = x + lp.mlp_proj.rows(F.gelu(lp.c_fc.rows(h), approximate="tanh"))  # GPT-2's gelu_new
    x = torch.layer_norm(x, (C,), p.ln_f_w, p.ln_f_b, eps)
    return p.head.rows(x)[..., : c.vocab_size]  # (B, 1, V): the padding columns dropped


def _one_row(c: "GPTConfig", p: DecodePlan, rows: RowPlan, idx: torch.Tensor, input_pos: torch.Tensor,
             cache: "KVCache", capture: "ForwardCapture | None") -> torch.Tensor:
    """The step for one row through the fused C row ops: the residual stream is a (C,) vector."""
    nh, nkv, hs = c.n_head, c.kv_heads, c.head_dim
    x = torch.embedding(p.wte, idx) + torch.embedding(p.wpe, input_pos)  # (1, 1, C), contiguous
    for i, op in enumerate(rows.layers):
        q, k, v = split_qkv(op.attn_in(x), 1, nh, nkv, hs)  # LN1 + c_attn: (C + 2kvd,) -> views
        k, v = cache.update(i, k, v)  # every cached position: (1, nkv, S, hs)
        if capture is not None and i in capture.layers:
            capture.q_last[i], capture.k[i], capture.v[i] = q, k, v
        # (1, nh, 1, hs): for one row and one query its memory is the C columns in head order;
        # contiguous() is a no-op here that guarantees the raw pointer the C side reads.
        y = F.scaled_dot_product_attention(q, k, v, enable_gqa=nkv != nh)
        x = op.attn_out(y.contiguous(), x)  # x + y @ c_proj + b: (C,)
        x = op.mlp_out(op.mlp_in(x), x)  # x + gelu(LN2(x) @ c_fc + b) @ proj + b: (C,)
    return rows.head(x)[: c.vocab_size].view(1, 1, -1)  # ln_f + LM head: (1, 1, V), padding dropped


def forward_rows(c: "GPTConfig", p: DecodePlan, idx: torch.Tensor, input_pos: torch.Tensor,
                 cache: "KVCache | None", capture: "ForwardCapture | None", last_only: bool) -> torch.Tensor:
    """Logits for T tokens per row (prefill, chunked prefill, or a whole uncached sequence).

    ``GPT.forward``'s maths and masks, with functional ops and the split matmuls.
    """
    B, T = idx.shape
    C, nh, nkv, hs, eps = c.n_embd, c.n_head, c.kv_heads, c.head_dim, c.layer_norm_epsilon
    start = cache.pos if cache is not None else 0
    if start + T > c.block_size:
        raise ValueError(f"sequence of {start + T} tokens exceeds block_size {c.block_size}")
    mask, is_causal = attention_mask(T, start, input_pos)  # as GPT.forward builds them
    x = torch.embedding(p.wte, idx) + torch.embedding(p.wpe, input_pos)  # (B, T, C)
    kvd = nkv * hs
    for i, lp in enumerate(p.layers):
        h = torch.layer_norm(x, (C,), lp.ln_1_w, lp.ln_1_b, eps)  # (B, T, C)
        q, k, v = lp.c_attn.rows(h).split([C, kvd, kvd], dim=2)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if cache is not None:
            k, v = cache.update(i, k, v)  # every cached position: (B, nkv, S, hs)
        if capture is not None and i in capture.layers:
            capture.q_last[i], capture.k[i], capture.v[i] = q[:, :, -1:, :], k, v
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=nkv != nh)  # (B, nh, T, hs)
        x = x + lp.c_proj.rows(y.transpose(1, 2).reshape(B, T, C))  # heads side by side: (B, T, C)
        h = torch.layer_norm(x, (C,), lp.ln_2_w, lp.ln_2_b, eps)
        x = x + lp.mlp_proj.rows(F.gelu(lp.c_fc.rows(h), approximate="tanh"))  # GPT-2's gelu_new
    if last_only:
        x = x[:, -1:, :]  # (B, 1, C)
    x = torch.layer_norm(x, (C,), p.ln_f_w, p.ln_f_b, eps)
    return p.head.rows(x)[..., : c.vocab_size]  # (B, T|1, V): the padding columns dropped
