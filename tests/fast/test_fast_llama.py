"""The Llama accelerator (kvviz.fast.llama_flat) against the readable model and a float64 reference.

Random Llama configs (MHA, GQA, MQA, head_dim != C/nh, an untied head with biases), each run
with the C row ops ("c") and without them ("torch"), on 1 and 2 threads. SmolLM2 itself is
tested in test_smollm2.py, which shares one loaded model.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import kvviz
import kvviz.fast.llama_flat
from kvviz.engine.kvcache.dense import ConcatKVCache, StaticKVCache
from kvviz.engine.generation.capture import Capture, ForwardCapture
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.loaded import wrap_model
from kvviz.engine.models.llama import Llama, LlamaConfig, rope_tables
from kvviz.engine.tokenize.tokenizer import ByteTokenizer
from kvviz.fast import build, rowops
from kvviz.fast.llama_flat import FastLlama, max_c_rows_fp32
from accel_checks import assert_concurrent_runs_match_sequential, decode_all
from keyword_sets import request_kwargs

HAVE_C = rowops.load() is not None

BASE: dict[str, Any] = dict(vocab_size=128, block_size=48, n_layer=2, n_embd=64, intermediate_size=91,
                            rope_theta=1000.0, rms_norm_eps=1e-5)
KINDS: dict[str, dict[str, Any]] = {
    "mha": dict(n_head=4, n_kv_head=4),
    "gqa": dict(n_head=8, n_kv_head=2),
    "mqa": dict(n_head=4, n_kv_head=1),
    "head_dim": dict(n_head=4, n_kv_head=2, head_dim=24),  # 4 x 24 = 96 != 64
    "untied": dict(n_head=4, n_kv_head=2, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
}


def make_llama(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A random Llama whose norms and biases are not 0 and 1 (so their fusions are tested) and
    whose logits are spread (so greedy argmax never sits on a near-tie)."""
    model = Llama(LlamaConfig(**{**BASE, **KINDS[kind]}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
        model.model.norm.weight.mul_(3.0)
    return wrap_model(model, ByteTokenizer(BASE["vocab_size"], None), f"llama-{kind}", torch.device("cpu"), dtype,
                   True, "tests")


def reference(m: LoadedModel, idx: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of the whole sequence in float64, from the weights as stored, with exact
    RoPE tables (a bf16 model's own tables are rounded)."""
    ref = copy.deepcopy(m.model).double()
    cos, sin = rope_tables(m.config)
    ref.rope_cos, ref.rope_sin = cos.double(), sin.double()
    with torch.inference_mode():
        return ref(idx)


@pytest.fixture(params=["c", "torch"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """With the C row ops ("c", skipped where they cannot be built) and without them ("torch":
    the path of a machine without a C compiler). Models are made after this fixture runs."""
    if request.param == "c" and not HAVE_C:
        pytest.skip(f"no C row ops here: {rowops.status()}")
    if request.param == "torch":
        monkeypatch.setattr(kvviz.fast.llama_flat, "row_dot", lambda *a, **k: None)
    return request.param


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which forward each call took: "one" (one row through C), "rows" (C), "torch"."""
    took: list[str] = []
    for name, tag in (("_one_row", "one"), ("_rows_c", "rows"), ("forward_torch", "torch")):
        real = getattr(kvviz.fast.llama_flat, name)
        monkeypatch.setattr(kvviz.fast.llama_flat, name, lambda *a, _r=real, _t=tag: took.append(_t) or _r(*a))
    return took


def tokens(batch: int, T: int, seed: int) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (batch, T), generator=torch.Generator().manual_seed(seed))


def test_build_gives_a_llama_its_accelerator() -> None:
    m = make_llama("gqa")
    assert isinstance(m.fast, FastLlama) and m.fast.name == "fast"
    assert isinstance(build(m.model), FastLlama)
    assert build(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("cache_cls", [StaticKVCache, ConcatKVCache])
def test_token_by_token_decode_matches_float64(kind: str, threads: int, batch: int, cache_cls: type, kernel: str,
                                              paths: list[str]) -> None:
    """Every position decoded alone (the first into an empty cache) equals the float64 reference:
    batch 1 through the one-row C step, batch 2 through C's rows, or PyTorch ops without C."""
    m = make_llama(kind, seed=3)
    assert (m.fast.plan().rows is not None) == (kernel == "c")
    idx = tokens(batch, 16, seed=4)
    got = decode_all(m, idx, cache_cls)
    want = {"c": "one" if batch == 1 else "rows", "torch": "torch"}[kernel]
    assert paths == [want] * 16
    torch.testing.assert_close(got.double(), reference(m, idx), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_chunks_and_captures_equal_the_readable_model(kind: str, threads: int, kernel: str) -> None:
    """Prefill, a chunked prefill (a mask over cached keys), a decode step and a recompute without
    cache: the same logits as the readable model, the same cache contents, and captures that are
    the cache's own tensors (post-RoPE K) with the readable model's q."""
    m = make_llama(kind, seed=5)
    idx = tokens(2, 14, seed=6)
    layers = frozenset({0, 1})
    caches = {"fast": StaticKVCache(m.config, batch=2), "readable": StaticKVCache(m.config, batch=2)}
    fwd = {"fast": m.fast.forward, "readable": m.model}
    got: dict[str, list[torch.Tensor]] = {"fast": [], "readable": []}
    caps: dict[str, ForwardCapture] = {}
    with torch.inference_mode():
        for name in fwd:
            cache = caches[name]
            for a, b in ((0, 8), (8, 13), (13, 14)):  # prefill 8, a chunk of 5, one decode step
                fc = ForwardCapture(layers)
                got[name].append(fwd[name](idx[:, a:b], torch.arange(a, b), cache, fc))
                cache.advance(b - a)
                caps[name] = fc
            got[name].append(fwd[name](idx, torch.arange(14), None, None, last_only=True))  # no cache
    for a, b in zip(got["fast"], got["readable"]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert got["fast"][-1].shape == (2, 1, BASE["vocab_size"])
    f, r = caps["fast"], caps["readable"]
    for i in layers:
        k, v = caches["fast"].layer(i)
        assert torch.equal(f.k[i], k) and torch.equal(f.v[i], v)  # the cache's own contents
        assert f.q_last[i].shape == r.q_last[i].shape == (2, m.config.n_head, 1, m.config.head_dim)
        torch.testing.assert_close(f.q_last[i], r.q_last[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k, caches["readable"].layer(i)[0], atol=1e-5, rtol=1e-5)  # post-RoPE
        torch.testing.assert_close(v, caches["readable"].layer(i)[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gqa", "untied"])
def test_chunked_prefill_equals_one_shot(kind: str, kernel: str) -> None:
    m = make_llama(kind, seed=8)
    idx = tokens(1, 12, seed=9)
    with torch.inference_mode():
        one = m.fast.forward(idx, torch.arange(12), StaticKVCache(m.config))
        cache, parts = StaticKVCache(m.config), []
        for a, b in ((0, 5), (5, 6), (6, 12)):
            parts.append(m.fast.forward(idx[:, a:b], torch.arange(a, b), cache))
            cache.advance(b - a)
    torch.testing.assert_close(torch.cat(parts, dim=1), one, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_generate_fast_and_readable_give_the_same_tokens(kind: str, kernel: str) -> None:
    """Through the one loop, greedy: cached (batch 1 and 2) and uncached, fast == readable."""
    m = make_llama(kind, seed=11)
    for kw in (dict(batch_size=1), dict(batch_size=2), dict(use_cache=False), dict(cache_kind="concat")):
        fast = kvviz.generate(m, **request_kwargs(prompt_ids=[3, 14, 15, 92, 65], max_new_tokens=12, **kw))
        slow = kvviz.generate(m,
                              **request_kwargs(prompt_ids=[3, 14, 15, 92, 65], max_new_tokens=12, fast=False, **kw))
        assert (fast.engine, slow.engine) == ("fast", "readable")
        assert fast.generated_ids == slow.generated_ids, kw


def test_generator_captures_through_the_accelerator() -> None:
    """The loop's recorded attention and K/V are the same whichever engine ran the steps."""
    m = make_llama("gqa", seed=12)
    cap = Capture(attention=True, kv_norms=True, kv_layer=1)
    fast = kvviz.generate(m, prompt=[1, 2, 3, 4], max_new_tokens=5, capture=cap)
    slow = kvviz.generate(m, prompt=[1, 2, 3, 4], max_new_tokens=5, capture=cap, backend="readable")
    for a, b in zip(fast.events, slow.events):
        for field in ("attn", "kv_norms", "kv_values"):
            x, y = getattr(a, field), getattr(b, field)
            assert x is not None and x.shape == y.shape
            assert abs(x.astype("float64") - y.astype("float64")).max() < 2e-3, field  # float16 records


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_longer_fp32_forwards_go_to_pytorch(threads: int, paths: list[str]) -> None:
    """Up to max_c_rows_fp32(threads) rows (batch x tokens) go through C; more through MKL's GEMM."""
    if not HAVE_C:
        pytest.skip(f"no C row ops here: {rowops.status()}")
    m = make_llama("gqa", seed=13)
    assert m.fast.plan().rows.max_rows == max_c_rows_fp32(threads) == (8 if threads == 1 else 32)
    n = max_c_rows_fp32(threads) // 2
    idx = tokens(2, n + 1, seed=14)
    with torch.inference_mode():
        m.fast.forward(idx[:, :n], torch.arange(n), None)  # 2 x n rows: C
        m.fast.forward(idx, torch.arange(n + 1), None)  # 2 x (n + 1): PyTorch
    assert paths == ["rows", "torch"]


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("kind", ["gqa", "untied"])
@pytest.mark.parametrize("batch", [1, 2])
def test_bf16_weights_through_c_stay_close_to_float64(kind: str, threads: int, batch: int, paths: list[str]) -> None:
    """bf16 weights widened in C, fp32 activations, K/V stored in the bf16 cache, logits rounded
    to bf16: within 1% of the logits' range of a float64 run of the same bf16 weights, and at
    least as close as the readable model's all-bf16 arithmetic."""
    if not HAVE_C:
        pytest.skip(f"no C row ops here: {rowops.status()}")
    m = make_llama(kind, seed=15, dtype=torch.bfloat16)
    rows = m.fast.plan().rows
    assert rows is not None and rows.widen and rows.max_rows > 1000
    idx = tokens(batch, 16, seed=16)
    ref = reference(m, idx)
    cache = StaticKVCache(m.config, batch=batch, dtype=m.dtype)
    with torch.inference_mode():
        pre = m.fast.forward(idx[:, :6], torch.arange(6), cache)  # a prefill through C's rows
        cache.advance(6)
        steps = []
        for t in range(6, 16):
            steps.append(m.fast.forward(idx[:, t:t + 1], torch.tensor([t]), cache))
            cache.advance(1)
        slow = m.model(idx)
    got = torch.cat([pre, *steps], dim=1)
    assert paths == ["rows"] + ["one" if batch == 1 else "rows"] * 10
    assert got.dtype == torch.bfloat16 and cache.k[0].dtype == torch.bfloat16
    scale = float(ref.abs().max())
    err, err_readable = float((got.double() - ref).abs().max()), float((slow.double() - ref).abs().max())
    assert err < 0.01 * scale, (err, scale)
    assert err <= err_readable, (err, err_readable)


@pytest.mark.skipif(not HAVE_C, reason="needs the C row ops")
@pytest.mark.parametrize("threads", [2], indirect=True)
def test_plan_reads_the_weights_in_place_and_follows_the_thread_count(threads: int) -> None:
    m = make_llama("gqa", seed=17)
    model, plan = m.model, m.fast.plan()
    assert plan.threads == 2 and plan.rows is not None and not plan.rows.widen
    block, ops = model.model.layers[0], plan.rows.layers[0]
    attn = block.self_attn
    # No copies: the C side points at the parameters themselves, the tied head at the embedding.
    assert list(ops.attn_in.spec.w) == [attn.q_proj.weight.data_ptr(), attn.k_proj.weight.data_ptr(),
                                        attn.v_proj.weight.data_ptr()]
    assert ops.attn_in.spec.norm_w == block.input_layernorm.weight.data_ptr()
    assert ops.attn_in.spec.cos == model.rope_cos.data_ptr() and ops.attn_in.spec.rope_dims == (8 + 2) * 8
    assert ops.mlp_in.spec.swiglu == 1 and ops.mlp_in.spec.w[1] == block.mlp.up_proj.weight.data_ptr()
    assert plan.rows.head.spec.w[0] == model.model.embed_tokens.weight.data_ptr()
    assert {op.threads for lo in plan.rows.layers for op in (lo.attn_in, lo.attn_out, lo.mlp_in, lo.mlp_out)} == {2}
    torch.set_num_threads(1)
    one = m.fast.plan()
    assert one is not plan and one.threads == 1 and one.rows is not None and one.rows.head.threads == 1
    torch.set_num_threads(2)
    assert m.fast.plan() is plan  # one plan kept per thread count
    with torch.no_grad():  # an in-place load is seen without a rebuild
        block.mlp.down_proj.weight.mul_(0.5)
        block.input_layernorm.weight.add_(0.1)
    idx = tokens(1, 6, seed=18)
    torch.testing.assert_close(decode_all(m, idx).double(), reference(m, idx), atol=2e-5, rtol=1e-5)


def test_fp16_and_a_missing_kernel_keep_pytorch_ops() -> None:
    """The C side takes fp32 and bf16 weights; fp16 runs the PyTorch ops in fp16."""
    m = make_llama("mqa", seed=19, dtype=torch.float16)
    assert m.fast.plan().rows is None
    idx = tokens(1, 8, seed=20)
    got = decode_all(m, idx).double()
    ref = reference(m, idx)
    assert float((got - ref).abs().max()) < 0.02 * float(ref.abs().max())


def test_positions_past_the_tables_are_refused() -> None:
    m = make_llama("mha", seed=21)
    with torch.inference_mode(), pytest.raises((IndexError, ValueError)):
        m.fast.forward(torch.tensor([[1]]), torch.tensor([BASE["block_size"]]), StaticKVCache(m.config))


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_concurrent_streams_on_one_model_match_sequential_runs(threads: int, kernel: str) -> None:
    """The app's sessions share one model from several threads: the plan and the calls into C
    (an OpenMP team per calling thread) hold no per-run state."""
    m = make_llama("gqa", seed=22)
    assert_concurrent_runs_match_sequential(m, [[1, 2, 3], [100, 50, 25, 12], [7] * 9, [42, 43]], 24)
    assert (m.fast.plan().rows is not None) == (kernel == "c")
