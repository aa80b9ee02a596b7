"""A small GPT-2 style transformer with an explicit KV-cache interface.

Parameter names follow GPT-2 (``transformer.wte``, ``h.{i}.attn.c_attn``, ...) so a Hugging Face
GPT-2 checkpoint maps one to one (modulo Conv1D's transposed weights, handled in checkpoints.py).

The forward pass never advances a cache: it writes the K/V of the positions it is given at
``cache.pos`` and reads everything up to ``cache.pos + T``; the generator calls ``cache.advance``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvviz.decode import DecodePlan, build_plan, decode_step
from kvviz.matmul import row_matmul  # noqa: F401 (also re-exported: kvviz.model.row_matmul)

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.cache import KVCache


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # tokens in the vocabulary (256 for the byte-level tokenizer)
    block_size: int = 512  # maximum context: number of learned position embeddings
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # query heads per attention layer
    n_kv_head: int | None = None  # K/V heads; None = n_head (MHA), fewer = GQA, 1 = MQA
    n_embd: int = 256  # residual stream width; head_dim = n_embd // n_head
    bias: bool = True  # biases in Linear and LayerNorm, as in GPT-2
    layer_norm_epsilon: float = 1e-5  # GPT-2's LayerNorm epsilon
    eos_token_id: int | None = None  # end-of-sequence token, if the tokenizer has one
    dropout: float = 0.0  # training only (embeddings and residual branches); eval ignores it

    def __post_init__(self) -> None:
        # A frozen dataclass still needs the default filled in; object.__setattr__ is the idiom.
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        problems = config_problems(self)
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        assert self.n_kv_head is not None
        return self.n_kv_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPTConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


def config_problems(c: GPTConfig) -> list[str]:
    """Every problem with a config, as sentences; empty when it is valid."""
    out: list[str] = []
    if not isinstance(c.dropout, (int, float)) or not 0.0 <= c.dropout < 1.0:
        out.append(f"dropout must be in [0, 1) (got {c.dropout!r})")
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            out.append(f"{name} must be a positive integer (got {v!r})")
    if out:
        return out
    if c.n_embd % c.n_head:
        out.append(f"n_head ({c.n_head}) must divide n_embd ({c.n_embd})")
    kv = c.n_kv_head
    if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0:
        out.append(f"n_kv_head must be a positive integer (got {kv!r})")
    elif c.n_head % kv:
        out.append(f"n_kv_head ({kv}) must divide n_head ({c.n_head})")
    return out


@dataclass
class ForwardCapture:
    """Per-forward scratch that attention layers fill with *references* (no copies, no math).

    The generator turns them into attention weights and K/V snapshots after the clock stops,
    so capturing never slows the timed forward pass nor changes its result.
    """

    layers: frozenset[int]  # layers whose q/k/v references are wanted
    q_last: dict[int, torch.Tensor] = field(default_factory=dict)  # (B, nh, 1, hs)
    k: dict[int, torch.Tensor] = field(default_factory=dict)  # (B, nkv, S, hs) all keys so far
    v: dict[int, torch.Tensor] = field(default_factory=dict)  # (B, nkv, S, hs)


class Conv1D(nn.Module):
    """GPT-2's "Conv1D": a linear layer whose weight is stored (in, out).

    Same maths as nn.Linear, but for the M=1 matrix-vector products of decoding the (in, out)
    layout streams about twice as fast through the CPU's BLAS (measured: 10.6 vs 5.6 GB/s),
    and Hugging Face GPT-2 checkpoints load into it without a transpose.
    """

    def __init__(self, n_in: int, n_out: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))  # (in, out)
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, n_in = x.shape
        x2 = x.view(B * T, n_in) if x.is_contiguous() else x.reshape(B * T, n_in)  # (B*T, in)
        return row_matmul(x2, self.weight, self.bias).view(B, T, -1)  # (B, T, out)


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
        if self.n_kv_head == self.n_head:
            # One view + permute + unbind instead of split + 3 views + 3 transposes: a decode step
            # is dispatcher-bound, so op count matters as much as FLOPs.
            q, k, v = qkv.view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
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
        # (B, nh, 1, hs) is already laid out as (B, 1, C); only T > 1 needs the transpose copy.
        y = y.view(B, T, C) if T == 1 else y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        y = self.c_proj(y)
        # Guarded: even a no-op F.dropout costs a dispatcher call per layer per decode step.
        return F.dropout(y, self.dropout, True) if self.training and self.dropout > 0 else y


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = Conv1D(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new" is the tanh approximation; exact GELU would break HF parity.
        y = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        return F.dropout(y, self.dropout, True) if self.training and self.dropout > 0 else y


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
        # Inference-only copy of wte as (C, V+pad): the LM head is the biggest matmul of a decode
        # step and the (in, out) layout runs it ~2x faster on CPU. Built by freeze(), never trained.
        self.lm_head_t: torch.Tensor | None = None
        # Weight views and C row ops for the flat one-token decode step (kvviz.decode); built by freeze().
        self.decode_plan: DecodePlan | None = None

    def freeze(self) -> "GPT":
        """Eval mode, no grads, the transposed LM head and the decode plan.

        Call it after the final .to() and after any in-place change to wte: the LM head is a
        derived copy. (The decode plan reads every other parameter in place.)
        """
        self.eval()
        self.requires_grad_(False)
        # Padded to a multiple of 64 columns so row_matmul can split it across threads even for
        # an odd vocabulary (GPT-2's 50,257); forward slices the padding off.
        wte = self.transformer.wte.weight.detach()  # (V, C)
        pad = -wte.shape[0] % 64
        self.lm_head_t = torch.cat([wte, wte.new_zeros(pad, wte.shape[1])]).t().contiguous()  # (C, V+pad)
        self.decode_plan = build_plan(self, torch.get_num_threads())
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
        if (T == 1 and cache is not None and self.lm_head_t is not None and not self.training
                and not torch.is_grad_enabled()):
            return decode_step(self, idx, input_pos, cache, capture)  # the same maths, written flat
        # Attention mask, built once per forward rather than once per layer.
        mask: torch.Tensor | None = None
        is_causal = False
        if T > 1:
            if start == 0:
                is_causal = True  # plain prefill: SDPA's own causal path
            else:
                # Chunked prefill: query i (at input_pos[i]) sees keys 0..input_pos[i].
                keys = torch.arange(end, device=idx.device)
                mask = keys[None, :] <= input_pos[:, None]  # (T, S)
        x = self.transformer.wte(idx) + self.transformer.wpe(input_pos)  # (B, T, C)
        if self.training and self.config.dropout > 0:
            x = F.dropout(x, self.config.dropout, True)
        for block in self.transformer.h:
            x = block(x, cache, mask, is_causal, capture)
        if last_only:
            x = x[:, -1:, :]  # (B, 1, C)
        x = self.transformer.ln_f(x)
        if self.lm_head_t is not None and not torch.is_grad_enabled():
            B, T, C = x.shape
            logits = row_matmul(x.reshape(B * T, C), self.lm_head_t)  # (B*T, V+pad)
            return logits.view(B, T, -1)[..., : self.config.vocab_size]  # (B, T|1, V)
        return self.lm_head(x)  # (B, T|1, V)
