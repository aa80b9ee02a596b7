"""The accelerator's Llama family on a GGUF's block codes: the readable model's forward with its
matmuls read from the file's block codes (SmolLM2, Llama, Mistral, Qwen2, Qwen3).

A decode step streams every weight once. In fp32 SmolLM2-135M is 513 MiB a step; its Q4_1 file
holds the same weights as codes with a scale and an offset per block of 32, and
``fast/blockdot.py`` multiplies by them as they are (0.625 bytes a weight, the file's nibbles and
fp16 scales and offsets, not 4): each weight is exactly the value the readable model holds (gguf's
dequantization, value for value). The kernel rounds each matmul's input rows to int16 per block of
32 (``csrc/lblocks.c``: |x - q dx| <= dx / 2 = max|x_b| / 65534) and multiplies the codes by them in
integers; a matmul is then exact to within sum_b (dx_b / 2) sum_{i in b} |scale_b code_i| plus
fp32 accumulation. This is Gemma 3's path (``gemma3_flat.py``) for Llama's layer:

- per layer, four calls into C, the same kernel as Gemma's with Llama's epilogues: input RMSNorm +
  q|k|v (+ Qwen2's biases) + Qwen3's per-head q/k norms + RoPE; o_proj + the residual;
  post-attention RMSNorm + gate|up + SwiGLU; down_proj + the residual. The LM head (tied: the
  embedding's codes) with model.norm is a fifth.
- between them, the readable model's own code, called, not copied: the cache write, the capture
  and the attention (``LlamaAttention.attend_rotated``), the mask (``forward_mask``: Mistral's
  window over every cache kind), the RoPE tables. The caches behave exactly as under the
  readable model.

A decode step of one row on a static cache (no sliding window: SmolLM2 as the app and the bench
run it) is one call into C instead: the same calls chained with the K/V write and attention
(``fast/rowstep.py``), without the 30 layers of Python between them (1.43x at 1 thread, 1.26x at 2
on SmolLM2's Q4_1 file).

It serves forwards of up to ``blockdot.max_code_rows(threads, "llama")`` rows (batch x tokens). A weight
whose codes do not rebuild its parameter (changed after loading), or a type without codes (F32,
F16), goes through the fp32 row kernel, its q/k norms and RoPE then in PyTorch. Longer forwards,
and every forward where ``plan`` is None (bf16, CUDA, no C kernel), go to the fp32 accelerator
(``llama_flat.py``) where it takes the family, else to the readable model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from kvviz.engine.models.llama import Llama, apply_rope, forward_mask
from kvviz.fast.blockdot import BlockDot, CodedCall, Group, block_dot, matching_codes, max_code_rows, step_ops
from kvviz.engine.loading.gguf_codes import BlockCodes
from kvviz.fast.common import PlanCache, opt
from kvviz.fast.rowops import RowDot, row_dot
from kvviz.fast.rowstep import Rope, step_for

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.engine.generation.capture import ForwardCapture
    from kvviz.engine.kvcache.dense import KVCache
    from kvviz.fast.llama_flat import FastLlama



@dataclass(frozen=True)
class Call(CodedCall):
    """One fused call of a layer, ``epilogue(RMSNorm(x) @ W^T + b) (+ res)``: on block codes
    (``BlockDot``, RoPE too for q|k|v) or on the fp32 row kernel (``RowDot``, SwiGLU fused too)."""

    op: BlockDot | RowDot

    def __call__(self, x: torch.Tensor, res: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x (..., n_in) -> (m, n_out); with ``res``, res + that, shaped as res; ``rope``: the
        (cos, sin) tables, (T, head_dim), for a call that ``rotates``."""
        if isinstance(self.op, BlockDot):
            y = self.op(x, res, rope if self.rotates else None)
        else:
            y = self.op(x.float().contiguous(), res)  # the C side reads raw fp32 rows
        return y if res is None else y.view(res.shape)


@dataclass(frozen=True)
class LayerCalls:
    qkv: Call  # input_layernorm, q_proj | k_proj | v_proj (+ biases), q/k norms, RoPE: (m, C) -> (m, (nh + 2 nkv) hs)
    o: Call  # o_proj + the residual: (m, nh hs), x -> x + y Wo^T
    gate_up: Call  # post_attention_layernorm, gate_proj | up_proj, SwiGLU: (m, C) -> (m, I)
    down: Call  # down_proj + the residual: (m, I), x -> x + h Wd^T


@dataclass(frozen=True)
class LlamaCodesPlan:
    threads: int
    layers: tuple[LayerCalls, ...]
    head: Call  # model.norm, then the LM head (the embedding when tied): (m, C) -> (m, V)
    coded_bytes: int  # bytes a step streams from codes, scales and offsets
    fp32_bytes: int  # bytes a step streams from fp32 weights (those without matching codes)
    step_ops: tuple[BlockDot, ...]  # every layer's four calls for the one-call C step, () when one is not on codes


def groups(model: Llama) -> list[Group]:
    """Every fused call's weights in step order, by transformers' names (the keys of the GGUF's
    codes): each layer's q|k|v, o, gate|up and down, then the LM head (the embedding when tied)."""
    out: list[Group] = []
    for i, layer in enumerate(model.model.layers):
        a, m, p = layer.self_attn, layer.mlp, f"model.layers.{i}."
        out += [((p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                 (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)),
                ((p + "self_attn.o_proj.weight",), (a.o_proj.weight,)),
                ((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (m.gate_proj.weight, m.up_proj.weight)),
                ((p + "mlp.down_proj.weight",), (m.down_proj.weight,))]
    head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    return out + [((head,), (model.lm_head.weight,))]


def _call(group: Group, mods: tuple[torch.nn.Linear, ...] | None, codes: Mapping[str, BlockCodes], threads: int,
          norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
          qk: tuple[torch.Tensor | None, torch.Tensor | None, int, int, float, int] | None = None) -> Call | None:
    """One fused call: on the weights' codes when every one has codes that rebuild it, else the
    fp32 row kernel on the parameters (None when neither can be had). ``mods``: the nn.Linear
    modules (their biases), None for the LM head; ``qk``: (q_norm, k_norm, n_q, n_k, eps, head_dim)."""
    biases = [opt(m.bias) for m in mods] if mods is not None else [None]
    cs = matching_codes(group, codes)
    if cs is not None:
        op = block_dot(cs, threads, norm=norm, swiglu=swiglu, biases=biases,
                       qk_norm=None if qk is None else qk[:5], head_dim=0 if qk is None else qk[5])
        if op is not None:
            return Call(op)
    row = row_dot(tuple(w.detach() for w in group[1]), biases, threads, norm=norm, swiglu=swiglu)
    return None if row is None else Call(row)


def build_plan(model: Llama, codes: Mapping[str, BlockCodes], threads: int) -> LlamaCodesPlan | None:
    """The calls into C for ``threads`` threads, or None where they cannot all be had."""
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
        return None
    c = model.config
    eps, every = c.rms_norm_eps, groups(model)
    layers = []
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        qkv, o, gate_up, down = every[4 * i: 4 * i + 4]
        qn, kn = (None, None) if a.q_norm is None or a.k_norm is None else (a.q_norm.weight.detach(),
                                                                             a.k_norm.weight.detach())
        calls = (_call(qkv, (a.q_proj, a.k_proj, a.v_proj), codes, threads,
                       norm=(layer.input_layernorm.weight.detach(), eps), qk=(qn, kn, a.n_head, a.n_kv_head, eps,
                                                                               a.head_dim)),
                 _call(o, (a.o_proj,), codes, threads),
                 _call(gate_up, (m.gate_proj, m.up_proj), codes, threads,
                       norm=(layer.post_attention_layernorm.weight.detach(), eps), swiglu=True),
                 _call(down, (m.down_proj,), codes, threads))
        if any(x is None for x in calls):
            return None
        layers.append(LayerCalls(*calls))  # type: ignore[arg-type]
    head = _call(every[-1], None, codes, threads, norm=(model.model.norm.weight.detach(), eps))
    if head is None:
        return None
    made = [x for lay in layers for x in (lay.qkv, lay.o, lay.gate_up, lay.down)] + [head]
    return LlamaCodesPlan(threads, tuple(layers), head, sum(x.nbytes[0] for x in made),
                          sum(x.nbytes[1] for x in made), step_ops(made[:-1]))


class FastLlamaCodes:
    """The accelerator for one frozen Llama-family model loaded from a GGUF with block codes, held
    beside it (never on the ``nn.Module``). ``forward`` has the model's signature and result.
    ``codes``: the file's block codes by transformers' parameter name; ``fp32``: the fp32
    accelerator for what the codes do not serve (None for the kin it declines: Qwen3, Mistral)."""

    name = "fast"

    def __init__(self, model: Llama, codes: Mapping[str, BlockCodes], fp32: "FastLlama | None" = None) -> None:
        self.model = model
        self.config = model.config
        self.codes = dict(codes)
        self.fp32 = fp32
        self._plans: PlanCache[LlamaCodesPlan | None] = PlanCache(
            lambda threads: build_plan(self.model, self.codes, threads))
        self._rope: Rope | None = None  # every layer's (cos, sin): the model's tables, for the one-call step

    def rebuild(self) -> None:
        """After replacing, moving or casting parameters: plans are made again (codes that no
        longer match their parameter are then left unused)."""
        with self._plans.lock:
            self._plans.clear()
        if self.fp32 is not None:
            self.fp32.rebuild()

    def plan(self) -> LlamaCodesPlan | None:
        return self._plans.get()

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None, cache: "KVCache | None" = None,
                capture: "ForwardCapture | None" = None, last_only: bool = False) -> torch.Tensor:
        """Logits (B, T|1, V), as ``Llama.forward`` gives them."""
        B, T = idx.shape
        c, net = self.config, self.model
        start = cache.pos if cache is not None else 0
        if input_pos is None:
            input_pos = torch.arange(start, start + T, device=idx.device)
        p = self.plan() if B * T <= max_code_rows(torch.get_num_threads(), "llama") else None
        if p is None:
            if self.fp32 is not None:
                return self.fp32.forward(idx, input_pos, cache, capture, last_only)
            return net(idx, input_pos, cache, capture, last_only)
        if start + T > c.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {c.block_size}")
        nh, nkv, hs = c.n_head, c.kv_heads, c.head_dim
        assert hs is not None
        if B == 1 and T == 1 and p.step_ops and c.sliding_window is None and cache is not None:
            logits = self._one_call(p, idx, input_pos, cache, capture)
            if logits is not None:
                return logits
        mask, is_causal = forward_mask(c, T, start, input_pos, cache)
        cos, sin = net.rope_cos.index_select(0, input_pos), net.rope_sin.index_select(0, input_pos)  # (T, hs)
        x = torch.embedding(net.model.embed_tokens.weight, idx)  # (B, T, C)
        for layer, calls in zip(net.model.layers, p.layers):
            attn = layer.self_attn
            q, k, v = calls.qkv(x, rope=(cos, sin)).view(B, T, -1).split([nh * hs, nkv * hs, nkv * hs], dim=2)
            q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
            k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
            v = v.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
            if not calls.qkv.rotates:  # the fp32 row kernel: Qwen3's q/k norms and RoPE in PyTorch
                if attn.q_norm is not None and attn.k_norm is not None:
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            y = attn.attend_rotated(q, k, v, cache, mask, is_causal, capture)  # (B, T, nh hs)
            x = calls.o(y, x)  # x + y Wo^T: (B, T, C)
            x = calls.down(calls.gate_up(x), x)  # x + SwiGLU(post_attention_layernorm(x)) Wd^T
        if last_only:
            x = x[:, -1:, :].contiguous()  # (B, 1, C)
        return p.head(x).view(B, x.shape[1], -1)  # model.norm + the LM head: (B, T|1, V)

    def _one_call(self, p: LlamaCodesPlan, idx: torch.Tensor, input_pos: torch.Tensor, cache: "KVCache",
                  capture: "ForwardCapture | None") -> torch.Tensor | None:
        """A decode step of one row in one call into C (``fast/rowstep.py``), or None where the
        cache is not one it writes (then the per-layer path runs)."""
        net = self.model
        pos = int(input_pos.reshape(-1)[0])
        if not 0 <= pos < self.config.block_size:  # C reads the RoPE tables at pos unchecked
            raise IndexError(f"input_pos must lie in [0, {self.config.block_size})")
        tables = (net.rope_cos, net.rope_sin)
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in tables):
            return None
        if self._rope is None or self._rope[0][0] is not net.rope_cos or self._rope[0][1] is not net.rope_sin:
            self._rope = (tables,) * self.config.n_layer  # one tuple, kept: the step is rebuilt when it changes
        step = step_for(p.step_ops, cache, self.config, rope=self._rope)
        if step is None:
            return None
        x = torch.embedding(net.model.embed_tokens.weight, idx).contiguous()  # (1, 1, C)
        step.decode(x, pos, cache, capture)  # x: the last layer's residual stream now
        return p.head(x).view(1, 1, -1)  # model.norm + the LM head: (1, 1, V)
