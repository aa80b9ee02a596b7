"""The one-token decode step, written flat: the hot loop of cached generation.

Same maths as ``GPT.forward`` with a cache and T=1 (tests hold the two allclose, and both to a
float64 reference and to transformers). It exists because a decode step of a small model is
bound by per-op overhead, not by arithmetic: on tiny, the module path spends more time in
Python, ``nn.Module.__call__`` and small kernels than in streaming the 12.9 MB of weights, and
every op, even a view, costs about a microsecond of Python and dispatch (40 extra ops added
0.8-1.0 us each to a step). So this path counts ops:

- functional ops only: no ``Module.__call__`` (39 of them per step on tiny);
- weights prepared once, in a ``DecodePlan``: views of the parameters, except each row split's
  accumulator, which holds a copy of its bias;
- one row, 2+ CPU threads, fp32: every matmul is split so that each thread streams its share
  of the weights (see ``kvviz.matmul``), and the splits chain without glue ops. The residual
  stream is kept as s identical rows (s, 1, C), so a LayerNorm's output is already the input a
  column split wants: c_attn, c_fc and the LM head split by output columns. Their outputs, the
  row cut into s pieces, are exactly what a split by input rows wants: c_proj (fed by the
  attention output) and the MLP projection (fed by GELU of c_fc's blocks) each multiply their
  piece by a row block of the weight, and one sum adds the partial products. 21 ops per layer
  instead of 27.

Measured on tiny (2-core EPYC, fp32, best of 60 interleaved repeats in one process): this step
643 us against 1,075 us for the module path; in an earlier pair of runs, the chained splits
against column splits alone, 550 vs 669 us (the weight matmuls alone: 338 us). Batches, one
thread, half precision and odd widths take the same flat step through ``row_matmul``.

``GPT.freeze()`` (called after the final ``.to()``) builds the plan. ``plan_for`` rebuilds it
when the intra-op thread count changes (the splits depend on it) and when a bias it copied was
changed in place (its version counter moved), so a ``load_state_dict`` without a new
``freeze()`` cannot leave the split path with stale biases. Replaced or moved weights still
need ``freeze()``, as the LM head copy does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvviz.matmul import row_matmul, split_blocks, split_rows

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.cache import KVCache
    from kvviz.model import GPT, Conv1D, ForwardCapture


@dataclass(frozen=True)
class SplitMatmul:
    """One weight split across s threads for a single row (a batched matmul of s blocks).

    by_rows False: ``blocks`` (s, in, out/s) are column blocks; the input is the row repeated s
    times (s, 1, in) and the output (s, 1, out/s) is the full output row in block order.
    by_rows True: ``blocks`` (s, in/s, out) are row blocks; the input is the row cut in s pieces
    (s, 1, in/s) and the output is the sum of the partial products, (1, 1, out).
    """

    blocks: torch.Tensor
    acc: torch.Tensor | None  # the bias laid out as the accumulator: (s, 1, out/s) or (s, 1, out)
    by_rows: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.bmm(x, self.blocks) if self.acc is None else torch.baddbmm(self.acc, x, self.blocks)
        return y.sum(0, keepdim=True) if self.by_rows else y


@dataclass(frozen=True)
class Matmul:
    """A weight (in, out) and bias, with its one-row split when the plan has one."""

    w: torch.Tensor  # (in, out)
    bias: torch.Tensor | None  # (out,)
    split: SplitMatmul | None

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Several rows (or no split): (B, 1, in) -> (B, 1, out) through ``row_matmul``."""
        B, _, n_in = x.shape
        return row_matmul(x.reshape(B, n_in), self.w, self.bias).view(B, 1, -1)


def _matmul(w: torch.Tensor, bias: torch.Tensor | None, threads: int, by_rows: bool) -> Matmul:
    w = w.detach()
    bias = None if bias is None else bias.detach()
    split = None
    if by_rows:
        rows = split_rows(w, bias, threads)
        if rows is not None:
            split = SplitMatmul(rows[0], rows[1], True)
    else:
        cols = split_blocks(w, bias, threads)
        if cols is not None:
            split = SplitMatmul(cols[0], cols[1], False)
    return Matmul(w, bias, split)


def _conv(m: "Conv1D", threads: int, by_rows: bool) -> Matmul:
    return _matmul(m.weight, m.bias, threads, by_rows)


def _opt(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


@dataclass(frozen=True)
class LayerPlan:
    ln_1_w: torch.Tensor  # (C,)
    ln_1_b: torch.Tensor | None
    c_attn: Matmul  # (C, C + 2*kv_dim), split by columns
    c_proj: Matmul  # (C, C), split by rows
    ln_2_w: torch.Tensor
    ln_2_b: torch.Tensor | None
    c_fc: Matmul  # (C, 4C), split by columns
    mlp_proj: Matmul  # (4C, C), split by rows


@dataclass(frozen=True)
class DecodePlan:
    threads: int  # torch.get_num_threads() the splits were made for
    wte: torch.Tensor  # (V, C)
    wpe: torch.Tensor  # (block_size, C)
    layers: tuple[LayerPlan, ...]
    ln_f_w: torch.Tensor
    ln_f_b: torch.Tensor | None
    head: Matmul  # (C, V + pad): the padded, transposed copy of wte, split by columns
    split: bool  # every matmul has its split: one row takes the chained-split step
    copied: tuple[tuple[torch.Tensor, int], ...] = ()  # (bias, its _version) for every bias copied

    def stale(self) -> bool:
        """A copied bias was changed in place since the plan was built."""
        return any(t._version != v for t, v in self.copied)

    def matmuls(self) -> list[Matmul]:
        return _step_matmuls(self.layers, self.head)


def _step_matmuls(layers: tuple[LayerPlan, ...], head: Matmul) -> list[Matmul]:
    """Every weight matmul of a step, in order: each layer's four, then the LM head."""
    return [m for lp in layers for m in (lp.c_attn, lp.c_proj, lp.c_fc, lp.mlp_proj)] + [head]


def build_plan(gpt: "GPT", threads: int) -> DecodePlan:
    assert gpt.lm_head_t is not None, "build_plan needs a frozen model"
    t = gpt.transformer
    layers = tuple(
        LayerPlan(
            ln_1_w=b.ln_1.weight.detach(), ln_1_b=_opt(b.ln_1.bias),
            c_attn=_conv(b.attn.c_attn, threads, by_rows=False),
            c_proj=_conv(b.attn.c_proj, threads, by_rows=True),
            ln_2_w=b.ln_2.weight.detach(), ln_2_b=_opt(b.ln_2.bias),
            c_fc=_conv(b.mlp.c_fc, threads, by_rows=False),
            mlp_proj=_conv(b.mlp.c_proj, threads, by_rows=True),
        )
        for b in t.h
    )
    head = _matmul(gpt.lm_head_t, None, threads, by_rows=False)
    mats = _step_matmuls(layers, head)
    # A detached bias shares its parameter's version counter, so in-place loads show up here.
    copied = tuple((m.bias, m.bias._version) for m in mats
                   if m.bias is not None and m.split is not None and m.split.by_rows)
    return DecodePlan(threads=threads, wte=t.wte.weight.detach(), wpe=t.wpe.weight.detach(), layers=layers,
                      ln_f_w=t.ln_f.weight.detach(), ln_f_b=_opt(t.ln_f.bias), head=head,
                      split=all(m.split is not None for m in mats), copied=copied)


def plan_for(gpt: "GPT") -> DecodePlan:
    """The model's plan, rebuilt (cheaply) when the thread count changed or a copied bias moved."""
    threads = torch.get_num_threads()
    plan = gpt.decode_plan
    if plan is None or plan.threads != threads or plan.stale():
        plan = gpt.decode_plan = build_plan(gpt, threads)  # a benign race: both builds are equal
    return plan


def _qkv(qkv: torch.Tensor, B: int, nh: int, nkv: int, hs: int) -> tuple[torch.Tensor, ...]:
    """One row's q, k, v: q (B, nh, 1, hs), k and v (B, nkv, 1, hs); T=1 needs no permute.

    qkv is (B, 1, C + 2*kv_dim), or with B == 1 c_attn's column blocks (s, 1, (C + 2*kv_dim)/s),
    which are the same row in the same memory order.
    """
    if nkv == nh:
        return qkv.view(B, 3, nh, 1, hs).unbind(1)
    q, k, v = qkv.view(B, -1).split([nh * hs, nkv * hs, nkv * hs], dim=1)  # (B, C), (B, kvd), (B, kvd)
    return q.view(B, nh, 1, hs), k.view(B, nkv, 1, hs), v.view(B, nkv, 1, hs)


def decode_step(gpt: "GPT", idx: torch.Tensor, input_pos: torch.Tensor, cache: "KVCache",
                capture: "ForwardCapture | None") -> torch.Tensor:
    """Logits (B, 1, V) for one new token per row, idx (B, 1) at input_pos (1,), through the cache."""
    p = plan_for(gpt)
    c = gpt.config
    B = idx.shape[0]
    C, nh, nkv, hs, eps = c.n_embd, c.n_head, c.kv_heads, c.head_dim, c.layer_norm_epsilon
    s = p.threads if (B == 1 and p.split) else 0  # the chained-split step, or plain GEMMs
    # torch.embedding / torch.layer_norm: the ATen ops without F's Python argument checks.
    x = torch.embedding(p.wte, idx) + torch.embedding(p.wpe, input_pos)  # (B, 1, C)
    if s:
        x = x.expand(s, 1, C)  # the residual stream as s identical rows (materialized by the first add)
    for i, lp in enumerate(p.layers):
        h = torch.layer_norm(x, (C,), lp.ln_1_w, lp.ln_1_b, eps)  # (s|B, 1, C)
        qkv = lp.c_attn.split(h) if s else lp.c_attn.rows(h)  # (s, 1, (C+2kvd)/s) | (B, 1, C+2kvd)
        q, k, v = _qkv(qkv, B, nh, nkv, hs)
        k, v = cache.update(i, k, v)  # every cached position: (B, nkv, S, hs)
        if capture is not None and i in capture.layers:
            capture.q_last[i], capture.k[i], capture.v[i] = q, k, v
        y = F.scaled_dot_product_attention(q, k, v, enable_gqa=nkv != nh)  # (B, nh, 1, hs)
        if s:
            x = x + lp.c_proj.split(y.view(s, 1, C // s))  # (s, 1, C) + (1, 1, C): the pieces of the row
            h = torch.layer_norm(x, (C,), lp.ln_2_w, lp.ln_2_b, eps)  # (s, 1, C)
            x = x + lp.mlp_proj.split(F.gelu(lp.c_fc.split(h), approximate="tanh"))  # (s, 1, 4C/s) -> (1, 1, C)
        else:
            x = x + lp.c_proj.rows(y.view(B, 1, C))  # heads in order are the C columns
            h = torch.layer_norm(x, (C,), lp.ln_2_w, lp.ln_2_b, eps)
            x = x + lp.mlp_proj.rows(F.gelu(lp.c_fc.rows(h), approximate="tanh"))  # GPT-2's gelu_new
    x = torch.layer_norm(x, (C,), p.ln_f_w, p.ln_f_b, eps)
    logits = p.head.split(x).view(1, 1, -1) if s else p.head.rows(x)  # (B, 1, V + pad)
    return logits[..., : c.vocab_size]  # (B, 1, V): the padding columns dropped
