"""The accelerator's Gemma 3: the readable model's forward with its matmuls read from the GGUF's codes.

A decode step of Gemma 3 270M streams every weight once, and in fp32 that is 1,022.5 MiB, 640 MiB
of it the tied 262,144 x 640 head: at fp32 no kernel gets a step to 3x transformers on this
machine (docs/performance.md). The file holds the same weights as integer codes with a scale per
block (Q8_0, Q5_0, Q4_K, Q6_K), 235 MiB as it stores them, and ``fast/blockdot.py`` multiplies by
them as they are: each weight is exactly the value the readable model holds (gguf's dequantization,
value for value). Each matmul's input rows are rounded to int16 per block of 32 (``csrc/lblocks.c``,
issue 42: within 1/65534 of each block's largest value) and multiplied by the codes in integers.

So this path changes nothing but where, and how finely, the matmuls read their operands:
- per layer, three calls into C: q|k|v side by side, o_proj, gate|up side by side (then down_proj);
  the tied head is a fifth, on the embedding's codes;
- everything between them is the readable model's own code, called, not copied: the norms (its
  ``RMSNorm`` modules), the per-head q/k norms, RoPE, the cache write, the sliding and global
  masks and the capture (``Gemma3Attention.attend``), the masks and RoPE tables
  (``layer_inputs``), the scaled embedding and the soft-cap. The caches (static rings, paged
  layer groups, quantized stores) behave exactly as under the readable model.

A decode step of one row on a static cache goes further: every layer's four calls, the K/V write
and attention in one call into C (``fast/rowstep.py``, as SmolLM2's), each layer's RoPE tables
(local or global base) and the ``query_pre_attn_scalar`` scale handed to it, while no sliding
layer's ring has wrapped (slots are positions until then; past it the per-layer path runs).

It serves forwards of up to ``blockdot.max_code_rows(threads, "gemma3")`` rows (batch x tokens): decode
steps, beams, batches and short chunks. Longer forwards (a prefill) go to the readable model, where
MKL's GEMM over the fp32 weights wins once the rows are many. A weight without codes (an F32/F16 file, a type the kernel
does not read) goes through the fp32 row kernel; without any C kernel, or for a bf16 or CUDA
model, ``plan`` is None and the readable model runs every forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch
import torch.nn.functional as F

from kvviz.engine.models.gemma3 import Gemma3, inv_freq, layer_inputs, rope, softcap
from kvviz.fast.blockdot import BlockDot, CodedCall, Group, block_dot, matching_codes, max_code_rows, step_ops
from kvviz.engine.loading.gguf_codes import BlockCodes
from kvviz.fast.common import PlanCache
from kvviz.fast.rowops import RowDot, row_dot
from kvviz.fast.rowstep import Rope, step_for

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.engine.kvcache.dense import KVCache
    from kvviz.engine.generation.capture import ForwardCapture


@dataclass(frozen=True)
class Call(CodedCall):
    """One fused call of a layer: ``epilogue(RMSNorm(x) @ W^T) (+ res)``. On block codes the C call
    does it all (``BlockDot``); on the fp32 row kernel (``RowDot``: the input norm only) the GeGLU
    and the output norm follow in PyTorch."""

    op: BlockDot | RowDot
    geglu: bool = False  # gate | up -> gelu_tanh(gate) * up
    post: torch.Tensor | None = None  # (n_out,) 1 + w of the output norm, or None
    eps: float = 0.0

    def __call__(self, x: torch.Tensor, res: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x (..., n_in) -> (m, n_out); with ``res``, res + that, shaped as res; ``rope``: the
        (cos, sin) tables for a call that ``rotates``."""
        if isinstance(self.op, BlockDot):
            y = self.op(x, res, rope if self.rotates else None)
            return y if res is None else y.view(res.shape)
        y = self.op(x)  # (m, n_out) or (m, 2 I): the matmul with its input norm
        if self.geglu:
            g, u = y.chunk(2, dim=-1)
            y = F.gelu(g, approximate="tanh") * u
        if self.post is not None:
            y = F.rms_norm(y, (y.shape[-1],), self.post, self.eps)
        return y if res is None else res + y.view(res.shape)


@dataclass(frozen=True)
class LayerMats:
    qkv: Call  # input_layernorm, then q_proj | k_proj | v_proj: (m, C) -> (m, (nh + 2 nkv) hs)
    o: Call  # o_proj, post_attention_layernorm, + the residual: (m, nh hs), x -> x + norm(y Wo^T)
    gate_up: Call  # pre_feedforward_layernorm, gate_proj | up_proj, GeGLU: (m, C) -> (m, I)
    down: Call  # down_proj, post_feedforward_layernorm, + the residual: (m, I), x -> x + norm(h Wd^T)


@dataclass(frozen=True)
class Gemma3Plan:
    threads: int
    layers: tuple[LayerMats, ...]
    head: Call  # model.norm, then the tied embedding: (m, C) -> (m, V)
    coded_bytes: int  # bytes a step streams from codes and scales
    fp32_bytes: int  # bytes a step streams from fp32 weights (those without codes)
    step_ops: tuple[BlockDot, ...]  # every layer's four calls for the one-call C step, () when one is not on codes


def one_plus(norm: torch.nn.Module) -> torch.Tensor:
    """Gemma's RMSNorm scale, 1 + w in fp32, as its forward computes it (the same rounding)."""
    return (1.0 + norm.weight.detach().float()).contiguous()


def groups(model: Gemma3) -> list[Group]:
    """Every fused call's weights in step order: each layer's q|k|v, o, gate|up and down, then the
    tied head (the embedding), by transformers' names (the keys of the GGUF's codes)."""
    out: list[Group] = []
    for i, layer in enumerate(model.model.layers):
        a, m, p = layer.self_attn, layer.mlp, f"model.layers.{i}."
        out += [((p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                 (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)),
                ((p + "self_attn.o_proj.weight",), (a.o_proj.weight,)),
                ((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (m.gate_proj.weight, m.up_proj.weight)),
                ((p + "mlp.down_proj.weight",), (m.down_proj.weight,))]
    return out + [(("model.embed_tokens.weight",), (model.model.embed_tokens.weight,))]


def _call(group: Group, codes: Mapping[str, BlockCodes], threads: int, eps: float, norm: torch.Tensor | None = None,
          geglu: bool = False, post: torch.Tensor | None = None,
          qk: tuple[torch.Tensor, torch.Tensor, int, int] | None = None) -> Call | None:
    """One fused call: on the weights' codes when every one has matching codes, else the fp32 row
    kernel on the parameters (None when neither can be had)."""
    cs = matching_codes(group, codes)
    n_eps, p_eps = (None if norm is None else (norm, eps)), (None if post is None else (post, eps))
    if cs is not None:
        op = block_dot(cs, threads, norm=n_eps, geglu=geglu, post=p_eps, qk_norm=None if qk is None else (*qk, eps))
        if op is not None:
            return Call(op)
    row = row_dot(tuple(w.detach() for w in group[1]), None, threads, norm=n_eps)
    return None if row is None else Call(row, geglu, post, eps)


def build_plan(model: Gemma3, codes: Mapping[str, BlockCodes], threads: int) -> Gemma3Plan | None:
    """The calls into C for ``threads`` threads, or None where they cannot all be had."""
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
        return None
    eps = model.config.rms_norm_eps
    every = groups(model)
    layers = []
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        qkv, o, gate_up, down = every[4 * i: 4 * i + 4]
        calls = (_call(qkv, codes, threads, eps, norm=one_plus(layer.input_layernorm),
                       qk=(one_plus(a.q_norm), one_plus(a.k_norm), a.n_head, a.n_kv_head)),
                 _call(o, codes, threads, eps, post=one_plus(layer.post_attention_layernorm)),
                 _call(gate_up, codes, threads, eps, norm=one_plus(layer.pre_feedforward_layernorm), geglu=True),
                 _call(down, codes, threads, eps, post=one_plus(layer.post_feedforward_layernorm)))
        if any(c is None for c in calls):
            return None
        layers.append(LayerMats(*calls))  # type: ignore[arg-type]
    head = _call(every[-1], codes, threads, eps, norm=one_plus(model.model.norm))
    if head is None:
        return None
    made = [c for lay in layers for c in (lay.qkv, lay.o, lay.gate_up, lay.down)] + [head]
    return Gemma3Plan(threads, tuple(layers), head, sum(c.nbytes[0] for c in made), sum(c.nbytes[1] for c in made),
                      step_ops(made[:-1]))


class FastGemma3:
    """The accelerator for one frozen Gemma 3, held beside it (never on the ``nn.Module``).

    ``forward`` has the model's signature and result. ``codes`` are the GGUF's block codes by
    transformers' parameter name (``engine/loading/gguf_codes.py``); without them every matmul
    runs on the fp32 row kernel.
    """

    name = "fast"

    def __init__(self, model: Gemma3, codes: Mapping[str, BlockCodes] | None = None) -> None:
        self.model = model
        self.config = model.config
        self.codes = dict(codes or {})
        self._plans: PlanCache[Gemma3Plan | None] = PlanCache(lambda threads: build_plan(self.model, self.codes, threads))
        self._rope: Rope | None = None  # each layer's RoPE tables for the one-call step, grown as runs grow

    def rebuild(self) -> None:
        """After replacing, moving or casting parameters: plans are made again (codes that no
        longer match their parameter are then left unused)."""
        with self._plans.lock:
            self._plans.clear()

    def plan(self) -> Gemma3Plan | None:
        return self._plans.get()

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None, cache: "KVCache | None" = None,
                capture: "ForwardCapture | None" = None, last_only: bool = False) -> torch.Tensor:
        """Logits (B, T|1, V), as ``Gemma3.forward`` gives them."""
        B, T = idx.shape
        rows = max_code_rows(torch.get_num_threads(), "gemma3")
        short = B * T <= rows
        # A long forward still wants the plan for its head when it keeps one row a sequence
        p = self.plan() if short or (last_only is True and B <= rows) else None
        if p is None or not short:
            if p is not None and isinstance(p.head.op, BlockDot):
                # A prefill: the layers' GEMMs on the readable model (fp32: MKL wins once the rows are
                # many), the head's one row a sequence on the file's codes: 170 MiB of Q8_0 read,
                # not 640 MiB of fp32 (about 20 ms of a 27-token prefill at 2 threads).
                x = self.model.hidden(idx, input_pos, cache, capture, True).contiguous()  # (B, 1, C)
                return softcap(self.config, p.head(x).view(B, 1, -1))
            return self.model(idx, input_pos, cache, capture, last_only)
        c, net = self.config, self.model
        start = cache.pos if cache is not None else 0
        if start + T > c.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {c.block_size}")
        if input_pos is None:
            input_pos = torch.arange(start, start + T, device=idx.device)
        nh, nkv, hs = c.n_head, c.kv_heads, c.head_dim
        if B == 1 and T == 1 and p.step_ops and cache is not None:
            logits = self._one_call(p, idx, int(input_pos.reshape(-1)[0]), cache, capture)
            if logits is not None:
                return logits
        q_out, kv_out = nh * hs, nkv * hs
        x = net.embed(idx)  # (B, T, C)
        full, local = layer_inputs(c, T, start, input_pos, cache, x.dtype)
        for layer, mats in zip(net.model.layers, p.layers):
            attn = layer.self_attn
            mask, is_causal, cos, sin = local if attn.sliding else full
            q, k, v = mats.qkv(x, rope=(cos, sin)).view(B, T, -1).split([q_out, kv_out, kv_out], dim=2)
            if mats.qkv.rotates:  # input norm, q|k|v, the q/k heads' norms and RoPE, all in the call
                y = attn.attend_rotated(q.view(B, T, nh, hs).transpose(1, 2), k.view(B, T, nkv, hs).transpose(1, 2),
                                        v.view(B, T, nkv, hs).transpose(1, 2), cache, mask, is_causal, capture)
            else:  # the fp32 row kernel: the input norm fused, the heads' norms and RoPE in PyTorch
                y = attn.attend(q, k, v, cos, sin, cache, mask, is_causal, capture)  # (B, T, nh hs)
            x = mats.o(y, x)  # x + post_attention_layernorm(y Wo^T): (B, T, C)
            x = mats.down(mats.gate_up(x), x)  # x + post_ffw_norm(GeGLU(pre_ffw_norm(x)) Wd^T)
        if last_only:
            x = x[:, -1:, :].contiguous()  # (B, 1, C)
        logits = p.head(x).view(B, x.shape[1], -1)  # model.norm + the tied head: (B, T|1, V)
        return softcap(c, logits)

    def _tables(self, pos: int) -> Rope:
        """Each layer's (cos, sin) for positions 0..L-1, L a power of two past ``pos``: computed as
        ``layer_inputs`` computes them (the same fp32 ops, so the same values), two bases shared
        among the layers. Grown by doubling, not made for the whole context: Gemma 3's 32,768
        positions of 256 would be 32 MiB a table."""
        c = self.config
        if self._rope is not None and pos < self._rope[0][0].shape[0]:
            return self._rope
        n = 1 << max(6, pos.bit_length())
        at = torch.arange(n)
        full = rope(inv_freq(c.rope_theta, c.head_dim), at, torch.float32)  # (n, hs) each
        local = rope(inv_freq(c.rope_local_theta, c.head_dim), at, torch.float32)
        self._rope = tuple(local if layer.self_attn.sliding else full for layer in self.model.model.layers)
        return self._rope

    def _one_call(self, p: Gemma3Plan, idx: torch.Tensor, pos: int, cache: "KVCache",
                  capture: "ForwardCapture | None") -> torch.Tensor | None:
        """A decode step of one row in one call into C (``fast/rowstep.py``), or None where the
        cache is not one it writes (another kind, or a sliding layer's ring about to wrap): then
        the per-layer path runs."""
        if not 0 <= pos < self.config.block_size:  # C reads the RoPE tables at pos unchecked
            raise IndexError(f"input_pos must lie in [0, {self.config.block_size})")
        step = step_for(p.step_ops, cache, self.config, rope=self._tables(pos),
                        scale=self.model.model.layers[0].self_attn.scale)  # the attention's own
        if step is None:
            return None
        x = self.model.embed(idx).contiguous()  # (1, 1, C) fp32
        step.decode(x, pos, cache, capture)  # x: the last layer's residual stream now
        return softcap(self.config, p.head(x).view(1, 1, -1))  # model.norm + the tied head: (1, 1, V)
