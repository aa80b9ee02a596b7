"""Quantized and windowed KV caches: hand-checked quantization, exact bytes (equal to the
calculator's at every step), the ring buffer, StreamingLLM's positions, teacher forcing through
the cache, and the messages bad combinations get."""
from __future__ import annotations

import math

import pytest
import torch

from kvviz.engine.api import generate, iter_generate
from kvviz.engine.generation.request import kv_spec
from kvviz.engine.kvcache.compressed_caches import QuantizedKVCache, WindowKVCache
from kvviz.engine.kvcache.kv_quant import (dequantize_fp8, dequantize_int, fp8_scale, pack_int4, quantize_fp8, quantize_int,
                                  unpack_int4)
from kvviz.engine.generation.kv_spec import KVSpec, resolve
from kvviz.errors import KVVizError
from kvviz.measure.kvcompare import compare, nll_through_cache, plain_nll
from kvviz.calculator.compressed import CacheShape, Compression, cache_bytes
from kvviz import CacheSpec
from keyword_sets import request_kwargs

PROMPT = list(b"To be, or not")


# ----------------------------------------------------------------------------- by hand
def test_int4_symmetric_by_hand() -> None:
    x = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    qt = quantize_int(x, "int4", group=4)
    s = float(torch.tensor(2.0 / 7).half())  # amax / 7, rounded to fp16 first: 0.28564453125
    assert qt.scale.dtype == torch.float16 and float(qt.scale) == s == 0.28564453125
    # q = round(x / s) = [7, -4, 2, 0]; stored as q + 8 = [15, 4, 10, 8], two per byte, low nibble first
    assert qt.payload.tolist() == [[15 | 4 << 4, 10 | 8 << 4]]
    assert dequantize_int(qt, "int4", 4).tolist() == [[7 * s, -4 * s, 2 * s, 0.0]]


def test_int4_asymmetric_by_hand() -> None:
    x = torch.tensor([[0.0, 1.5, 3.0, 0.75]])
    qt = quantize_int(x, "int4", group=4, zero_point=True)
    s = float(torch.tensor(3.0 / 15).half())  # (max - min) / 15 = 0.199951171875
    assert float(qt.zero) == 0.0 and float(qt.scale) == s
    # q = round((x - 0) / s) = [0, 8, 15 (15.004 clamped), 4]
    assert unpack_int4(qt.payload).tolist() == [[0, 8, 15, 4]]
    assert torch.allclose(dequantize_int(qt, "int4", 4), torch.tensor([[0.0, 8 * s, 15 * s, 4 * s]]))


def test_int8_by_hand_and_pack_roundtrip() -> None:
    x = torch.tensor([[1.27, -0.635, 0.01, 0.0]])
    qt = quantize_int(x, "int8", group=4)
    s = float(torch.tensor(1.27 / 127).half())
    assert float(qt.scale) == s
    assert qt.payload.dtype == torch.int8 and qt.payload.tolist() == [[round(1.27 / s), round(-0.635 / s), 1, 0]]
    q = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("dtype,zp", [("int8", False), ("int8", True), ("int4", False), ("int4", True)])
@pytest.mark.parametrize("group", [8, 32])
def test_int_error_is_within_half_a_step(dtype: str, zp: bool, group: int) -> None:
    x = torch.randn(2, 3, 5, 32, generator=torch.Generator().manual_seed(1)) * 3
    x[..., 7] *= 20  # an outlier channel, as keys have
    qt = quantize_int(x, dtype, group, zp)
    err = (dequantize_int(qt, dtype, group) - x).abs().reshape(2, 3, 5, 32 // group, group).amax(-1)
    g = x.reshape(2, 3, 5, 32 // group, group)
    # half a quantization step, plus the fp16 rounding of the scale and zero point (2^-11 relative)
    bound = qt.scale.float() / 2 + g.abs().amax(-1) * 2.0**-10
    assert (err <= bound).all()
    assert (err > 0).any()  # not vacuous: rounding did lose something


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_relative_error(per_head: bool) -> None:
    x = torch.randn(1, 3, 6, 16, generator=torch.Generator().manual_seed(2))
    s = fp8_scale(x, per_head)
    assert s.shape == ((3,) if per_head else ())
    d = dequantize_fp8(quantize_fp8(x, s), s)
    sb = s.view(1, -1, 1, 1) if per_head else s
    # e4m3: 3 mantissa bits (half a step = 2^-4 relative); below 2^-6 the subnormal step is 2^-9
    assert ((d - x).abs() <= x.abs() * 2.0**-4 + sb * 2.0**-10).all()
    assert float(x.abs().max()) == pytest.approx(float((d.abs() / sb).max() * sb.max()), rel=0.07)


# ----------------------------------------------------------------------------- bytes
SPECS = [dict(kv_dtype="int8"), dict(kv_dtype="int4"), dict(kv_dtype="int4", kv_group_size=4, kv_zero_point=True),
         dict(kv_dtype="int8", kv_group_size=2, kv_zero_point=True), dict(kv_dtype="fp8"),
         dict(kv_dtype="fp8", kv_fp8_scale="head"), dict(window=8), dict(window=6, sinks=2),
         dict(kv_dtype="int4", window=6, sinks=2)]


@pytest.mark.parametrize("opts", SPECS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_bytes_equal_formula_and_calculator_every_step(make_llama, opts: dict) -> None:
    m = make_llama()
    c = m.config
    run = generate(m, **request_kwargs(prompt_ids=PROMPT, max_new_tokens=12, **opts))
    hs = c.head_dim
    comp = Compression(opts.get("kv_dtype"), opts.get("kv_group_size"), opts.get("kv_zero_point", False),
                       opts.get("kv_fp8_scale", "tensor"), opts.get("window"), opts.get("sinks", 0))
    shape = CacheShape(c.n_layer, c.kv_heads, hs, 4)
    # By hand, per layer, KV head and position, K and V each:
    dt, g = comp.kv_dtype, comp.group_size or hs
    vec = {None: 4 * hs, "int8": hs, "int4": hs // 2, "fp8": hs}[dt]
    if dt in ("int8", "int4"):
        vec += (hs // g) * 2 * (2 if comp.zero_point else 1)  # fp16 scales (and zero points)
    fixed = 2 * c.n_layer * (c.kv_heads if comp.fp8_scale == "head" else 1) * 4 if dt == "fp8" else 0
    for e in run.events:
        t = len(PROMPT) + e.step  # tokens written after the step: the prompt, then one per decode
        held = t if comp.window is None else min(t, comp.window + comp.sinks)
        assert e.cache_len == held
        assert e.cache_bytes_used == held * 2 * c.n_layer * c.kv_heads * vec + fixed
        assert e.cache_bytes_used == cache_bytes(shape, comp, t)
    assert run.cache_kind == kv_spec(m, opts.get("kv_dtype"), opts.get("window"), opts.get("sinks", 0),
                                     opts.get("kv_group_size"), opts.get("kv_zero_point", False),
                                     opts.get("kv_fp8_scale", "tensor")).label()


# ----------------------------------------------------------------------------- windows
def test_window_at_least_the_sequence_equals_the_full_cache(make_llama) -> None:
    m = make_llama()
    # The concat cache: the same per-layer attention path as the window caches (a static fp32 cache
    # decodes through the whole-step C call instead, equal to ~1e-7, not bit for bit).
    full = generate(m, prompt=PROMPT, max_new_tokens=30, cache=CacheSpec(kind="concat"))
    for opts in (dict(window=64), dict(window=43), dict(window=50, sinks=4)):
        run = generate(m, **request_kwargs(prompt_ids=PROMPT, max_new_tokens=30, **opts))
        assert run.generated_ids == full.generated_ids
        for a, b in zip(full.events, run.events):
            assert [t.prob for t in a.top] == [t.prob for t in b.top]  # bit for bit


@pytest.mark.parametrize("sinks,window", [(0, 3), (0, 5), (2, 3), (1, 8), (4, 7)])
def test_ring_wraps(make_llama, sinks: int, window: int) -> None:
    m = make_llama()
    c = m.config
    spec = resolve(KVSpec(window=window, sinks=sinks, positions="original"), "llama", c.head_dim, c.block_size)
    cache = WindowKVCache(c, spec)
    for p in range(23):
        # row p carries its position in every value, so what is held says which positions it is
        k = torch.full((1, c.kv_heads, 1, c.head_dim), float(p))
        ks, vs = cache.update(0, k, -k)
        cache.advance(1)
        kept = list(range(min(p + 1, sinks))) + list(range(max(sinks, p + 1 - window), p + 1))
        assert sorted(ks[0, 0, :, 0].tolist()) == kept  # exactly the sinks and the last W positions
        assert (vs == -ks).all()
        assert cache.held == len(kept) == min(p + 1, sinks + window)
        assert sorted(cache.slot_positions()) == kept
        # the newest row went to the slot the ring formula names, overwriting the oldest window row
        assert ks[0, 0, cache.slot_of(p), 0] == p
    assert cache.bytes_used == (sinks + window) * cache.bytes_per_token


def test_sinks_plus_window_hold_exactly_s_plus_w(make_llama) -> None:
    m = make_llama()
    run = generate(m, prompt=PROMPT * 2, max_new_tokens=20, cache=CacheSpec(window=8, sinks=4))  # prompt 26 > 12: fed in pieces
    assert [e.cache_len for e in run.events] == [12] * 20
    assert len(set(e.cache_bytes_used for e in run.events)) == 1  # flat once full


def test_streaming_positions_rotate_the_sinks(make_llama) -> None:
    """positions='cache': the sink keys read back equal keys computed afresh at position j + evicted
    (layer 0, where K depends only on the token and its position)."""
    m = make_llama()
    net, c = m.model, m.config
    ids = PROMPT * 2
    spec = resolve(KVSpec(window=6, sinks=2), "llama", c.head_dim, c.block_size)
    cache = WindowKVCache(c, spec)
    from kvviz.engine.generation.capture import ForwardCapture
    with torch.inference_mode():
        for p, t in enumerate(ids):
            fc = ForwardCapture(frozenset({0}))
            net(torch.tensor([[t]]), torch.tensor([p]), cache, fc)
            cache.advance(1)
        e = cache.evicted
        assert e == len(ids) - 8
        attn = net.model.layers[0].self_attn
        x = net.model.layers[0].input_layernorm(net.model.embed_tokens(torch.tensor([ids[:2]])))  # (1, 2, C)
        k = attn.k_proj(x).view(1, 2, c.kv_heads, c.head_dim).transpose(1, 2)
        pos = torch.tensor([e, e + 1])
        from kvviz.engine.models.llama import apply_rope
        want = apply_rope(k, net.rope_cos[pos], net.rope_sin[pos])
        got = fc.k[0][:, :, :2]
        assert torch.allclose(got, want, atol=1e-5)
        assert not torch.allclose(got, cache.store.read(0, 2)[0], atol=1e-3)  # stored rows stay at 0, 1


def test_gpt2_window_keeps_original_positions(make_model) -> None:
    m = make_model()
    run = generate(m, prompt=PROMPT, max_new_tokens=20, cache=CacheSpec(window=8))
    assert run.cache_kind == "window 8 (original positions)" and run.events[-1].cache_len == 8
    with pytest.raises(KVVizError, match="learned position embedding"):
        kv_spec(m, window=8, sinks=2, positions="cache")


# ----------------------------------------------------------------------------- teacher forcing
def test_teacher_forced_full_cache_equals_plain_forward(make_llama) -> None:
    m = make_llama()
    ids = list(b"Whether 'tis nobler in the mind to suffer the slings")
    plain = plain_nll(m, ids)
    for chunk in (1, 7, 64):
        nll, _ = nll_through_cache(m, ids, None, chunk=chunk)
        assert math.exp(sum(nll) / len(nll)) == pytest.approx(math.exp(sum(plain) / len(plain)), rel=1e-5)
        assert max(abs(a - b) for a, b in zip(nll, plain)) < 1e-3


def test_compare_measures_int8_less_than_int4(make_llama) -> None:
    m = make_llama()
    ids = list(b"Whether 'tis nobler in the mind to suffer")
    s8 = compare(m, ids, kv_spec(m, "int8", track_errors=True), chunk=1, attention=True).summary()
    s4 = compare(m, ids, kv_spec(m, "int4", track_errors=True), chunk=1, attention=True).summary()
    assert 0 < s8["mean_logit_kl"] < s4["mean_logit_kl"]
    assert 0 < s8["attention_kl_mean"] < s4["attention_kl_mean"]
    assert 0 < s8["kv_error"]["k_max_abs_error"] < s4["kv_error"]["k_max_abs_error"]
    assert s8["cache_bytes"] < s8["full_cache_bytes"]


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("opts,msg", [
    (dict(kv_dtype="int4", kv_group_size=3), "divide the head dimension"),
    (dict(kv_dtype="int4", kv_group_size=1), "must be even"),
    (dict(kv_dtype="int2"), "kv_dtype must be one of"),
    (dict(window=65), "larger than the model's context"),
    (dict(window=8, sinks=8), "must be fewer than the window"),
    (dict(sinks=4), "sinks need a window"),
    (dict(window=0), "window must be an integer from 1"),
])
def test_bad_combinations(make_llama, opts: dict, msg: str) -> None:
    with pytest.raises(KVVizError, match=msg):
        iter_generate(make_llama(), **request_kwargs(prompt_ids=PROMPT, max_new_tokens=4, **opts))


def test_compressed_needs_the_static_cache(make_llama) -> None:
    m = make_llama()
    with pytest.raises(KVVizError, match="needs the KV cache on"):
        iter_generate(m, prompt=PROMPT, max_new_tokens=4, cache=CacheSpec(kv_dtype="int8", use_cache=False))
    with pytest.raises(KVVizError, match="does not combine"):
        iter_generate(m, prompt=PROMPT, max_new_tokens=4, cache=CacheSpec(kv_dtype="int8", kind="paged"))


def test_quantized_cache_truncates_like_one_that_never_saw_the_rest(make_llama) -> None:
    c = make_llama().config
    spec = KVSpec(kv_dtype="int4", zero_point=True)
    a, b = QuantizedKVCache(c, spec), QuantizedKVCache(c, spec)
    x = torch.randn(1, c.kv_heads, 9, c.head_dim, generator=torch.Generator().manual_seed(0))
    a.update(0, x, x)
    a.advance(9)
    a.truncate(4)
    b.update(0, x[:, :, :4], x[:, :, :4])
    b.advance(4)
    assert torch.equal(a.layer(0)[0], b.layer(0)[0])
    assert all(torch.equal(s, t) for s, t in zip(a.store.payload["k"], b.store.payload["k"]))


# ----------------------------------------------------------------------------- CLI
def test_cli_generate_reports_cache_bytes_and_error(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvviz.cli.main import main
    from kvviz.engine.loading.loader import RANDOM_SHAPES

    assert main(["generate", "--model", "random:tiny", "--prompt-ids", "104,105,106", "--max-new-tokens", "9",
                 "--kv-dtype", "int4", "--kv-zero-point", "--window", "5", "--sinks", "2", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    c = RANDOM_SHAPES["tiny"]
    per_pos = 2 * c.n_layer * c.kv_heads * (c.head_dim // 2 + 2 * 2)  # packed int4 + fp16 scale + zero point
    assert [s["cache_len"] for s in obj["steps"]] == [3, 4, 5, 6, 7, 7, 7, 7, 7]
    assert [s["cache_bytes"] for s in obj["steps"]] == [n * per_pos for n in [3, 4, 5, 6, 7, 7, 7, 7, 7]]
    cache = obj["cache"]
    assert cache["kind"] == "int4 zp, window 5 + 2 sinks (original positions)"
    assert cache["bytes"] == 7 * per_pos and cache["positions_held"] == 7
    assert cache["full_precision_bytes"] == 11 * 2 * c.n_layer * c.kv_heads * c.head_dim * 4
    assert 0 < cache["kv_error"]["k_mean_abs_error"] <= cache["kv_error"]["k_max_abs_error"]


def test_cli_eval_through_the_cache(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from kvviz.cli.main import main

    f = tmp_path / "t.txt"
    f.write_text("Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune" * 2)
    assert main(["eval", "--model", "random:tiny", "--text-file", str(f), "--kv-dtype", "int8", "--max-tokens", "60",
                 "--chunk", "1", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["kv"] == "int8" and s["tokens_scored"] == 59
    assert s["perplexity"] > 1 and abs(s["perplexity"] / s["perplexity_full"] - 1) < 0.05
    assert 0 <= s["top1_agreement"] <= 1 and s["attention_kl_mean"] > 0


@pytest.mark.parametrize("extra,needle", [
    (["--kv-dtype", "int4", "--kv-group-size", "3"], "must divide the head dimension"),
    (["--window", "4", "--sinks", "4"], "must be fewer than the window"),
    (["--window", "5000"], "larger than the model's context"),
    (["--window", "8", "--sinks", "2", "--kv-positions", "cache"], "learned position embedding"),
])
def test_cli_bad_combinations(capsys: pytest.CaptureFixture[str], extra: list[str], needle: str) -> None:
    from kvviz.cli.main import main

    with pytest.raises(SystemExit) as ex:
        main(["generate", "--model", "random:tiny", "--prompt", "hi", *extra])
    assert ex.value.code == 2 and needle in capsys.readouterr().err


# ----------------------------------------------------------------------------- charts
def test_charts_draw_what_the_cache_holds(make_llama) -> None:
    from kvviz.charts import compress_charts as cc

    c = make_llama().config
    sinks, window = 2, 5
    spec = resolve(KVSpec(window=window, sinks=sinks, positions="original"), "llama", c.head_dim, c.block_size)
    cache = WindowKVCache(c, spec)
    x = torch.zeros(1, c.kv_heads, 1, c.head_dim)
    for n in range(1, 19):
        cache.update(0, x, x)
        cache.advance(1)
        ring = cc.ring_slots(sinks, window, n).data[0]
        assert [int(t) for t in ring.text] == cache.slot_positions()  # the ring chart's labels are the cache's own slots
        kept = [p for p in range(n) if cc.window_state(p, n, sinks, window) != "evicted"]
        assert kept == sorted(cache.slot_positions())
    nb = cc.window_notebook(sinks, window, 3, 10)
    by_name = {t.name.split(" ")[0]: t for t in nb.data}
    assert len(by_name["evicted"].x) == sum(max(0, 3 + s - sinks - window) for s in range(10))
    fig = cc.token_comparison([("a", [1, 2, 3, 4], list("wxyz")), ("b", [1, 2, 9, 4], list("wxqz"))])
    assert list(fig.data[1].marker.color) == [cc.SAME, cc.SAME, cc.DIFF, cc.DIFF]
    assert cc.first_divergence([1, 2, 3], [1, 2, 3, 4]) is None


@pytest.mark.parametrize("opts", [dict(kv_dtype="int8"), dict(kv_dtype="fp8", kv_fp8_scale="head"),
                                  dict(window=8, sinks=2), dict(kv_dtype="int4", window=8, sinks=2)])
def test_accelerator_and_readable_model_agree_through_compressed_caches(make_llama, opts: dict) -> None:
    m = make_llama()
    fast = generate(m, **request_kwargs(prompt_ids=PROMPT, max_new_tokens=20, fast=True, **opts))
    slow = generate(m, **request_kwargs(prompt_ids=PROMPT, max_new_tokens=20, fast=False, **opts))
    assert fast.engine == "fast" and slow.engine == "readable"  # the accelerator only calls cache.update
    assert fast.generated_ids == slow.generated_ids
    for a, b in zip(fast.events, slow.events):
        assert [t.prob for t in a.top] == pytest.approx([t.prob for t in b.top], abs=1e-4)


def test_position_rule_changes_what_the_model_sees_only_after_eviction(make_llama) -> None:
    m = make_llama()
    runs = {p: generate(m, prompt=PROMPT, max_new_tokens=30, cache=CacheSpec(window=8, sinks=2, positions=p))
            for p in ("cache", "original")}
    a, b = runs["cache"].events, runs["original"].events
    # the prompt (13 tokens) already overflows 2 + 8 slots, so even the prefill's last token differs
    probs = [([t.prob for t in x.top], [t.prob for t in y.top]) for x, y in zip(a, b)]
    assert any(pa != pytest.approx(pb, abs=1e-6) for pa, pb in probs)
    short = {p: generate(m, prompt=PROMPT[:4], max_new_tokens=6, cache=CacheSpec(window=8, sinks=2, positions=p))
             for p in ("cache", "original")}  # 4 + 6 = 10 positions: nothing evicted, nothing to renumber
    assert [e.top for e in short["cache"].events] == [e.top for e in short["original"].events]


def test_error_log_per_step_by_hand() -> None:
    """Two layers of 2 KV heads, a prefill at 0 and a step at 3: each write's max over layers and
    heads, and its mean over every (layer, head) pair."""
    from kvviz.engine.kvcache.slot_store import ErrorLog

    log = ErrorLog()
    log.rows = [(0, 0, [0.1, 0.4], [0.01, 0.03], [0.2, 0.1], [0.02, 0.02]),
                (0, 1, [0.3, 0.2], [0.02, 0.04], [0.5, 0.1], [0.04, 0.00]),
                (3, 0, [0.05, 0.06], [0.01, 0.01], [0.07, 0.02], [0.01, 0.03])]
    got = log.per_step()
    assert [g[0] for g in got] == [0, 3]
    assert got[0][1:] == pytest.approx((0.4, 0.025, 0.5, 0.02))
    assert got[1][1:] == pytest.approx((0.06, 0.01, 0.07, 0.02))


def test_error_log_of_a_real_int8_run(make_llama) -> None:
    m = make_llama()
    cache = QuantizedKVCache(m.config, KVSpec(kv_dtype="int8", track_errors=True))
    k = torch.randn(1, m.config.kv_heads, 4, m.config.head_dim, generator=torch.Generator().manual_seed(0))
    for i in range(m.config.n_layer):
        cache.update(i, k, 2 * k)
    cache.advance(4)
    (pos, kmax, kmean, vmax, vmean), = cache.errors.per_step()
    # symmetric int8, one fp16 scale per head vector: the error is at most half a step, absmax / 127 / 2;
    # V = 2K doubles every scale (exactly, in fp16) and so every error
    step = k.abs().amax(dim=-1) / 127
    assert pos == 0 and 0 < kmean <= kmax <= float(step.max()) / 2 * 1.001
    assert vmax == pytest.approx(2 * kmax, rel=1e-3) and vmean == pytest.approx(2 * kmean, rel=1e-3)


def test_a_reset_fp8_cache_takes_its_scale_from_the_next_sequence(make_llama) -> None:
    c = make_llama().config
    cache = QuantizedKVCache(c, KVSpec(kv_dtype="fp8", track_errors=True))
    big = torch.full((1, c.kv_heads, 3, c.head_dim), 100.0)
    small = torch.full((1, c.kv_heads, 3, c.head_dim), 0.5)
    cache.update(0, big, big)
    cache.advance(3)
    cache.reset()
    assert cache.errors is not None and cache.errors.rows == []
    k, _ = cache.update(0, small, small)
    assert float(cache.store.scale["k"][0]) == pytest.approx(0.5 / 448)  # not 100 / 448 from before
    assert torch.equal(k, small)
