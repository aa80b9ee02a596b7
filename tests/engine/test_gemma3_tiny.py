"""Gemma 3's readable model on a tiny random config: the sliding window, the layer kinds and the
cache contract, checked without the real weights (the real model: test_gemma3_real.py)."""
from __future__ import annotations

import math

import pytest
import torch

import kvviz
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.loading.loader import wrap_model
from kvviz.engine.models.gemma3 import FULL, SLIDING, Gemma3, Gemma3Config, param_shapes, sliding_mask
from kvviz.engine.tokenize.tokenizer import ByteTokenizer

# 3 layers, every 3rd global: two sliding layers with a window of 5, one global; MQA like 270M.
TINY = dict(vocab_size=256, block_size=64, context_length=64, n_layer=3, n_head=4, n_kv_head=1, n_embd=32,
            head_dim=16, intermediate_size=48, sliding_window=5, sliding_pattern=3, eos_token_id=None)


def tiny(seed: int = 0, **over: object) -> kvviz.LoadedModel:
    cfg = Gemma3Config(**{**TINY, **over})
    net = Gemma3(cfg)
    net.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # spread the logits so greedy never sits on a float-noise tie
        net.model.norm.weight.fill_(9.0)
        for p in net.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return wrap_model(net, ByteTokenizer(256), "tiny-gemma3", torch.device("cpu"), torch.float32, True, "tests")


def test_layer_kinds_follow_the_pattern() -> None:
    assert Gemma3Config().layer_types == tuple(FULL if i in (5, 11, 17) else SLIDING for i in range(18))
    assert Gemma3Config(**TINY).layer_types == (SLIDING, SLIDING, FULL)


def test_param_shapes_match_270m() -> None:
    shapes = param_shapes(Gemma3Config())
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (1024, 640)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (256, 640)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (256,)
    # 268,098,176 parameters: Google's published count for gemma-3-270m (the head is tied).
    assert sum(math.prod(s) for s in shapes.values()) == 268_098_176


def test_sliding_mask_keeps_the_last_window() -> None:
    pos = torch.arange(3, 7)  # a chunk of 4 queries after 3 cached tokens, window 3
    mask, causal = sliding_mask(4, 3, pos, 3)
    assert not causal and mask is not None
    want = [[k <= p and k > p - 3 for k in range(7)] for p in range(3, 7)]
    assert mask.tolist() == want
    # Before the last query passes the window it is the plain causal mask.
    assert sliding_mask(4, 0, torch.arange(4), 5) == (None, True)


def test_sliding_layers_ignore_keys_outside_the_window() -> None:
    m = tiny()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        base = m.model(ids)[0, -1]
        # Changing a token 12 places back reaches the last position only through the global layer
        # and through chains of windows; with every layer sliding, it cannot (3 layers x 4 < 12).
        all_sliding = tiny(sliding_pattern=64)
        a = all_sliding.model(ids)[0, -1]
        ids2 = ids.clone()
        ids2[0, 19 - 13] = (ids2[0, 19 - 13] + 1) % 256
        assert torch.equal(all_sliding.model(ids2)[0, -1], a)
        assert not torch.allclose(m.model(ids2)[0, -1], base)  # the global layer sees it


@pytest.mark.parametrize("kind", ["static", "concat", "paged"])
def test_cached_decode_equals_one_forward_past_the_window(kind: str) -> None:
    """A prefill of 6 then 14 one-token steps through each cache kind give the logits of one
    uncached forward over all 20 tokens: the sliding layers' mask over the cache is exact."""
    m = tiny()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        whole = m.model(ids)  # (1, 20, V)
        cache = make_cache(kind, m.config, 1, "cpu", torch.float32)
        steps = [m.model(ids[:, :6], cache=cache)]
        cache.advance(6)
        for t in range(6, 20):
            steps.append(m.model(ids[:, t:t + 1], cache=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, 1), whole, atol=1e-5, rtol=1e-5)


def test_generate_cached_equals_uncached() -> None:
    m = tiny(seed=1)
    kw = dict(prompt_ids=list(range(40, 52)), max_new_tokens=12, temperature=1.0, seed=7)
    assert kvviz.generate(m, **kw).generated_ids == kvviz.generate(m, use_cache=False, **kw).generated_ids


def test_chunked_prefill_equals_one_forward() -> None:
    m = tiny()
    ids = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        whole = m.model(ids)
        cache = make_cache("static", m.config, 1, "cpu", torch.float32)
        parts = []
        for a, b in ((0, 6), (6, 13), (13, 17)):
            parts.append(m.model(ids[:, a:b], cache=cache))
            cache.advance(b - a)
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=1e-5)


def test_bad_config_refused() -> None:
    with pytest.raises(ValueError, match="n_kv_head"):
        Gemma3Config(**{**TINY, "n_kv_head": 3})
    with pytest.raises(ValueError, match="sliding_window"):
        Gemma3Config(**{**TINY, "sliding_window": 0})


def test_no_accelerator_and_quantized_kv_runs_window_refused() -> None:
    m = tiny()
    assert m.fast is None  # kvviz.fast knows GPT-2 and Llama; Gemma 3 runs the readable model
    run = kvviz.generate(m, prompt_ids=list(range(40, 52)), max_new_tokens=10, kv_dtype="int8")
    assert len(run.generated_ids) == 10
    with pytest.raises(kvviz.KVVizError, match="already slides its own window of 5 positions on 2 of its 3 layers"):
        kvviz.generate(m, prompt_ids=[1, 2, 3], max_new_tokens=2, window=8)
