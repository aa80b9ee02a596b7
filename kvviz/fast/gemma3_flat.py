"""The accelerator's Gemma 3: the readable model's forward with its matmuls read from the GGUF's codes.

A decode step of Gemma 3 270M streams every weight once, and in fp32 that is 1,022.5 MiB, 640 MiB
of it the tied 262,144 x 640 head: at fp32 no kernel gets a step to 3x transformers on this
machine (docs/performance.md). The file holds the same weights as int8 codes with a scale per
block (Q8_0, Q5_0, Q4_K, Q6_K), 292 MiB in all, and ``fast/blockdot.py`` multiplies by them as
they are: each weight is exactly the value the readable model holds (gguf's dequantization,
value for value), only the order of the additions differs, and the activations stay fp32.

So this path changes nothing but where the matmuls read their weights:
- per layer, three calls into C: q|k|v side by side, o_proj, gate|up side by side (then down_proj);
  the tied head is a fifth, on the embedding's codes;
- everything between them is the readable model's own code, called, not copied: the norms (its
  ``RMSNorm`` modules), the per-head q/k norms, RoPE, the cache write, the sliding and global
  masks and the capture (``Gemma3Attention.attend``), the masks and RoPE tables
  (``layer_inputs``), the scaled embedding and the soft-cap. The caches (static rings, paged
  layer groups, quantized stores) behave exactly as under the readable model.

It serves forwards of up to ``MAX_ROWS`` rows (batch x tokens): decode steps, beams, batches and
short chunks. Longer forwards (a prefill) go to the readable model, where MKL's GEMM over the fp32
weights wins once the rows are many. A weight without codes (an F32/F16 file, a type the kernel
does not read) goes through the fp32 row kernel; without any C kernel, or for a bf16 or CUDA
model, ``plan`` is None and the readable model runs every forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

import torch
import torch.nn.functional as F

from kvviz.engine.models.gemma3 import Gemma3, layer_inputs, softcap
from kvviz.fast.blockdot import BlockCodes, block_dot
from kvviz.fast.common import PlanCache
from kvviz.fast.rowops import row_dot

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.engine.kvcache.dense import KVCache
    from kvviz.engine.generation.capture import ForwardCapture

MAX_ROWS = 8  # the most rows (batch x tokens) a forward sends through the kernels; more: the readable model
MatMul = Callable[[torch.Tensor], torch.Tensor]  # m rows of n_in fp32 -> (m, n_out)


@dataclass(frozen=True)
class LayerMats:
    qkv: MatMul  # (m, C) -> (m, (nh + 2 nkv) hs): q_proj | k_proj | v_proj
    o: MatMul  # (m, nh hs) -> (m, C)
    gate_up: MatMul  # (m, C) -> (m, 2 I): gate_proj | up_proj
    down: MatMul  # (m, I) -> (m, C)


@dataclass(frozen=True)
class Gemma3Plan:
    threads: int
    layers: tuple[LayerMats, ...]
    head: MatMul  # (m, C) -> (m, V): the tied embedding
    coded_bytes: int  # bytes a step streams from codes and scales
    fp32_bytes: int  # bytes a step streams from fp32 weights (those without codes)


def codes_match(codes: BlockCodes, w: torch.Tensor) -> bool:
    """Whether ``codes`` rebuild ``w`` (the model's parameter): its shape, and its first, middle and
    last rows value for value. A model whose weights changed after loading keeps its fp32 path."""
    if tuple(codes.shape) != tuple(w.shape) or w.dtype != torch.float32:
        return False
    rows = sorted({0, w.shape[0] // 2, w.shape[0] - 1})
    part = BlockCodes(codes.codes[rows], codes.scale[rows], None if codes.minv is None else codes.minv[rows],
                      codes.block)
    return torch.equal(part.weight(), w.detach()[rows])


def _mat(names: tuple[str, ...], weights: tuple[torch.Tensor, ...], codes: Mapping[str, BlockCodes],
         threads: int) -> tuple[MatMul | None, int, int]:
    """One fused call: the weights' codes side by side when every one has matching codes, else the
    fp32 row kernel on the parameters. (call or None, coded bytes, fp32 bytes)."""
    cs = [codes.get(n) for n in names]
    if all(c is not None and codes_match(c, w) for c, w in zip(cs, weights)):
        op = block_dot(cs, threads)  # type: ignore[arg-type]
        if op is not None:
            return op, sum(c.nbytes for c in cs if c is not None), 0
    ws = tuple(w.detach() for w in weights)
    return row_dot(ws, None, threads), 0, sum(w.nbytes for w in ws)


def build_plan(model: Gemma3, codes: Mapping[str, BlockCodes], threads: int) -> Gemma3Plan | None:
    """The calls into C for ``threads`` threads, or None where they cannot all be had."""
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
        return None
    layers, coded, fp32 = [], 0, 0
    for i, layer in enumerate(model.model.layers):
        a, m, p = layer.self_attn, layer.mlp, f"model.layers.{i}."
        groups = (((p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                   (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)),
                  ((p + "self_attn.o_proj.weight",), (a.o_proj.weight,)),
                  ((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (m.gate_proj.weight, m.up_proj.weight)),
                  ((p + "mlp.down_proj.weight",), (m.down_proj.weight,)))
        mats = []
        for names, weights in groups:
            op, nc, nf = _mat(names, weights, codes, threads)
            if op is None:
                return None
            mats.append(op)
            coded, fp32 = coded + nc, fp32 + nf
        layers.append(LayerMats(*mats))
    head, nc, nf = _mat(("model.embed_tokens.weight",), (model.model.embed_tokens.weight,), codes, threads)
    if head is None:
        return None
    return Gemma3Plan(threads, tuple(layers), head, coded + nc, fp32 + nf)


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
        p = self.plan() if B * T <= MAX_ROWS else None
        if p is None:
            return self.model(idx, input_pos, cache, capture, last_only)
        c, net = self.config, self.model
        start = cache.pos if cache is not None else 0
        if start + T > c.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {c.block_size}")
        if input_pos is None:
            input_pos = torch.arange(start, start + T, device=idx.device)
        C, H = c.n_embd, c.intermediate_size
        q_out, kv_out = c.n_head * c.head_dim, c.kv_heads * c.head_dim
        x = net.embed(idx)  # (B, T, C)
        full, local = layer_inputs(c, T, start, input_pos, cache, x.dtype)
        for layer, mats in zip(net.model.layers, p.layers):
            attn = layer.self_attn
            mask, is_causal, cos, sin = local if attn.sliding else full
            q, k, v = mats.qkv(layer.input_layernorm(x)).view(B, T, -1).split([q_out, kv_out, kv_out], dim=2)
            y = attn.attend(q, k, v, cos, sin, cache, mask, is_causal, capture)  # (B, T, nh hs)
            x = x + layer.post_attention_layernorm(mats.o(y.contiguous()).view(B, T, C))
            g, u = mats.gate_up(layer.pre_feedforward_layernorm(x)).split(H, dim=1)  # (B T, I) each
            h = F.gelu(g, approximate="tanh") * u  # GeGLU, as Gemma3MLP
            x = x + layer.post_feedforward_layernorm(mats.down(h).view(B, T, C))
        if last_only:
            x = x[:, -1:, :].contiguous()  # (B, 1, C)
        logits = p.head(net.model.norm(x)).view(B, x.shape[1], -1)  # (B, T|1, V)
        return softcap(c, logits)
