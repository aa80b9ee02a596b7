"""kvviz.engine.generation.flops and the cache byte formula against values worked out by hand on a toy shape.

Toy shape: L=1 layer, C=4, 2 heads, V=10. Per layer and token, the matmuls are
c_attn 4x12, c_proj 4x4, MLP 4x16 and 16x4; attention costs 2*2*C per key seen.
"""
from __future__ import annotations

import pytest

from kvviz.units import kv_bytes_per_token
from kvviz.engine.generation.flops import arithmetic_intensity, forward_bytes, forward_flops, generation_flops, weight_bytes
from kvviz.engine.generation.loop import generate
from kvviz.engine.models.config import GPTConfig
from kvviz.engine.models.gpt2 import GPT

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


def test_events_carry_the_formula_flops(small_model) -> None:  # type: ignore[no-untyped-def]
    cfg = small_model.config
    for cached in (True, False):
        run = generate(small_model, prompt_ids=list(range(5)), max_new_tokens=4, use_cache=cached)
        assert [e.flops for e in run.events] == generation_flops(cfg, 5, 4, cached)
