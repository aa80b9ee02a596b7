"""The accelerator (kvviz.fast.gpt2_flat) against the float64 reference and the readable model."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import kvviz.fast.gpt2_flat
from kvviz.engine.kvcache.dense import ConcatKVCache, StaticKVCache
from kvviz.engine.generation.capture import ForwardCapture
from kvviz.engine.loading.loader import LoadedModel
from kvviz.fast import rowops
from kvviz.fast.gpt2_flat import build_plan
from accel_checks import assert_concurrent_runs_match_sequential, decode_all
from test_model import KV_HEADS, reference_forward

HAVE_C = rowops.load() is not None


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the forwards that took the flat decode step."""
    calls: list[int] = []
    real = kvviz.fast.gpt2_flat.decode_step
    monkeypatch.setattr(kvviz.fast.gpt2_flat, "decode_step", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.fixture(params=["c", "torch"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with the C row ops ("c", skipped where they cannot be built) and without
    them ("torch": the fallback a machine without a C compiler takes)."""
    if request.param == "c" and not HAVE_C:
        pytest.skip(f"no C row ops here: {rowops.status()}")
    if request.param == "torch":
        monkeypatch.setattr(kvviz.fast.gpt2_flat, "row_linear", lambda *a, **k: None)
    return request.param


def _biased(m: LoadedModel, seed: int) -> LoadedModel:
    """Non-zero biases and LayerNorm parameters (the GPT-2 init makes them 0 and 1, which would
    leave the fused bias and LayerNorm untested), then rebuild the accelerator's plans."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    m.fast.rebuild()
    return m


@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize("kind", list(KV_HEADS))
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("cache_cls", [StaticKVCache, ConcatKVCache])
def test_token_by_token_decode_matches_float64_reference(
    make_model: Callable[..., LoadedModel], threads: int, kind: str, batch: int, cache_cls: type,
    spy: list[int], kernel: str,
) -> None:
    """Every position decoded alone (the first one into an empty cache) equals the reference.

    Batch 1 takes the C row ops where they are built ("c"); batch 2, and every batch without
    them ("torch"), the PyTorch ops: all of them through the flat step. Three threads share
    tiles unevenly in C and leave row_matmul's splits off (SMALL's widths are even).
    """
    m = _biased(make_model(n_kv_head=KV_HEADS[kind], seed=7), 7)
    assert (m.fast.plan().rows is not None) == (kernel == "c")
    idx = torch.randint(0, 256, (batch, 20), generator=torch.Generator().manual_seed(8))
    got = decode_all(m, idx, cache_cls)
    assert len(spy) == 20  # the flat decode step ran for every token
    ref, _, _ = reference_forward(m.model, idx)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("bias", [True, False])
def test_flat_step_equals_module_path(make_model: Callable[..., LoadedModel], bias: bool, threads: int,
                                      spy: list[int], kernel: str) -> None:
    """Same cache state, same token: the accelerator's flat step and the readable model agree."""
    m = make_model(bias=bias, seed=3, vocab_size=101)  # an odd vocabulary: the head copy is padded
    m = _biased(m, 3) if bias else m
    assert m.fast is not None and (m.fast.plan().rows is not None) == (kernel == "c")
    idx = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = StaticKVCache(m.config)
    with torch.inference_mode():
        m.model(idx[:, :11], cache=cache)
        cache.advance(11)
        flat = m.fast.forward(idx[:, 11:], torch.tensor([11]), cache=cache)  # (1, 1, 101)
        assert len(spy) == 1 and flat.shape == (1, 1, 101)
        modules = m.model(idx[:, 11:], cache=cache)  # the readable model
    assert len(spy) == 1
    torch.testing.assert_close(flat, modules, atol=1e-5, rtol=1e-5)


def test_captures_from_the_flat_step_are_the_cache_contents(make_model: Callable[..., LoadedModel]) -> None:
    m = make_model(n_kv_head=2, seed=5)
    idx = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(6))
    cache = StaticKVCache(m.config)
    with torch.inference_mode():
        m.model(idx[:, :8], cache=cache)
        cache.advance(8)
        fc = ForwardCapture(frozenset({1}))
        m.fast.forward(idx[:, 8:], torch.tensor([8]), cache=cache, capture=fc)
    k, v = cache.k[1][:, :, :9], cache.v[1][:, :, :9]
    assert set(fc.k) == {1} and torch.equal(fc.k[1], k) and torch.equal(fc.v[1], v)
    assert fc.q_last[1].shape == (1, m.config.n_head, 1, m.config.head_dim)
    _, _, kvs = reference_forward(m.model, idx)
    torch.testing.assert_close(k.double(), kvs[1][0], atol=1e-5, rtol=1e-5)  # (1, nkv, 9, hs)


def test_half_precision_decode_stays_close(make_model: Callable[..., LoadedModel]) -> None:
    m = make_model(seed=2, dtype=torch.bfloat16)
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    got = decode_all(m, idx, StaticKVCache)
    ref, _, _ = reference_forward(m.model, idx)
    assert float((got.double() - ref).abs().max()) < 0.05 * float(ref.abs().max())


@pytest.mark.skipif(not HAVE_C, reason="needs the C row ops")
@pytest.mark.parametrize("threads", [2], indirect=True)
def test_plan_reads_the_weights_in_place_and_follows_the_thread_count(make_model: Callable[..., LoadedModel],
                                                                     threads: int) -> None:
    m = make_model(seed=1)
    gpt = m.model
    plan = m.fast.plan()
    assert plan.threads == 2 and plan.rows is not None
    block, ops = gpt.transformer.h[0], plan.rows.layers[0]
    # No copies: the C side points at the parameters themselves (and at the padded LM head).
    assert ops.attn_in.spec.w == block.attn.c_attn.weight.data_ptr()
    assert ops.attn_in.spec.ln_w == block.ln_1.weight.data_ptr() and ops.attn_in.spec.gelu == 0
    assert ops.mlp_in.spec.ln_w == block.ln_2.weight.data_ptr() and ops.mlp_in.spec.gelu == 1
    assert ops.attn_out.spec.ln_w is None and ops.mlp_out.spec.bias == block.mlp.c_proj.bias.data_ptr()
    assert plan.rows.head.spec.w == plan.head.w.data_ptr()  # the padded, transposed LM head copy
    assert plan.layers[0].c_fc.w.data_ptr() == block.mlp.c_fc.weight.data_ptr()
    assert {op.threads for lo in plan.rows.layers for op in (lo.attn_in, lo.attn_out, lo.mlp_in, lo.mlp_out)} == {2}
    torch.set_num_threads(1)
    one = m.fast.plan()
    assert one is not plan and one.threads == 1 and one.rows is not None
    assert one.rows.layers[0].mlp_in.threads == 1  # rebuilt for the new count
    assert build_plan(gpt, 3).rows.head.threads == 3
    torch.set_num_threads(2)
    assert m.fast.plan() is plan  # one plan kept per thread count


def test_half_precision_and_batches_keep_pytorch_ops(make_model: Callable[..., LoadedModel],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The C side is fp32-only: a bf16 model's plan has no row ops, and a batch never uses them."""
    assert make_model(seed=2, dtype=torch.bfloat16).fast.plan().rows is None
    calls: list[int] = []
    real = rowops.RowLinear.__call__
    monkeypatch.setattr(rowops.RowLinear, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    m = make_model(seed=2)
    idx = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(2))
    decode_all(m, idx, StaticKVCache)  # batch 2: PyTorch ops
    assert not calls
    decode_all(m, idx[:1], StaticKVCache)  # batch 1: through C where it is built
    assert len(calls) == (4 * (4 * m.config.n_layer + 1) if HAVE_C else 0)


def test_the_readable_model_and_fast_false_never_take_the_flat_step(make_model: Callable[..., LoadedModel],
                                                                   spy: list[int]) -> None:
    """The model has no performance branch: only the accelerator, and only when asked, runs it."""
    import kvviz

    m = make_model(seed=6)
    with torch.inference_mode():
        m.model(torch.tensor([[3]]), cache=StaticKVCache(m.config))
    assert not spy
    slow = kvviz.generate(m, prompt=[1, 2, 3], max_new_tokens=6, backend="readable")
    assert not spy and slow.engine == "readable"
    fast = kvviz.generate(m, prompt=[1, 2, 3], max_new_tokens=6)
    assert len(spy) == 5 and fast.engine == "fast"  # the 5 decode steps after the prefill
    assert fast.generated_ids == slow.generated_ids


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_weights_changed_in_place_without_freeze_are_picked_up(make_model: Callable[..., LoadedModel],
                                                               threads: int, kernel: str) -> None:
    """The plan reads the parameters in place: an in-place load (no new freeze()) shows at once."""
    m = make_model(seed=9)
    idx = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(9))
    before = m.fast.plan()
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():  # what load_state_dict does: copy_ into the existing parameters
        for name, p in m.model.named_parameters():
            if name.endswith("bias") or ".ln_" in name or "c_fc" in name:
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=g))
    got = decode_all(m, idx, StaticKVCache)
    assert m.fast.plan() is before  # nothing to rebuild
    ref, _, _ = reference_forward(m.model, idx)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_concurrent_streams_on_one_model_match_sequential_runs(random_models: dict[str, LoadedModel],
                                                               threads: int, kernel: str) -> None:
    """The app runs each browser session in its own thread over the one cached model: the C row
    ops (an OpenMP team per calling thread) and the plan must hold no per-run state."""
    m = random_models["tiny"]
    m.fast.rebuild()  # plans rebuilt for this test's kernel and thread count
    assert_concurrent_runs_match_sequential(m, [[1, 2, 3], [200, 100, 50, 25], [7] * 9, [42, 43]], 40)
    assert (m.fast.plan().rows is not None) == (kernel == "c")
    m.fast.rebuild()  # leave the session model to rebuild its own plans
