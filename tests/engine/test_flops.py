"""Analytic FLOPs and bytes (kvviz.engine.generation.flops, kvviz.units' KV byte formula): hand
arithmetic on toy shapes, torch's own FLOP counter, and parameter counts."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import kvviz
import kvviz.fast.gpt2_flat
from kvviz.engine.kvcache.dense import StaticKVCache
from kvviz.units import kv_bytes_per_token
from kvviz.engine.loading.loader import RANDOM_SHAPES, LoadedModel
from kvviz.engine.generation.flops import arithmetic_intensity, forward_bytes, forward_flops, generation_flops, weight_bytes
from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.engine.models.gpt2 import GPT
from kvviz import CacheSpec

# L=2 layers, C=4 wide, 2 query heads of head_dim 2, 1 K/V head (kv_dim 2), V=10.
TINY = GPTConfig(vocab_size=10, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=4)


def test_forward_flops_by_hand_prefill() -> None:
    # 3 new tokens from position 0: the causal keys seen are 1 + 2 + 3 = 6.
    per_layer = (
        2 * 3 * 4 * (4 + 2 + 2)  # c_attn: T x C @ C x (C + 2 kv_dim) = 192
        + 2 * 4 * 6  # QK^T: each (query, key) pair is a dot product over n_head * head_dim = 4: 48
        + 2 * 4 * 6  # AV: the same count again: 48
        + 2 * 3 * 4 * 4  # c_proj: 96
        + 2 * 3 * 4 * 16 + 2 * 3 * 16 * 4  # MLP up and down: 384 + 384
    )
    assert per_layer == 1152
    lm_head = 2 * 1 * 4 * 10  # logits for the last position only: 80
    assert forward_flops(TINY, 3, 0) == 2 * per_layer + lm_head == 2384
    assert forward_flops(TINY, 3, 0, n_logits=3) == 2 * per_layer + 3 * lm_head
    assert forward_flops(TINY, 3, 0, batch=5) == 5 * 2384


def test_forward_flops_by_hand_decode() -> None:
    # One token at position 5 sees 6 keys.
    per_layer = 2 * 1 * 4 * 8 + 2 * 4 * 6 + 2 * 4 * 6 + 2 * 1 * 4 * 4 + 2 * 2 * 1 * 4 * 16
    assert per_layer == 64 + 48 + 48 + 32 + 256 == 448
    assert forward_flops(TINY, 1, 5) == 2 * 448 + 80 == 976


def _torch_matmul_flops(gpt: GPT, idx: torch.Tensor, cache: StaticKVCache | None) -> int:
    """FLOPs torch itself counts for the linear layers and the LM head (attention excluded)."""
    with FlopCounterMode(display=False) as counter:
        gpt(idx, cache=cache, last_only=True)
    counts = counter.get_flop_counts()["Global"]
    return sum(v for k, v in counts.items() if str(k) in ("aten.mm", "aten.addmm", "aten.matmul", "aten.linear"))


@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("batch", [1, 2])
def test_forward_flops_against_torch_flop_counter(make_model: Callable[..., LoadedModel], kv: int, batch: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # torch counts only its own ops: keep the one-row decode step off the C kernel (kvviz.fast.rowops).
    monkeypatch.setattr(kvviz.fast.gpt2_flat, "row_linear", lambda *a, **k: None)
    m = make_model(n_kv_head=kv)
    c = m.config
    N = 9
    attn = lambda keys_seen: batch * c.n_layer * 2 * 2 * c.n_embd * keys_seen  # noqa: E731 (QK^T + AV)
    with torch.inference_mode():
        cache = StaticKVCache(c, batch=batch)
        idx = torch.randint(0, 256, (batch, N), generator=torch.Generator().manual_seed(0))
        prefill = _torch_matmul_flops(m.model, idx, cache)
        cache.advance(N)
        decode = _torch_matmul_flops(m.model, idx[:, :1], cache)
    assert forward_flops(c, N, 0, batch=batch) == prefill + attn(N * (N + 1) // 2)
    assert forward_flops(c, 1, N, batch=batch) == decode + attn(N + 1)


@pytest.mark.parametrize("overrides", [dict(), dict(n_kv_head=2), dict(n_kv_head=1), dict(n_layer=3, n_embd=48)])
def test_weight_bytes_equal_the_parameters_a_forward_reads(overrides: dict) -> None:
    cfg = GPTConfig(**{**dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32), **overrides})
    gpt = GPT(cfg)
    wpe = cfg.block_size * cfg.n_embd  # position embeddings are looked up, not streamed
    assert weight_bytes(cfg, 4) == 4 * (gpt.num_params() - wpe)
    assert weight_bytes(cfg, 2) == 2 * (gpt.num_params() - wpe)
    assert sum(p.nbytes for p in gpt.parameters()) - wpe * 4 == weight_bytes(cfg, 4)


def test_gpt2_small_parameter_count() -> None:
    # GPT-2 small has 124,439,808 parameters (tied head), of which wpe is 1024 x 768.
    assert weight_bytes(RANDOM_SHAPES["gpt2-small"], 4) // 4 + 1024 * 768 == 124_439_808


def test_forward_bytes_count_weights_and_kv_traffic() -> None:
    c = RANDOM_SHAPES["tiny-gqa"]
    per_token = kv_bytes_per_token(c.n_layer, c.kv_heads, c.head_dim, 4)  # 2 * 4 layers * 2 heads * 32 * 4 bytes = 2048
    assert per_token == 2048
    w = weight_bytes(c, 4)
    assert forward_bytes(c, 1, 100, 4) == w + 100 * per_token + per_token
    assert forward_bytes(c, 1, 100, 4, cached=False) == w
    assert forward_bytes(c, 1, 100, 2, batch=3) == weight_bytes(c, 2) + 3 * 101 * per_token // 2
    assert arithmetic_intensity(c, 1, 100) == forward_flops(c, 1, 100) / forward_bytes(c, 1, 100)


@pytest.mark.parametrize("use_cache", [True, False])
def test_step_events_carry_the_step_flops(small_model: LoadedModel, use_cache: bool) -> None:
    run = kvviz.generate(small_model, prompt=[1, 2, 3, 4, 5], max_new_tokens=6, cache=CacheSpec(use_cache=use_cache))
    c = small_model.config
    expected = generation_flops(c, 5, 6, cached=use_cache)
    assert [e.flops for e in run.events] == expected
    by_hand = [forward_flops(c, 5, 0)] + [forward_flops(c, 1, 5 + i - 1) if use_cache else forward_flops(c, 5 + i, 0)
                                          for i in range(1, 6)]
    assert expected == by_hand
    if not use_cache:
        assert sum(expected) > sum(generation_flops(c, 5, 6, cached=True))


@pytest.mark.parametrize("overrides", [dict(), dict(n_kv_head=1, head_dim=12), dict(tie_word_embeddings=False)])
def test_llama_flops_and_weight_bytes_against_torch(overrides: dict) -> None:
    """SwiGLU's three matrices, a query width != n_embd and an untied head: torch's own counts agree."""
    from kvviz.engine.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(**{**dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                                intermediate_size=80), **overrides})
    net = Llama(cfg)
    net.init_weights(torch.Generator().manual_seed(0))
    assert weight_bytes(cfg, 4) == sum(p.nbytes for p in {id(p): p for p in net.parameters()}.values())
    qd, N = cfg.n_head * cfg.head_dim, 7
    attn = lambda keys_seen: cfg.n_layer * 2 * 2 * qd * keys_seen  # noqa: E731 (QK^T + AV, SDPA is not counted)
    with torch.inference_mode():
        cache = StaticKVCache(cfg)
        idx = torch.randint(0, 64, (1, N), generator=torch.Generator().manual_seed(1))
        prefill = _torch_matmul_flops(net, idx, cache)
        cache.advance(N)
        decode = _torch_matmul_flops(net, idx[:, :1], cache)
    assert forward_flops(cfg, N, 0) == prefill + attn(N * (N + 1) // 2)
    assert forward_flops(cfg, 1, N) == decode + attn(N + 1)


def test_gemma3_flops_count_the_windows_and_weight_bytes_the_parameters() -> None:
    """Sliding layers see at most `sliding_window` keys; 270M's weights are its 268,098,176 parameters."""
    from kvviz.engine.models.gemma3 import Gemma3Config

    c = Gemma3Config()
    assert weight_bytes(c, 4) == 4 * 268_098_176
    qd = c.n_head * c.head_dim
    no_attn = forward_flops(c, 1, 0) - 2 * 2 * qd * c.n_layer  # one query seeing one key, per layer
    for T, start in ((1, 0), (1, 511), (1, 512), (1, 5000), (700, 0), (300, 400), (64, 2000)):
        seen = {w: sum(min(p + 1, w) for p in range(start, start + T)) for w in (512, 10**9)}
        keys = 15 * seen[512] + 3 * seen[10**9]  # brute force: 15 sliding layers, 3 global
        assert forward_flops(c, T, start) == T * no_attn - (T - 1) * 2 * c.n_embd * c.vocab_size + 2 * 2 * qd * keys


# Toy shapes: L=1 layer, C=4, 2 heads (TOY_GQA: 1 K/V head), V=10. Per layer and token, the matmuls are
# c_attn 4x12, c_proj 4x4, MLP 4x16 and 16x4; attention costs 2*2*C per key seen.
TOY = GPTConfig(vocab_size=10, block_size=16, n_layer=1, n_head=2, n_embd=4)
TOY_GQA = GPTConfig(vocab_size=10, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=4)


def test_one_token_prefill_by_hand() -> None:
    # c_attn 2*1*4*12 = 96; QK^T+AV 2*2*4*1 = 16; c_proj 2*1*4*4 = 32; MLP 2*2*1*4*16 = 256; head 2*4*10 = 80
    assert forward_flops(TOY, 1, 0) == 96 + 16 + 32 + 256 + 80 == 480


def test_three_token_prefill_by_hand() -> None:
    # keys seen: 1 + 2 + 3 = 6 (causal); c_attn 288, attention 4*4*6 = 96, c_proj 96, MLP 768, head 80
    assert forward_flops(TOY, 3, 0) == 288 + 96 + 96 + 768 + 80 == 1328


def test_cached_decode_step_by_hand() -> None:
    # The token at position 2 sees 3 keys: attention 4*4*3 = 48.
    assert forward_flops(TOY, 1, 2) == 96 + 48 + 32 + 256 + 80 == 512
    assert forward_flops(TOY, 1, 2, batch=2) == 1024  # batch rows are independent work


def test_gqa_shrinks_only_the_kv_projection() -> None:
    # kv width 2 instead of 4: c_attn is 4x8 -> 2*4*8 = 64; everything else is unchanged.
    assert forward_flops(TOY_GQA, 1, 0) == 64 + 16 + 32 + 256 + 80 == 448


def test_generation_flops_cached_vs_recomputed() -> None:
    cached = generation_flops(TOY, prompt_len=2, new_tokens=3, cached=True)
    uncached = generation_flops(TOY, prompt_len=2, new_tokens=3, cached=False)
    assert cached[0] == uncached[0] == forward_flops(TOY, 2, 0)  # same prefill
    assert cached[1:] == [forward_flops(TOY, 1, 2), forward_flops(TOY, 1, 3)]
    assert uncached[1:] == [forward_flops(TOY, 3, 0), forward_flops(TOY, 4, 0)]
    assert sum(uncached) > sum(cached)


def test_weight_bytes_by_hand_and_against_the_real_model() -> None:
    # Per layer: 12C^2 + 13C = 244 weights; plus the tied wte (V*C = 40) and ln_f (2C = 8).
    assert weight_bytes(TOY, 4) == 4 * (244 + 40 + 8) == 1168
    gpt = GPT(TOY)
    wpe = gpt.transformer.wpe.weight.numel()  # position rows are gathered, not streamed: not counted
    assert weight_bytes(TOY, 4) == 4 * (gpt.num_params() - wpe)
    assert weight_bytes(TOY, 2) == 1168 // 2


def test_forward_bytes_and_intensity_by_hand() -> None:
    # Decode at position 2 (fp32): weights 1168 + read 2 cached tokens of K and V (2*1*4*2*4 = 64)
    # + write the new token's K and V (2*1*4*1*4 = 32).
    assert forward_bytes(TOY, 1, 2, 4) == 1168 + 64 + 32 == 1264
    assert arithmetic_intensity(TOY, 1, 2, 4) == pytest.approx(512 / 1264)
    assert forward_bytes(TOY, 3, 0, 4, cached=False) == 1168  # nothing cached to read or write


def test_kv_bytes_per_token_by_hand() -> None:
    # 2 (K and V) * L * n_kv_head * head_dim * bytes * batch
    assert kv_bytes_per_token(TOY.n_layer, TOY.kv_heads, TOY.head_dim, 4) == 2 * 1 * 2 * 2 * 4 == 32
    assert kv_bytes_per_token(TOY_GQA.n_layer, TOY_GQA.kv_heads, TOY_GQA.head_dim, 2, batch=3) == 2 * 1 * 1 * 2 * 2 * 3 == 24
