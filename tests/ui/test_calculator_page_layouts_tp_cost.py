"""AppTest over the calculator page's per-layer and cost parts: the per-layer strip, tensor
parallelism, the cost per token and the gap to a real engine."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from streamlit.testing.v1 import AppTest

from kvviz.ui.common.plain_text import unescape
from test_calculator_page import _script, fresh, metrics, table  # the calculator page in AppTest, one copy




def texts(at: AppTest, kind: str) -> str:
    return " ".join(unescape(e.value) for e in at.get(kind))


def figure(at: AppTest, title_start: str) -> dict:
    figs = [json.loads(el.proto.spec) for el in at.get("plotly_chart")]
    return next(f for f in figs if f["layout"]["title"]["text"].startswith(title_start))


@pytest.fixture(scope="module")
def default_page() -> AppTest:
    return fresh()


def test_new_controls_are_keyed_and_default(default_page: AppTest) -> None:
    at = default_page
    assert not at.exception and not at.error
    assert at.number_input(key="mem_tp").value == 1
    assert at.selectbox(key="mem_gpu_kind").value == "h100-sxm"
    assert at.number_input(key="mem_bandwidth").value == 3350 and at.number_input(key="mem_price").value == 2.5
    assert at.slider(key="mem_efficiency").value == 0.7
    assert at.selectbox(key="mem_state_dtype").disabled  # Llama 3 has no linear layers
    assert at.selectbox(key="mem_cost_dtype").value == "fp8"
    for key in ("mem_tp", "mem_gpu_kind", "mem_bandwidth", "mem_price", "mem_efficiency", "mem_cost_dtype"):
        assert key in at.query_params


def test_cost_panel_worked_by_hand(default_page: AppTest) -> None:
    m = metrics(default_page)
    # Llama 3 8B, 8,192 tokens, bf16, one H100: (16.06 GB weights + 1 GiB KV) / (3,350 GB/s x 0.7)
    assert m["Tokens/s (upper bound)"] == "136.9" and m["$ per 1M output tokens"] == "$5.07"  # 2.5 / 3600 x 7.3067 ms x 1e6 = 5.0741
    assert "step = 17,134,264,320 B / (3,350 GB/s x 0.7) = 7.307 ms" in default_page.code[1].value
    cost = figure(default_page, "$ per 1M output tokens vs batch")
    tps = figure(default_page, "Decode tokens/s vs batch")
    assert [t["name"] for t in cost["data"]] == ["KV bf16", "KV fp8"] == [t["name"] for t in tps["data"]]
    assert cost["layout"]["xaxis"]["type"] == "log"
    captions = texts(default_page, "caption")
    assert "upper-bound estimate" in captions and "Prefill vs decode page measures" in captions


def test_per_layer_strip_and_table_for_gemma3() -> None:
    at = fresh(mem_preset="gemma-3-1b", mem_seq_len="4096")
    assert not at.exception and not at.error
    strip = figure(at, "What each layer holds at 4,096 tokens")
    assert strip["layout"]["height"] == 260
    assert {t["name"]: len(t["text"]) for t in strip["data"]} == {"sliding": 22, "full": 4}
    layers = table(at, "tokens held (each)")
    assert list(layers["kind"]) == ["sliding", "full"] and list(layers["tokens held (each)"]) == [512, 4096]
    assert list(layers["layers"]) == [22, 4]


def test_linear_layers_state_on_the_page() -> None:
    at = fresh(mem_preset="qwen3-next-80b-a3b", mem_seq_len="1000", mem_tp="4", mem_gpu="custom",
               mem_gpu_custom="80")
    assert not at.exception and not at.error
    assert not at.selectbox(key="mem_state_dtype").disabled
    m = metrics(at)
    assert m["Linear-layer state (binary)"] == "37.69 MiB"  # 36 x 1,097,728 B in bf16 (auto: the weights' dtype)
    strip = figure(at, "What each layer holds")
    assert {t["name"]: len(t["text"]) for t in strip["data"]} == {"full": 12, "linear": 36}
    assert "KV heads replicated 2x" in texts(at, "warning")


def test_tp_replication_and_refusal() -> None:
    at = fresh(mem_tp="16")
    assert not at.exception and not at.error
    m = metrics(at)
    assert m["KV heads"] == "1 per GPU" and m["KV per GPU (binary)"] == "128.00 MiB"
    assert m["On each of 16 GPUs"] == "fits"
    assert "replicated 2x" in texts(at, "caption") and "KV heads replicated 2x" in texts(at, "warning")
    gap = texts(at, "markdown")
    assert "KV-head replication.** With tp 16, every KV head is stored 2x" in gap
    at.number_input(key="mem_tp").set_value(3).run()
    assert not at.exception and len(at.error) == 1
    assert "tp 3 neither divides nor is a multiple of the 8 KV heads" in unescape(at.error[0].value)


def test_mla_is_not_split() -> None:
    at = fresh(mem_preset="deepseek-v2", mem_tp="8", mem_seq_len="4096")
    assert not at.exception and not at.error
    assert metrics(at)["KV heads"] == "whole latent"
    assert "MLA's latent is not split" in texts(at, "warning")


def test_choosing_a_gpu_fills_memory_bandwidth_and_price() -> None:
    at = fresh()
    at.selectbox(key="mem_gpu_kind").set_value("l4").run()
    assert not at.exception
    assert at.selectbox(key="mem_gpu").value == "24"
    assert at.number_input(key="mem_bandwidth").value == 300 and at.number_input(key="mem_price").value == 0.5
    at.selectbox(key="mem_gpu_kind").set_value("custom").run()
    assert at.number_input(key="mem_bandwidth").value == 300  # custom keeps what was there
    at = fresh(mem_gpu_kind="h200", mem_bandwidth="4000", mem_efficiency="2")
    assert at.selectbox(key="mem_gpu_kind").value == "h200" and at.selectbox(key="mem_gpu").value == "141"
    assert at.number_input(key="mem_bandwidth").value == 4000  # the link's own value wins over the preset's
    assert at.number_input(key="mem_price").value == 3.5  # the link named the GPU alone: its example price
    assert "mem_efficiency" in texts(at, "warning")


def test_gap_panel_and_the_live_cache_for_a_builtin() -> None:
    at = fresh(mem_preset="kvviz:random:tiny-gqa", mem_seq_len="500", mem_dtype="fp16", mem_batch="3")
    assert not at.exception and not at.error
    gap = texts(at, "markdown")
    for item in ("gpu_memory_utilization", "Activations and CUDA graphs", "Block rounding", "KV-head replication"):
        assert item in gap
    live = table(at, "engine cache (bytes)")
    assert list(live["cache kind"]) == ["static", "concat"] and list(live["tokens held"]) == [1024, 500]
    assert list(live["calculator (bytes)"]) == [3 * 1024 * 1024, 3 * 500 * 1024]  # 1 KiB per token per sequence
    assert all(live["equal"])
    at = fresh(mem_preset="gemma-3-1b")
    assert "Per-layer-type cache groups" in texts(at, "markdown")
    assert "Pick a model kvviz runs" in texts(at, "caption")
    from kvviz.ui.state.model_menu import smollm2_present

    if smollm2_present():  # the default model, its caches built from its own GGUF file's header
        at = fresh(mem_preset="smollm2-135m", mem_seq_len="1000", mem_dtype="fp32")
        live = table(at, "engine cache (bytes)")
        assert list(live["tokens held"]) == [8192, 1000] and all(live["equal"])


def test_measured_mbu_is_quoted_when_the_prefill_page_ran() -> None:
    at = AppTest.from_function(_script, default_timeout=60)
    sample = SimpleNamespace(device="cpu", dtype="fp32", metrics={"flops_per_s": 2e9, "intensity": 0.5})
    at.session_state["pd_probes"] = {("cpu", "fp32"): SimpleNamespace(bandwidth=10e9)}
    at.session_state["pd_results::default::cpu::fp32"] = {"decode": [sample, sample]}
    at.run()
    assert not at.exception
    assert "measured a decode MBU of 40% on this machine (cpu · fp32" in texts(at, "caption")


@pytest.mark.parametrize("preset", ["llama-4-scout", "gpt-oss-20b", "gemma-3-4b", "smollm2-135m"])
def test_new_presets_render(preset: str) -> None:
    at = fresh(mem_preset=preset, mem_seq_len="65536")
    assert not at.exception and not at.error and metrics(at)["KV cache total (binary)"]


def test_nothing_fits_shows_no_speed_and_no_price_with_the_reason() -> None:
    """Llama 3 70B's bf16 weights (131.42 GiB) on a 24 GiB L4: the roofline would say 4.1 tokens/s and
    $33.91 per 1M tokens for a run that cannot start; the page says "—" and why."""
    at = fresh(mem_preset="llama-3-70b", mem_gpu_kind="l4")
    assert not at.exception and not at.error
    m = metrics(at)
    assert m["Tokens/s (upper bound)"] == m["Decode step"] == m["$ per 1M output tokens"] == "—"
    assert "Nothing fits: the weights alone (131.42 GiB) do not fit in the usable 21.60 GiB" in texts(at, "caption")
    # A batch too big for the GPU: no figure either, and the batch that would fit.
    at = fresh(mem_batch="100", mem_gpu_kind="l4")
    m = metrics(at)
    assert m["Tokens/s (upper bound)"] == "—"
    assert "Batch 100 does not fit (needs " in texts(at, "caption") and "at most 6 requests fit" in texts(at, "caption")


def test_money_in_cents_and_log_axes_read_1_10_100() -> None:
    from kvviz.charts.calculator_charts import log_ticks, tick_label
    from kvviz.units import fmt_usd

    assert [fmt_usd(x) for x in (23.16594, 1234.5, 0.05, 0.0041234, 0.0000123456, 0.009999, 0.0)] == [
        "$23.17", "$1,234.50", "$0.05", "$0.00412", "$0.0000123", "$0.01", "$0.00"]
    assert fmt_usd(None) == "—"
    assert [tick_label(v) for v in (1, 10, 100, 1000, 20_000, 1e6, 0.5)] == ["1", "10", "100", "1k", "20k", "1M", "0.5"]
    vals, text = log_ticks([1, 2048])
    assert vals == [1, 10, 100, 1000, 10000] and text == ["1", "10", "100", "1k", "10k"]
    vals, text = log_ticks([0.9, 9.5])  # under two decades: 1-2-5 steps, never bare digits
    assert text == ["0.1", "0.2", "0.5", "1", "2", "5", "10", "20", "50"]
    at = fresh()
    for x_title in ("$ per 1M output tokens vs batch", "Decode tokens/s vs batch"):
        fig = figure(at, x_title)
        for axis in ("xaxis", "yaxis"):
            ax = fig["layout"][axis]
            assert ax["type"] == "log" and ax["tickmode"] == "array", (x_title, axis)
            assert all(re.fullmatch(r"0\.0*[125]|[125]0{0,2}[kMGT]?", t) for t in ax["ticktext"]), ax["ticktext"]
            assert [tick_label(v) for v in ax["tickvals"]] == ax["ticktext"]
    hover = figure(at, "$ per 1M output tokens vs batch")["data"][0]
    assert hover["text"][0] == m_usd(at) and "%{text} per 1M tokens" in hover["hovertemplate"]


def m_usd(at: AppTest) -> str:
    return metrics(at)["$ per 1M output tokens"]
