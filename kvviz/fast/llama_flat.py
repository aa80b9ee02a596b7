"""The accelerator's Llama: the same maths as ``engine/models/llama.py``, written flat.

A decode step of SmolLM2 (30 layers of seven weights, then the tied 49,152 x 576 LM head) is
bound by streaming its weights, 513 MiB in fp32, and on a small CPU by the ~40 PyTorch ops per
layer around them. So this path, like ``gpt2.py``, reads the weights in place from a plan of
views built once per thread count, and counts ops:

- rows through C (``rowops.row_dot``, nn.Linear's own (out, in) layout, no transposed copy, the
  tied head read straight from the embedding), four calls per layer: RMSNorm + q|k|v + RoPE on
  q and k; o_proj + residual; RMSNorm + SwiGLU (gate and up read in one pass); down_proj +
  residual; then model.norm + the LM head. Between them only the cache write and SDPA run in
  PyTorch; on a static cache of batch 1 (the app's and the CLI's decode steps) even those
  move into C, the whole step in one call (``fast/rowstep.py``: 1.2x faster on SmolLM2 at 2
  threads). This serves every forward of up to ``RowPlan.max_rows`` rows (batch x tokens):
  decode steps, batches and short prefills; longer fp32 forwards go to MKL's GEMM, which wins
  once the rows are many (the crossover moves with the thread count).
- bf16 weights go through the same C calls, widened to fp32 as they are read (half the bytes
  streamed), with fp32 activations: the residual stream, RoPE (exact fp32 tables) and attention
  run in fp32, K/V are stored in the cache's dtype, and the logits come back in the model's
  dtype, as ``Llama.forward`` returns them. Every bf16 forward goes through C: PyTorch's bf16
  GEMM on a CPU without bf16 instructions is many times slower than fp32.
- without the C kernel (no compiler, ``KVVIZ_ROWOPS=0``, CUDA, fp16), functional PyTorch ops in
  the model's dtype, the readable model's maths without ``Module.__call__``.

It computes Llama and Qwen2 (whose q/k/v biases the calls into C add before RoPE). ``declines``
names the kin it does not: Qwen3's per-head q/k RMSNorm sits between the projection and RoPE,
inside one fused call, and a sliding window needs a mask the one-row step never builds; for
those ``fast.build`` returns None and the readable model runs, never a near miss (loaded from a
GGUF with block codes, every kin runs on them instead: ``llama_codes.py``).

Norm weights, biases and the RoPE tables are views of the model's fp32 tensors; a bf16 model's
are widened into fp32 copies once (a few KB per layer, and the tables), refreshed by
``rebuild()``. Tests hold it to the readable model, to a float64 reference and to transformers;
``docs/performance.md`` has the measurements behind each choice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvviz.engine.models.llama import rope_tables
from kvviz.engine.models.attention import attention_mask
from kvviz.fast.common import PlanCache, opt, split_qkv
from kvviz.fast.rowops import RowDot, row_dot
from kvviz.fast.rowstep import step_for

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.engine.kvcache.dense import KVCache
    from kvviz.engine.generation.capture import ForwardCapture
    from kvviz.engine.models.llama import Llama, LlamaConfig

# The most rows (batch x tokens) of an fp32 forward that go through C, by intra-op thread count;
# more go to MKL's GEMM, which computes faster once the rows are many (docs/performance.md has
# the crossovers: about 12 rows on one thread, about 40 on two). bf16 always takes C.
MAX_C_ROWS_FP32 = {1: 8}
MAX_C_ROWS_FP32_MORE_THREADS = 32


def declines(c: "LlamaConfig") -> bool:
    """Whether this accelerator leaves the model to the readable path: Qwen3's q/k norms or a window."""
    return c.qk_norm or c.sliding_window is not None


def max_c_rows_fp32(threads: int) -> int:
    return MAX_C_ROWS_FP32.get(threads, MAX_C_ROWS_FP32_MORE_THREADS)


@dataclass(frozen=True)
class Linear:
    """One fused call's weights, (out, in) views, their outputs side by side (q|k|v, gate|up)."""

    ws: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., sum of outs), through PyTorch."""
        outs = [F.linear(x, w, b) for w, b in zip(self.ws, self.biases)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def row_op(self, threads: int) -> RowDot | None:
        """The bare call into C (no norm, SwiGLU, residual or RoPE), or None where it cannot run:
        the weight streaming a fused call does, alone (the bench's floor)."""
        return row_dot(self.ws, [_f32(b) for b in self.biases], threads)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.ws) + sum(b.nbytes for b in self.biases if b is not None)


@dataclass(frozen=True)
class LayerPlan:
    in_norm: torch.Tensor  # (C,) input_layernorm
    qkv: Linear  # q_proj (nh hs, C), k_proj and v_proj (nkv hs, C)
    o: Linear  # o_proj (C, nh hs)
    post_norm: torch.Tensor  # (C,) post_attention_layernorm
    gate_up: Linear  # gate_proj and up_proj, (I, C) each
    down: Linear  # down_proj (C, I)


@dataclass(frozen=True)
class LayerRowOps:
    """A layer's four fused calls into C (kvviz.fast.rowops.RowDot)."""

    attn_in: RowDot  # RMSNorm + q|k|v + RoPE: x (m, C) -> (m, (nh + 2 nkv) hs)
    attn_out: RowDot  # o_proj + residual: y (m, nh hs), x -> x + y Wo^T
    mlp_in: RowDot  # RMSNorm + SwiGLU: x (m, C) -> silu(gate) * up (m, I)
    mlp_out: RowDot  # down_proj + residual: h (m, I), x -> x + h Wd^T


@dataclass(frozen=True)
class RowPlan:
    """Every call into C of a forward: four per layer, then model.norm + the LM head."""

    layers: tuple[LayerRowOps, ...]
    head: RowDot  # RMSNorm + LM head: x (m, C) -> (m, V)
    max_rows: int  # the most rows a forward sends through C
    widen: bool  # bf16 weights: fp32 activations between the calls
    # the layers' calls in order, four per layer, for the whole-step call (fast/rowstep.py)
    step_ops: tuple[RowDot, ...] = ()


@dataclass(frozen=True)
class LlamaPlan:
    threads: int  # torch.get_num_threads() the row ops were made for
    embed: torch.Tensor  # (V, C)
    layers: tuple[LayerPlan, ...]
    norm_w: torch.Tensor  # (C,) model.norm
    head: torch.Tensor  # (V, C) lm_head: embed itself when tied
    cos: torch.Tensor  # (block_size, hs) the model's own tables, in its dtype (the PyTorch path)
    sin: torch.Tensor
    rows: RowPlan | None = None  # the calls into C; None where they cannot run

    def matmuls(self) -> list[Linear]:
        """Every weight of a step, one entry per fused call: each layer's four, then the LM head."""
        return [m for lp in self.layers for m in (lp.qkv, lp.o, lp.gate_up, lp.down)] + [Linear((self.head,), (None,))]


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """An fp32 tensor for the C side: the parameter itself when it is fp32, else a widened copy."""
    if t is None:
        return None
    t = t.detach()
    return t if t.dtype == torch.float32 else t.float()


def rope_f32(model: "Llama") -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables in fp32 for the C side: the model's own buffers when it is fp32, else
    recomputed in fp32 (a bf16 model's tables are rounded; fp32 activations deserve exact ones)."""
    if model.rope_cos.dtype == torch.float32 and model.rope_cos.device.type == "cpu":
        return model.rope_cos, model.rope_sin
    return rope_tables(model.config, "cpu")


def _row_plan(model: "Llama", layers: tuple[LayerPlan, ...], norm_w: torch.Tensor, head: torch.Tensor,
              tables: tuple[torch.Tensor, torch.Tensor], threads: int) -> RowPlan | None:
    """The C calls for every layer and the head, or None if any of them cannot be had."""
    c = model.config
    assert c.head_dim is not None
    eps = c.rms_norm_eps
    rope = (*tables, (c.n_head + c.kv_heads) * c.head_dim)  # q's and k's heads, not v's
    ops = []
    for lp in layers:
        four = (row_dot(lp.qkv.ws, [_f32(b) for b in lp.qkv.biases], threads, norm=(_f32(lp.in_norm), eps),
                        rope=rope),
                row_dot(lp.o.ws, [_f32(b) for b in lp.o.biases], threads),
                row_dot(lp.gate_up.ws, [_f32(b) for b in lp.gate_up.biases], threads,
                        norm=(_f32(lp.post_norm), eps), swiglu=True),
                row_dot(lp.down.ws, [_f32(b) for b in lp.down.biases], threads))
        if any(op is None for op in four):
            return None
        ops.append(LayerRowOps(*four))  # type: ignore[arg-type]
    head_op = row_dot([head], None, threads, norm=(_f32(norm_w), eps))
    if head_op is None:
        return None
    widen = head.dtype != torch.float32
    step_ops = tuple(op for lay in ops for op in (lay.attn_in, lay.attn_out, lay.mlp_in, lay.mlp_out))
    return RowPlan(tuple(ops), head_op, max_rows=1 << 30 if widen else max_c_rows_fp32(threads), widen=widen,
                   step_ops=step_ops)


def _linear(*mods: torch.nn.Linear) -> Linear:
    return Linear(tuple(m.weight.detach() for m in mods), tuple(opt(m.bias) for m in mods))


def build_plan(model: "Llama", threads: int, tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> LlamaPlan:
    """Views of the model's weights (read in place) and the C calls for ``threads`` threads."""
    layers = tuple(
        LayerPlan(in_norm=b.input_layernorm.weight.detach(),
                  qkv=_linear(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj),
                  o=_linear(b.self_attn.o_proj), post_norm=b.post_attention_layernorm.weight.detach(),
                  gate_up=_linear(b.mlp.gate_proj, b.mlp.up_proj), down=_linear(b.mlp.down_proj))
        for b in model.model.layers
    )
    norm_w, head = model.model.norm.weight.detach(), model.lm_head.weight.detach()
    return LlamaPlan(threads=threads, embed=model.model.embed_tokens.weight.detach(), layers=layers, norm_w=norm_w,
                     head=head, cos=model.rope_cos, sin=model.rope_sin,
                     rows=_row_plan(model, layers, norm_w, head, tables or rope_f32(model), threads))


class FastLlama:
    """The accelerator for one frozen Llama, held beside it (never on the ``nn.Module``).

    ``forward`` has the model's signature and result. One plan per intra-op thread count (the
    C calls share their rows of weights among the threads), built on first use.
    """

    name = "fast"

    def __init__(self, model: "Llama") -> None:
        self.model = model
        self.config = model.config
        self._tables = rope_f32(model)  # a bf16 model's fp32 RoPE tables: its one copy of note
        self._plans = PlanCache(lambda threads: build_plan(self.model, threads, self._tables))

    def rebuild(self) -> None:
        """After replacing, moving or casting parameters (an in-place fp32 load is seen without it)."""
        with self._plans.lock:
            self._tables = rope_f32(self.model)
            self._plans.clear()

    def plan(self) -> LlamaPlan:
        return self._plans.get()

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, cache: "KVCache | None" = None,
                capture: "ForwardCapture | None" = None, last_only: bool = False) -> torch.Tensor:
        """Logits (B, T|1, V), as ``Llama.forward`` gives them."""
        c, p = self.config, self.plan()
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        if start + T > c.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {c.block_size}")
        rows = p.rows
        if rows is not None and B * T <= rows.max_rows:
            # The C side reads the RoPE tables at these positions without bounds checks.
            if input_pos.dtype != torch.int64 or not input_pos.is_contiguous():
                input_pos = input_pos.to(torch.int64).contiguous()
            if int(input_pos.min()) < 0 or int(input_pos.max()) >= c.block_size:
                raise IndexError(f"input_pos must lie in [0, {c.block_size})")
            if B == 1 and T == 1 and cache is not None:
                logits = _one_row(c, rows, p.embed, idx, input_pos, cache, capture)
            else:
                logits = _rows_c(c, rows, p.embed, idx, input_pos, cache, capture, last_only)
            return logits.to(p.head.dtype) if rows.widen else logits
        return forward_torch(c, p, idx, input_pos, cache, capture, last_only)


def _store(cache: "KVCache", i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cache.update in the cache's dtype (fp32 activations meet a bf16 cache when the weights are bf16)."""
    if k.dtype != cache.dtype:
        k, v = k.to(cache.dtype), v.to(cache.dtype)
    return cache.update(i, k, v)


def _one_row(c: "LlamaConfig", rows: RowPlan, embed: torch.Tensor, idx: torch.Tensor, input_pos: torch.Tensor,
             cache: "KVCache", capture: "ForwardCapture | None") -> torch.Tensor:
    """A decode step for one row: the residual stream is a (1, C) fp32 row between calls into C."""
    nh, nkv, hs = c.n_head, c.kv_heads, c.head_dim
    assert hs is not None
    x = torch.embedding(embed, idx)  # (1, 1, C), contiguous
    if rows.widen:
        x = x.float()
    step = step_for(rows.step_ops, cache, c)
    if step is not None:  # every layer in one call into C (fast/rowstep.py): a static cache
        step.decode(x, int(input_pos[0]), cache, capture)  # x: the last layer's residual stream now
        return rows.head(x).view(1, 1, -1)  # model.norm + LM head: (1, 1, V)
    for i, op in enumerate(rows.layers):
        q, k, v = split_qkv(op.attn_in(x, pos=input_pos), 1, nh, nkv, hs)  # RMSNorm, q|k|v, RoPE: views
        k, v = _store(cache, i, k, v)  # every cached position: (1, nkv, S, hs), post-RoPE K
        if capture is not None and i in capture.layers:
            capture.q_last[i], capture.k[i], capture.v[i] = q, k, v
        if k.dtype != q.dtype:
            k, v = k.float(), v.float()
        # (1, nh, 1, hs): for one row and one query its memory is the heads side by side;
        # contiguous() is a no-op here that guarantees the raw pointer the C side reads.
        y = F.scaled_dot_product_attention(q, k, v, enable_gqa=nkv != nh)
        x = op.attn_out(y.contiguous(), x)  # x + y Wo^T: (1, C)
        x = op.mlp_out(op.mlp_in(x), x)  # x + (silu(RMSNorm(x) Wg^T) * RMSNorm(x) Wu^T) Wd^T
    return rows.head(x).view(1, 1, -1)  # model.norm + LM head: (1, 1, V)


def _rows_c(c: "LlamaConfig", rows: RowPlan, embed: torch.Tensor, idx: torch.Tensor, input_pos: torch.Tensor,
            cache: "KVCache | None", capture: "ForwardCapture | None", last_only: bool) -> torch.Tensor:
    """Any (B, T) through the calls into C: batches, prefill, chunked prefill, no cache."""
    B, T = idx.shape
    C, nh, nkv, hs = c.n_embd, c.n_head, c.kv_heads, c.head_dim
    assert hs is not None
    mask, is_causal = attention_mask(T, cache.pos if cache is not None else 0, input_pos)
    kvd = nkv * hs
    x = torch.embedding(embed, idx)  # (B, T, C): row b*T + t of the C side sits at input_pos[t]
    if rows.widen:
        x = x.float()
    for i, op in enumerate(rows.layers):
        q, k, v = op.attn_in(x, pos=input_pos).view(B, T, -1).split([nh * hs, kvd, kvd], dim=2)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs), post-RoPE
        k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs), post-RoPE
        v = v.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if cache is not None:
            k, v = _store(cache, i, k, v)  # every cached position: (B, nkv, S, hs)
        if capture is not None and i in capture.layers:
            capture.q_last[i], capture.k[i], capture.v[i] = q[:, :, -1:, :], k, v
        if k.dtype != q.dtype:
            k, v = k.float(), v.float()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=nkv != nh)  # (B, nh, T, hs)
        x = op.attn_out(y.transpose(1, 2).contiguous(), x)  # heads side by side: (B T, C)
        x = op.mlp_out(op.mlp_in(x), x)
    x = x.view(B, T, C)
    if last_only:
        x = x[:, -1:, :].contiguous()  # (B, 1, C)
    return rows.head(x).view(B, x.shape[1], -1)  # (B, T|1, V)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half RoPE: x (B, n, T, hs), cos/sin (T, hs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the readable model computes it: in fp32, cast back before the scale."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def forward_torch(c: "LlamaConfig", p: LlamaPlan, idx: torch.Tensor, input_pos: torch.Tensor,
                  cache: "KVCache | None", capture: "ForwardCapture | None", last_only: bool) -> torch.Tensor:
    """``Llama.forward``'s maths in functional PyTorch ops, in the model's dtype (no C kernel)."""
    B, T = idx.shape
    nh, nkv, hs, eps = c.n_head, c.kv_heads, c.head_dim, c.rms_norm_eps
    assert hs is not None
    mask, is_causal = attention_mask(T, cache.pos if cache is not None else 0, input_pos)
    cos, sin = p.cos.index_select(0, input_pos), p.sin.index_select(0, input_pos)  # (T, hs)
    kvd = nkv * hs
    x = torch.embedding(p.embed, idx)  # (B, T, C)
    for i, lp in enumerate(p.layers):
        q, k, v = lp.qkv.rows(_rms(x, lp.in_norm, eps)).split([nh * hs, kvd, kvd], dim=2)
        q = _rope(q.view(B, T, nh, hs).transpose(1, 2), cos, sin)  # (B, nh, T, hs)
        k = _rope(k.view(B, T, nkv, hs).transpose(1, 2), cos, sin)  # (B, nkv, T, hs)
        v = v.view(B, T, nkv, hs).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(i, k, v)  # every cached position: (B, nkv, S, hs)
        if capture is not None and i in capture.layers:
            capture.q_last[i], capture.k[i], capture.v[i] = q[:, :, -1:, :], k, v
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=nkv != nh)  # (B, nh, T, hs)
        x = x + lp.o.rows(y.transpose(1, 2).reshape(B, T, nh * hs))
        h = _rms(x, lp.post_norm, eps)
        (wg, wu), (bg, bu) = lp.gate_up.ws, lp.gate_up.biases
        x = x + lp.down.rows(F.silu(F.linear(h, wg, bg)) * F.linear(h, wu, bu))
    if last_only:
        x = x[:, -1:, :]  # (B, 1, C)
    return F.linear(_rms(x, p.norm_w, eps), p.head)  # (B, T|1, V)
