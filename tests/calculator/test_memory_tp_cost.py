"""The calculator's tensor parallelism and the cost per token, worked by hand."""
from __future__ import annotations

import pytest

from kvviz.calculator import (
    GIB, CalcError, MemoryRequest, batch_steps, calculate, cost_curve, decode_cost, load_gpus, load_presets,
    parse_config, request_cost, summary_text,
)

PRESETS = load_presets()
LLAMA3 = PRESETS["llama-3-8b"]  # 32 heads, 8 KV heads, head_dim 128, 32 layers
GIB_KV = 8192 * 131_072  # Llama 3 8B at 8,192 tokens in bf16: 1 GiB


def req(**kw: object) -> MemoryRequest:
    return MemoryRequest(**{"seq_len": 8192, "kv_dtype": "bf16", "weight_dtype": "bf16", **kw})  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- tensor parallelism
@pytest.mark.parametrize("tp,heads,replication,per_gpu", [
    (1, 8, 1, GIB_KV), (2, 4, 1, GIB_KV // 2), (4, 2, 1, GIB_KV // 4), (8, 1, 1, GIB_KV // 8),
    (16, 1, 2, GIB_KV // 8), (32, 1, 4, GIB_KV // 8),  # more GPUs than KV heads: 1 head each, replicated
])
def test_kv_heads_split_then_replicate(tp: int, heads: int, replication: int, per_gpu: int) -> None:
    res = calculate(LLAMA3, req(tp=tp))
    assert (res.kv_heads_per_gpu, res.kv_head_replication, res.kv_bytes_per_gpu) == (heads, replication, per_gpu)
    assert res.kv_bytes == GIB_KV  # the model's cache, one copy, whatever the split
    assert tp * res.kv_bytes_per_gpu == replication * res.kv_bytes
    assert res.weights_bytes_per_gpu == -(-2 * 8_030_261_248 // tp)
    assert any("replicated" in w for w in res.warnings) == (replication > 1)


def test_replication_factor_is_shown_in_the_warning_and_formula() -> None:
    res = calculate(LLAMA3, req(tp=16))
    assert "KV heads replicated 2x: tp 16 is more than the 8 KV heads" in " ".join(res.warnings)
    assert "tensor parallel 16 > 8 KV heads: 1 KV head per GPU, each head replicated 2x" in res.formula
    assert "per GPU (tp 16): KV 128.00 MiB (134.22 MB)" in summary_text(res)


@pytest.mark.parametrize("tp,message", [
    (3, "tp 3 neither divides nor is a multiple of the 8 KV heads"),
    (12, "tp 12 neither divides nor is a multiple of the 8 KV heads"),
    (3, "tp 3 does not divide the 32 attention heads"),
    (64, "tp 64 does not divide the 32 attention heads"),
])
def test_tp_that_cannot_split_is_refused(tp: int, message: str) -> None:
    with pytest.raises(CalcError) as e:
        calculate(LLAMA3, req(tp=tp))
    assert message in str(e.value)


def test_mla_latent_is_not_split_by_tp() -> None:
    ds = PRESETS["deepseek-v2"]  # 128 heads, latent 512 + 64
    one = calculate(ds, req(seq_len=4096))
    eight = calculate(ds, req(seq_len=4096, tp=8))
    assert eight.kv_bytes_per_gpu == one.kv_bytes == 60 * 576 * 2 * 4096  # every GPU: the whole latent
    assert eight.kv_heads_per_gpu is None and eight.kv_head_replication == 8
    assert any("MLA's latent is not split" in w for w in eight.warnings)
    assert "the MLA latent has no heads to split" in "\n".join(eight.formula)


def test_linear_state_splits_and_refuses_uneven_heads() -> None:
    nxt = PRESETS["qwen3-next-80b-a3b"]  # 16 key heads, 32 value heads, 2 KV heads
    res = calculate(nxt, req(seq_len=1000, tp=4, state_dtype="bf16"))
    assert res.state_bytes_per_gpu == 36 * (8192 // 4 * 3 + 32 // 4 * 128 * 128) * 2
    assert res.kv_head_replication == 2 and res.kv_bytes_per_gpu == 12 * 1000 * 2 * 1 * 256 * 2
    with pytest.raises(CalcError, match="tp 32 does not divide the 16 attention heads"):
        calculate(nxt, req(tp=32))
    cfg = {"model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 64, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}
    with pytest.raises(CalcError, match="tp 4 does not divide the linear layers' 2 linear key heads"):
        calculate(parse_config(cfg), req(tp=4))


def test_fit_is_per_gpu() -> None:
    big = PRESETS["llama-3.1-405b"]
    alone = calculate(big, req(gpu_gib=80))
    assert alone.fit is not None and not alone.fit.fits
    eight = calculate(big, req(gpu_gib=80, tp=8, weight_dtype="fp8"))
    fit = eight.fit
    assert fit is not None and fit.fits
    need = eight.weights_bytes_per_gpu + eight.kv_bytes_per_gpu  # type: ignore[operator]
    assert fit.headroom_bytes == int(80 * GIB * 0.9) - need
    per_request = calculate(big, req(tp=8, batch=1)).kv_bytes_per_gpu
    assert fit.max_batch == (int(80 * GIB * 0.9) - eight.weights_bytes_per_gpu) // per_request  # type: ignore[operator]


# ----------------------------------------------------------------------------- cost per token
def test_cost_formula_worked_by_hand() -> None:
    # 14 GB of weights per GPU + 8 sequences x 1 GB, at 2,000 GB/s x 0.5: 22 GB / 1,000 GB/s = 22 ms.
    c = decode_cost(14 * 10**9, 10**9, 8, 2000, 0.5, 2.0, tp=2)
    assert c.bytes_per_step == 22 * 10**9
    assert c.step_s == pytest.approx(0.022, rel=1e-12)
    assert c.tokens_per_s == pytest.approx(8 / 0.022, rel=1e-12)  # 363.6 tokens/s
    # $2/GPU-hour x 2 GPUs = $4/hour for 363.6 x 3,600 tokens: $3.0556 per million
    assert c.usd_per_million_tokens == pytest.approx(4 / (8 / 0.022 * 3600) * 1e6, rel=1e-12)
    assert c.usd_per_million_tokens == pytest.approx(3.05556, abs=1e-5)
    assert decode_cost(1, 1, 1, 1, 1, None).usd_per_million_tokens is None


def test_request_cost_llama3_on_an_h100_by_hand() -> None:
    h100 = load_gpus()["h100-sxm"]
    assert (h100.memory_gib, h100.bandwidth_gbs) == (80, 3350)
    res = calculate(LLAMA3, req(bandwidth_gbs=h100.bandwidth_gbs, price_per_gpu_hour=2.5))
    c = res.cost
    assert c is not None
    moved = 2 * 8_030_261_248 + 1 * 2**30  # the weights once + one sequence's 1 GiB of KV
    assert c.bytes_per_step == moved
    step = moved / (3350e9 * 0.7)
    assert c.step_s == pytest.approx(step, rel=1e-12) and c.tokens_per_s == pytest.approx(1 / step, rel=1e-12)
    assert c.usd_per_million_tokens == pytest.approx(2.5 / (3600 / step) * 1e6, rel=1e-12)
    assert round(c.tokens_per_s, 1) == 136.9 and round(c.usd_per_million_tokens, 3) == 5.074  # type: ignore[arg-type]


def test_cost_includes_state_and_divides_by_tp() -> None:
    nxt = PRESETS["qwen3-next-80b-a3b"]
    r = req(seq_len=1000, tp=4, bandwidth_gbs=1000, price_per_gpu_hour=1.0, efficiency=1.0, batch=2)
    res = calculate(nxt, r)
    per_seq = res.kv_bytes_per_gpu // 2 + res.state_bytes_per_gpu // 2
    assert res.cost is not None and res.cost.bytes_per_step == res.weights_bytes_per_gpu + 2 * per_seq  # type: ignore[operator]
    assert res.cost.usd_per_million_tokens == pytest.approx(4 / (res.cost.tokens_per_s * 3600) * 1e6)


def test_quantized_kv_is_cheaper_per_token_and_fits_more() -> None:
    r = req(seq_len=32_768, gpu_gib=80, bandwidth_gbs=3350, price_per_gpu_hour=2.5, batch=16)
    bf16 = cost_curve(LLAMA3, r, 2 * 8_030_261_248, [16], "bf16")[0]
    fp8 = cost_curve(LLAMA3, r, 2 * 8_030_261_248, [16], "fp8")[0]
    assert fp8.bytes_per_step == 2 * 8_030_261_248 + 16 * 2 * 2**30  # 2 GiB per sequence in fp8, 4 in bf16
    assert fp8.usd_per_million_tokens < bf16.usd_per_million_tokens  # type: ignore[operator]
    assert calculate(LLAMA3, r).fit.max_batch < calculate(LLAMA3, r.__class__(**{**r.__dict__, "kv_dtype": "fp8"})).fit.max_batch  # type: ignore[union-attr]


def test_no_cost_without_bandwidth_or_weights() -> None:
    assert calculate(LLAMA3, req()).cost is None
    unknown = parse_config({"model_type": "new", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    res = calculate(unknown, req(bandwidth_gbs=100))
    assert res.cost is None and any("no cost per token" in w for w in res.warnings)
    assert request_cost(unknown, req(bandwidth_gbs=100), 1000) is not None


def test_batch_steps() -> None:
    assert batch_steps(1) == [1] and batch_steps(8) == [1, 2, 4, 8] and batch_steps(11) == [1, 2, 4, 8, 11]
    assert batch_steps(0) == [1] and batch_steps(10**9)[-1] == 1 << 16


def test_gpu_presets_are_sourced() -> None:
    gpus = load_gpus()
    assert set(gpus) == {"h100-sxm", "h200", "a100-80gb", "l40s", "l4", "rtx-4090"}
    assert {k: (g.memory_gib, g.bandwidth_gbs) for k, g in gpus.items()} == {
        "h100-sxm": (80, 3350), "h200": (141, 4800), "a100-80gb": (80, 2039), "l40s": (48, 864), "l4": (24, 300),
        "rtx-4090": (24, 1008)}
    assert all(g.source.startswith("https://") and g.price_per_hour > 0 for g in gpus.values())


def test_bad_request_values_are_named() -> None:
    with pytest.raises(CalcError) as e:
        MemoryRequest(seq_len=1, tp=0, state_dtype="int4", bandwidth_gbs=-1, efficiency=1.5, price_per_gpu_hour=-2)
    for word in ("tp", "state_dtype", "bandwidth_gbs", "efficiency", "price_per_gpu_hour"):
        assert word in str(e.value)


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_every_preset_computes_at_every_valid_tp(key: str) -> None:
    spec = PRESETS[key]
    for tp in (1, 2, 4, 8, 16):
        try:
            res = calculate(spec, req(seq_len=4096, tp=tp, gpu_gib=80, bandwidth_gbs=3350, price_per_gpu_hour=2.5))
        except CalcError as e:
            assert "tp" in str(e)
            continue
        assert res.kv_bytes_per_gpu * tp >= res.kv_bytes and res.to_dict()["layers"]
        assert summary_text(res)
