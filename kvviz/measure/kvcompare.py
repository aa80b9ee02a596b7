"""What a compressed KV cache costs, measured as the cache is really used.

Teacher forcing through the cache: the true tokens are fed in chunks (a chunked prefill; one
token at a time once a window is full), so every position's attention reads the cache as it
stands, quantized rows and evictions included. A single full-sequence forward never reads a
cache and would measure nothing.

``compare`` runs a full-precision cache and the compressed one in lockstep on the same tokens:
per position the NLL of the next token under each, the KL(full || compressed) of the logits and
whether their top-1 agree; on one-token steps, the KL of each layer's and head's attention row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from kvviz.engine.core.step import backend_of, run_step
from kvviz.engine.kvcache.dense import KVCache
from kvviz.engine.generation.capture import ForwardCapture
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.generation.kv_spec import KVSpec
from kvviz.engine.loading.loader import LoadedModel
from kvviz.errors import KVVizError

MAX_TOKENS = 8192


@dataclass
class Comparison:
    """Per scored position i (predicting ids[i + 1]); ``ref`` is the full-precision cache."""

    label: str
    nll_ref: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)  # KL(ref || compressed) of the next-token distribution
    agree: list[bool] = field(default_factory=list)  # top-1 equal
    attn_kl_sum: torch.Tensor | None = None  # (n_layer, n_head) summed over one-token steps
    attn_steps: int = 0
    cache_bytes: int = 0
    ref_bytes: int = 0
    errors: dict[str, float] = field(default_factory=dict)

    @property
    def attn_kl(self) -> list[list[float]] | None:
        if self.attn_kl_sum is None or not self.attn_steps:
            return None
        return (self.attn_kl_sum / self.attn_steps).tolist()

    def summary(self) -> dict[str, Any]:
        n = len(self.nll)
        first = next((i for i, a in enumerate(self.agree) if not a), None)
        return {
            "kv": self.label, "tokens_scored": n,
            "perplexity": math.exp(sum(self.nll) / n), "perplexity_full": math.exp(sum(self.nll_ref) / n),
            "mean_logit_kl": sum(self.kl) / n, "max_logit_kl": max(self.kl),
            "top1_agreement": sum(self.agree) / n, "first_top1_disagreement": first,
            "cache_bytes": self.cache_bytes, "full_cache_bytes": self.ref_bytes,
            "kv_error": self.errors, "attention_kl_mean": (None if self.attn_kl is None else
                                                           float(self.attn_kl_sum.mean() / self.attn_steps)),
        }


def check_ids(model: LoadedModel, ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in ids]
    if len(ids) < 2:
        raise KVVizError("teacher forcing needs at least 2 tokens")
    if len(ids) > min(MAX_TOKENS, model.config.block_size):
        raise KVVizError(f"{len(ids)} tokens: the limit is {min(MAX_TOKENS, model.config.block_size)} "
                         "(the model's context, positions stay original)")
    return ids


def _rows(fc: ForwardCapture, n_head: int) -> dict[int, torch.Tensor]:
    """Each captured layer's newest attention row (nh, S), batch row 0, in fp32."""
    out = {}
    for i, q in fc.q_last.items():
        k = fc.k[i][0].float()  # (nkv, S, hs)
        k = k.repeat_interleave(n_head // k.shape[0], dim=0)  # (nh, S, hs): GQA's shared heads
        s = (q[0, :, -1].float()[:, None, :] * k).sum(-1) / math.sqrt(k.shape[-1])  # (nh, S)
        out[i] = torch.log_softmax(s, dim=-1)
    return out


def compare(model: LoadedModel, ids: Sequence[int], kv: KVSpec, chunk: int = 64, fast: bool = True,
            attention: bool = False, ref: KVSpec | None = None, first: int | None = None) -> Comparison:
    """Full-precision vs ``kv`` (resolved) on the same tokens; see the module docstring.

    ``attention`` adds the per layer/head attention-row KL on one-token steps (quantized caches
    only: a window's rows are a different set of keys); ``ref`` swaps the reference cache;
    ``first`` feeds that many tokens in the first forward (a prompt's prefill), then ``chunk``.
    """
    ids = check_ids(model, ids)
    cfg, dev = model.config, model.device
    backend = backend_of(model, fast)
    a = make_cache("static", cfg, 1, dev, model.dtype, kv=ref)
    b = make_cache("static", cfg, 1, dev, model.dtype, kv=kv)
    out = Comparison(kv.label())
    want_attn = attention and not kv.windowed
    layers = frozenset(range(cfg.n_layer)) if want_attn else frozenset()
    seq = torch.tensor(ids, device=dev)[None]  # (1, N)
    n_total = len(ids) - 1  # the last token is only a target
    p = 0
    with torch.inference_mode():
        while p < n_total:
            n = min(first if (p == 0 and first) else chunk, n_total - p, a.max_feed(), b.max_feed())
            inp, pos = seq[:, p:p + n], torch.arange(p, p + n, device=dev)
            fa = ForwardCapture(layers) if want_attn and n == 1 else None
            fb = ForwardCapture(layers) if want_attn and n == 1 else None
            la = run_step(model, a, inp, pos, backend=backend, capture=fa, last_only=False)[0].float()  # (n, V)
            lb = run_step(model, b, inp, pos, backend=backend, capture=fb, last_only=False)[0].float()
            _score(out, la, lb, seq[0, p + 1:p + n + 1])
            if fa is not None and fb is not None:
                ra, rb = _rows(fa, cfg.n_head), _rows(fb, cfg.n_head)
                kl = torch.stack([(ra[i].exp() * (ra[i] - rb[i])).sum(-1) for i in sorted(ra)])  # (L, nh)
                out.attn_kl_sum = kl if out.attn_kl_sum is None else out.attn_kl_sum + kl
                out.attn_steps += 1
            p += n
    out.cache_bytes, out.ref_bytes = b.bytes_used, a.bytes_used
    log = getattr(b, "errors", None)
    out.errors = log.summary() if log is not None else {}
    return out


def _score(out: Comparison, la: torch.Tensor, lb: torch.Tensor, targets: torch.Tensor) -> None:
    pa, pb = F.log_softmax(la, -1), F.log_softmax(lb, -1)  # (n, V)
    out.nll_ref += (-pa.gather(-1, targets[:, None])[:, 0]).tolist()
    out.nll += (-pb.gather(-1, targets[:, None])[:, 0]).tolist()
    out.kl += (pa.exp() * (pa - pb)).sum(-1).clamp_min(0).tolist()
    out.agree += (la.argmax(-1) == lb.argmax(-1)).tolist()


def nll_through_cache(model: LoadedModel, ids: Sequence[int], kv: KVSpec | None, chunk: int = 64,
                      fast: bool = True) -> tuple[list[float], KVCache]:
    """The NLL of every next token (len(ids) - 1 values), teacher-forced through one cache."""
    ids = check_ids(model, ids)
    cfg, dev = model.config, model.device
    backend = backend_of(model, fast)
    cache = make_cache("static", cfg, 1, dev, model.dtype, kv=kv)
    seq = torch.tensor(ids, device=dev)[None]
    nll: list[float] = []
    p, n_total = 0, len(ids) - 1
    with torch.inference_mode():
        while p < n_total:
            n = min(chunk, n_total - p, cache.max_feed())
            logits = run_step(model, cache, seq[:, p:p + n], torch.arange(p, p + n, device=dev), backend=backend,
                              last_only=False)[0].float()  # (n, V)
            lp = F.log_softmax(logits, -1)
            nll += (-lp.gather(-1, seq[0, p + 1:p + n + 1, None])[:, 0]).tolist()
            p += n
    return nll, cache


def plain_nll(model: LoadedModel, ids: Sequence[int]) -> list[float]:
    """The same NLLs from one forward over the whole sequence, with no cache."""
    ids = check_ids(model, ids)
    seq = torch.tensor(ids, device=model.device)[None]
    with torch.inference_mode():  # the readable model, no cache: positions 0..N-2 under a causal mask
        logits = run_step(model, None, seq[:, :-1], torch.arange(len(ids) - 1, device=model.device),
                          backend="readable", last_only=False)
        lp = F.log_softmax(logits[0].float(), -1)  # (N-1, V)
    return (-lp.gather(-1, seq[0, 1:, None])[:, 0]).tolist()


def by_position(nll: Sequence[float], bins: int) -> list[tuple[int, float]]:
    """(first position of the bin, perplexity over the bin) for ``bins`` equal bins."""
    n = len(nll)
    size = max(1, -(-n // bins))
    return [(i, math.exp(sum(nll[i:i + size]) / len(nll[i:i + size]))) for i in range(0, n, size)]
