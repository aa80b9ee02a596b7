"""GPT forward pass against a from-scratch float64 reference, with and without a KV cache."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import pytest
import torch

import kvviz

from kvviz.engine.kvcache.dense import ConcatKVCache, StaticKVCache
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.generation.capture import ForwardCapture
from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.engine.models.gpt2 import GPT
from kvviz.fast.matmul import row_matmul
from kvviz import CacheSpec

KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


def _ln(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps)
    y = y * w if w is not None else y
    return y + b if b is not None else y


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # GPT-2's gelu_new, written out rather than calling torch's implementation.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def reference_forward(gpt: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """GPT-2 maths from the state dict in float64.

    Returns logits (B, T, V), attention (B, nh, T, T) per layer and K/V (2, B, nkv, T, hs) per layer.

    Grouped-query heads follow the usual convention: query head h reads K/V head h // (nh / nkv).
    """
    c = gpt.config
    sd = {k: v.detach().double() for k, v in gpt.state_dict().items()}
    B, T = idx.shape
    C, nh, nkv = c.n_embd, c.n_head, c.kv_heads
    hs = C // nh
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    attns, kvs = [], []
    for i in range(c.n_layer):
        p = f"transformer.h.{i}."
        b = lambda name: sd.get(p + name)  # noqa: E731 (None when bias=False)
        h = _ln(x, sd[p + "ln_1.weight"], b("ln_1.bias"), c.layer_norm_epsilon)
        qkv = h @ sd[p + "attn.c_attn.weight"]
        qkv = qkv + b("attn.c_attn.bias") if b("attn.c_attn.bias") is not None else qkv
        q, k, v = qkv.split([C, nkv * hs, nkv * hs], dim=-1)
        q = q.reshape(B, T, nh, hs).permute(0, 2, 1, 3)
        kvs.append(torch.stack([k.reshape(B, T, nkv, hs).permute(0, 2, 1, 3),
                                v.reshape(B, T, nkv, hs).permute(0, 2, 1, 3)]))
        k = k.reshape(B, T, nkv, hs).permute(0, 2, 1, 3).repeat_interleave(nh // nkv, dim=1)
        v = v.reshape(B, T, nkv, hs).permute(0, 2, 1, 3).repeat_interleave(nh // nkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        attns.append(att)
        y = (att @ v).permute(0, 2, 1, 3).reshape(B, T, C) @ sd[p + "attn.c_proj.weight"]
        x = x + (y + b("attn.c_proj.bias") if b("attn.c_proj.bias") is not None else y)
        h = _ln(x, sd[p + "ln_2.weight"], b("ln_2.bias"), c.layer_norm_epsilon)
        h = h @ sd[p + "mlp.c_fc.weight"]
        h = _gelu_tanh(h + b("mlp.c_fc.bias") if b("mlp.c_fc.bias") is not None else h)
        h = h @ sd[p + "mlp.c_proj.weight"]
        x = x + (h + b("mlp.c_proj.bias") if b("mlp.c_proj.bias") is not None else h)
    x = _ln(x, sd["transformer.ln_f.weight"], sd.get("transformer.ln_f.bias"), c.layer_norm_epsilon)
    return x @ sd["transformer.wte.weight"].T, attns, kvs


def _ids(B: int, T: int, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(KV_HEADS))
@pytest.mark.parametrize("bias", [True, False])
def test_uncached_forward_matches_reference(make_model: Callable[..., LoadedModel], kind: str, bias: bool) -> None:
    m = make_model(n_kv_head=KV_HEADS[kind], bias=bias, seed=1)
    idx = _ids(2, 23)
    ref, _, _ = reference_forward(m.model, idx)
    with torch.inference_mode():
        out = m.model(idx)
    assert out.shape == (2, 23, 256)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    with torch.inference_mode():
        last = m.model(idx, last_only=True)
    assert last.shape == (2, 1, 256)
    torch.testing.assert_close(last.double(), ref[:, -1:], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_cls", [StaticKVCache, ConcatKVCache])
@pytest.mark.parametrize("kind", list(KV_HEADS))
@pytest.mark.parametrize("chunks", [(1, 22), (9, 14), (5, 7, 11), (23,)])
def test_chunked_prefill_and_decode_match_full_forward(
    make_model: Callable[..., LoadedModel], cache_cls: type, kind: str, chunks: tuple[int, ...]
) -> None:
    """Prefill in chunks (the cache already holds tokens), then decode one token at a time."""
    m = make_model(n_kv_head=KV_HEADS[kind])
    idx = _ids(2, 30, seed=2)
    with torch.inference_mode():
        full = m.model(idx)  # (2, 30, V), no cache
        cache = cache_cls(m.config, batch=2)
        pieces, start = [], 0
        for n in chunks:
            pieces.append(m.model(idx[:, start:start + n], cache=cache))
            cache.advance(n)  # the caller, never the model, moves the position
            start += n
        for t in range(start, 30):
            pieces.append(m.model(idx[:, t:t + 1], cache=cache))
            cache.advance(1)
    got = torch.cat(pieces, dim=1)
    assert cache.pos == 30
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(KV_HEADS))
@pytest.mark.parametrize("use_cache", [True, False])
def test_captured_attention_and_kv_match_reference(make_model: Callable[..., LoadedModel], kind: str,
                                                    use_cache: bool) -> None:
    """The generator's captures (newest query row, new K/V) against the float64 reference."""
    m = make_model(n_kv_head=KV_HEADS[kind], seed=5)
    run = kvviz.generate(m, prompt="attend", max_new_tokens=5,
                         capture=kvviz.Capture(attention=True, kv_norms=True, kv_layer=1),
                         cache=CacheSpec(use_cache=use_cache))
    ids = list(run.prompt_ids) + run.generated_ids
    N = len(run.prompt_ids)
    for s, e in enumerate(run.events):
        t = N + s
        _, attn, kv = reference_forward(m.model, torch.tensor([ids[:t]]))
        want = torch.stack([a[0, :, -1, :] for a in attn])  # (L, nh, t): last query over all keys
        np.testing.assert_allclose(e.attn.astype(np.float32), want.numpy(), atol=2e-3, rtol=0)
        new = slice(e.kv_start, t)
        assert e.kv_start == (0 if s == 0 else t - 1)
        np.testing.assert_allclose(e.kv_values.astype(np.float32), kv[1][:, 0, :, new].numpy(), atol=5e-3, rtol=2e-3)
        norms = torch.stack([x[:, 0, :, new].norm(dim=-1) for x in kv])  # (L, 2, nkv, T_new)
        np.testing.assert_allclose(e.kv_norms.astype(np.float32), norms.numpy(), atol=5e-3, rtol=2e-3)


def test_forward_never_advances_the_cache(small_model: LoadedModel) -> None:
    cache = StaticKVCache(small_model.config)
    with torch.inference_mode():
        a = small_model.model(_ids(1, 5), cache=cache)
        assert cache.pos == 0
        # Without advance, a second call overwrites the same positions and gives the same result.
        b = small_model.model(_ids(1, 5), cache=cache)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_explicit_input_pos_equals_default(small_model: LoadedModel) -> None:
    idx = _ids(1, 12)
    with torch.inference_mode():
        c1, c2 = StaticKVCache(small_model.config), StaticKVCache(small_model.config)
        small_model.model(idx[:, :7], cache=c1)
        small_model.model(idx[:, :7], torch.arange(7), cache=c2)
        c1.advance(7)
        c2.advance(7)
        a = small_model.model(idx[:, 7:], cache=c1)
        b = small_model.model(idx[:, 7:], torch.arange(7, 12), cache=c2)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_capture_refs_do_not_change_logits(make_model: Callable[..., LoadedModel]) -> None:
    m = make_model(n_kv_head=2)
    idx = _ids(1, 17)
    with torch.inference_mode():
        plain = m.model(idx)
        fc = ForwardCapture(frozenset({0, 1}))
        captured = m.model(idx, capture=fc)
    torch.testing.assert_close(captured, plain, atol=0, rtol=0)
    assert fc.q_last[0].shape == (1, 4, 1, 8)  # (B, nh, 1, hs)
    assert fc.k[1].shape == (1, 2, 17, 8)  # (B, nkv, S, hs)


def test_sequence_longer_than_block_is_rejected(small_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="exceeds block_size 64"):
        small_model.model(_ids(1, 65))
    cache = StaticKVCache(small_model.config)
    with torch.inference_mode():
        small_model.model(_ids(1, 60), cache=cache)
    cache.advance(60)
    with pytest.raises(ValueError, match="64"):
        small_model.model(_ids(1, 5), cache=cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward_tracks_fp32(make_model: Callable[..., LoadedModel], dtype: torch.dtype) -> None:
    ref = make_model(seed=4)
    half = make_model(seed=4, dtype=dtype)
    assert half.model.transformer.wte.weight.dtype == dtype
    idx = _ids(1, 20)
    with torch.inference_mode():
        a = ref.model(idx)
        b = half.model(idx)
        cache = StaticKVCache(half.config, dtype=dtype)
        c = half.model(idx[:, :12], cache=cache)
        cache.advance(12)
        d = half.model(idx[:, 12:], cache=cache)
    assert b.dtype == dtype
    # Half precision keeps ~3 significant digits; logits here are O(1).
    tol = 0.15 if dtype == torch.bfloat16 else 0.03
    torch.testing.assert_close(b.float(), a, atol=tol, rtol=0)
    torch.testing.assert_close(torch.cat([c, d], 1).float(), b.float(), atol=tol, rtol=0)


def test_gpt2_parameter_names_and_tied_head(small_model: LoadedModel) -> None:
    names = set(dict(small_model.model.named_parameters()))
    for n in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight",
              "transformer.h.1.attn.c_proj.bias", "transformer.h.0.mlp.c_fc.weight", "transformer.h.1.ln_2.bias",
              "transformer.ln_f.weight"):
        assert n in names
    assert small_model.model.lm_head.weight is small_model.model.transformer.wte.weight
    # Conv1D keeps HF's (in, out) layout: c_attn maps C -> C + 2 * kv_dim.
    assert small_model.model.transformer.h[0].attn.c_attn.weight.shape == (32, 96)


def test_num_params_by_hand() -> None:
    cfg = GPTConfig(vocab_size=10, block_size=6, n_layer=1, n_head=2, n_kv_head=1, n_embd=4)
    # wte 10*4 + wpe 6*4 + ln_1 8 + c_attn 4*(4+2*2)+8 + c_proj 16+4 + ln_2 8 + c_fc 4*16+16
    # + mlp c_proj 16*4+4 + ln_f 8 (lm_head tied, counted once)
    expected = 40 + 24 + 8 + 40 + 20 + 8 + 80 + 68 + 8
    gpt = GPT(cfg)
    assert gpt.num_params() == expected
    assert gpt.num_params(non_embedding=True) == expected - 24


def test_config_defaults_and_validation() -> None:
    c = GPTConfig(n_head=8, n_embd=64)
    assert c.n_kv_head == 8 and c.kv_heads == 8 and c.head_dim == 8
    assert GPTConfig.from_dict({**c.to_dict(), "unknown_field": 1}) == c
    for bad in (dict(n_embd=30, n_head=4), dict(n_head=4, n_kv_head=3), dict(n_layer=0),
                dict(vocab_size=-1), dict(n_head=4, n_kv_head=0), dict(dropout=1.0), dict(block_size=2.5)):
        with pytest.raises(ValueError, match="invalid GPTConfig"):
            GPTConfig(**bad)


@pytest.mark.parametrize("threads", [2, 3], indirect=True)
@pytest.mark.parametrize("n_in,n_out", [(32, 96), (256, 768), (12, 7)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 64, 65])
def test_row_matmul_split_matches_float64(threads: int, n_in: int, n_out: int, bias: bool, rows: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows through per-thread column blocks equal x @ w + b; odd widths and over 64 rows fall
    back to the plain GEMM."""
    g = torch.Generator().manual_seed(n_in + n_out)
    x, w = torch.randn(rows, n_in, generator=g), torch.randn(n_in, n_out, generator=g)
    b = torch.randn(n_out, generator=g) if bias else None
    ref = x.double() @ w.double() + (b.double() if b is not None else 0.0)  # (rows, out)
    calls: list[str] = []
    for name in ("bmm", "baddbmm"):  # the split's kernels (baddbmm when there is a bias)
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    with torch.inference_mode():
        got = row_matmul(x, w, b)
    assert got.shape == (rows, n_out)
    # fp32 sums of n_in products of N(0, 1) values: the error grows with n_in.
    torch.testing.assert_close(got.double(), ref, atol=2e-7 * n_in, rtol=1e-5)
    assert bool(calls) == (n_out % threads == 0 and rows <= 64)  # the split ran exactly when it should
    calls.clear()
    row_matmul(x, w, b)  # grads on (training): always the plain GEMM
    with torch.inference_mode():
        half = row_matmul(x.bfloat16(), w.bfloat16(), b.bfloat16() if b is not None else None)
    assert not calls  # nor in bf16, where the split measured slower
    torch.testing.assert_close(half.double(), ref, atol=0.05 * float(ref.abs().max()), rtol=0.0)


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_split_decode_with_odd_vocab_matches_full_forward(make_model: Callable[..., LoadedModel],
                                                          threads: int) -> None:
    """Two threads (the one-row C kernel, or split matmuls without it) and a 101-token vocabulary
    (a padded LM head, whose last tile is short)."""
    m = make_model(vocab_size=101, seed=4)
    idx = torch.randint(0, 101, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        full = m.model(idx)  # (1, 24, 101): 24 rows, the plain GEMM path
        cache = StaticKVCache(m.config)
        m.model(idx[:, :8], cache=cache)
        cache.advance(8)
        steps = []
        for t in range(8, 24):
            steps.append(m.model(idx[:, t:t + 1], cache=cache))  # (1, 1, 101): one row, the flat step
            cache.advance(1)
    got = torch.cat(steps, dim=1)
    assert got.shape == (1, 16, 101)
    torch.testing.assert_close(got, full[:, 8:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.double(), reference_forward(m.model, idx)[0], atol=2e-5, rtol=1e-5)
