"""AppTest over the KV memory calculator page: presets, import, bad config, links, charts, CSV."""
from __future__ import annotations

import json

import pytest
from streamlit.testing.v1 import AppTest

from kvviz.ui.common.plain_text import unescape

LLAMA_SENTENCE = "is the MHA figure"


def _script() -> None:
    from kvviz.ui.pages.calculator.calculator import page

    page()


def fresh(**query: str) -> AppTest:
    at = AppTest.from_function(_script, default_timeout=60)
    for k, v in query.items():
        at.query_params[k] = v
    return at.run()


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def plain(elements: object) -> list[str]:
    """The text of st.warning / st.error / st.caption elements, with md_plain's escapes undone."""
    return [unescape(e.value) for e in elements]  # type: ignore[attr-defined]


def figures(at: AppTest) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def figure(at: AppTest, x_title: str, nth: int = 0) -> dict:
    """The nth figure whose x axis is titled ``x_title``."""
    found = [f for f in figures(at) if f["layout"]["xaxis"]["title"]["text"] == x_title]
    return found[nth]


def table(at: AppTest, column: str) -> "object":
    """The first st.dataframe with this column."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


@pytest.fixture(scope="module")
def default_page() -> AppTest:
    return fresh()


def test_default_preset_renders_metrics_sentence_and_link(default_page: AppTest) -> None:
    at = default_page
    assert not at.exception and not at.error
    m = metrics(at)
    assert m["KV per token (binary)"] == "128.00 KiB"
    assert m["KV cache total (binary)"] == "1.00 GiB"
    assert m["On this GPU"] == "fits"
    captions = " ".join(c.value for c in at.caption)
    assert "1.07 GB (decimal)" in captions and "1,073,741,824 bytes" in captions
    # Llama 3 8B at 8,192 tokens, batch 1, bf16: the "~4 GB" claim, explained in one sentence.
    assert any(LLAMA_SENTENCE in i.value and "4.29 GB" in i.value and "1.07 GB" in i.value for i in at.info)
    assert "KV total = 131,072 B x 8,192 tokens" in at.code[0].value
    qp = at.query_params
    assert qp["mem_preset"] == "llama-3-8b" and qp["mem_seq_len"] == "8192" and qp["mem_dtype"] == "bf16"


def test_charts_have_titles_axis_units_and_fixed_height(default_page: AppTest) -> None:
    figs = figures(default_page)
    # the per-layer strip, memory vs context, weights + KV vs batch, attention kinds, $ and tokens/s vs batch
    assert len(figs) == 6
    for f in figs:
        layout = f["layout"]
        assert layout["title"]["text"] and layout["height"] in (420, 260)
        assert layout["xaxis"]["title"]["text"] and layout["yaxis"]["title"]["text"]
    memory = [f for f in figs if "(GiB)" in f["layout"]["yaxis"]["title"]["text"]]
    assert len(memory) == 4
    context = figure(default_page, "context length (tokens)")
    assert context["layout"]["xaxis"]["type"] == "log"  # log axes are on by default
    names = [t["name"] for t in context["data"]]
    assert "GPU 80 GiB" in names and "usable after 10% reserve" in names  # GPU capacity lines
    batch = figure(default_page, "batch size (requests)")
    assert batch["layout"]["barmode"] == "stack"
    kinds = figure(default_page, "attention kind")
    assert [b for b in kinds["data"][0]["x"]][:3] == ["MHA (32 KV heads)", "GQA (8 KV heads)", "MQA (1 KV head)"]


def test_table_and_csv_download(default_page: AppTest) -> None:
    df = table(default_page, "model")
    assert list(df["model"])[:2] == ["Llama-3-8B", "Llama-2-7B"] and "kv_bytes" in df.columns
    assert len(default_page.get("download_button")) == 1


def test_every_widget_key_is_prefixed(default_page: AppTest) -> None:
    kinds = ("number_input", "selectbox", "slider", "checkbox", "radio", "multiselect", "text_area")
    keys = [w.key for kind in kinds for w in default_page.get(kind)]
    assert keys and all(k.startswith("mem_") for k in keys)


def test_choosing_presets_and_settings() -> None:
    at = fresh()
    at.selectbox(key="mem_preset").set_value("deepseek-v2")
    at.number_input(key="mem_seq_len").set_value(4096)
    at.run()
    assert not at.exception and not any(LLAMA_SENTENCE in i.value for i in at.info)
    assert metrics(at)["KV per token (binary)"] == "67.50 KiB"  # 60 x 576 x 2 bytes
    assert any("naive per-head" in c.value for c in at.caption)
    at.selectbox(key="mem_dtype").set_value("int4")
    at.checkbox(key="mem_paged").check()
    at.number_input(key="mem_seq_len").set_value(4100)
    at.run()
    assert not at.exception
    assert any("Paging waste" in c.value for c in at.caption)
    assert "ceil(576 / 64) groups" in at.code[0].value
    assert at.query_params["mem_preset"] == "deepseek-v2" and at.query_params["mem_paged"] == "true"


def test_gemma_windows_and_beyond_max_positions_warning() -> None:
    at = fresh(mem_preset="gemma-2-9b", mem_seq_len="16384")
    assert not at.exception
    assert any("max_position_embeddings" in w for w in plain(at.warning))
    assert "21 x min(16,384, 4,096) + 21 x 16,384" in at.code[0].value


def test_import_pasted_config() -> None:
    at = fresh(mem_source="import")
    assert any("Upload or paste" in i.value for i in at.info)
    cfg = {"model_type": "qwen3", "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "hidden_size": 4096, "_name_or_path": "Qwen/Qwen3-8B"}
    at.text_area(key="mem_config_text").input(json.dumps(cfg))
    at.number_input(key="mem_seq_len").set_value(1000)
    at.run()
    assert not at.exception and not at.error
    assert "147,456,000 bytes" in " ".join(c.value for c in at.caption)
    assert metrics(at)["Weights"] == "unknown"  # no vocab or intermediate size in this excerpt
    assert "mem_preset" not in at.query_params and at.query_params["mem_source"] == "import"


def test_bad_config_names_each_problem() -> None:
    at = fresh(mem_source="import")
    at.text_area(key="mem_config_text").input(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 0, "num_attention_heads": 6, "hidden_size": 100,
         "num_key_value_heads": 4}))
    at.run()
    assert not at.exception and len(at.error) == 1
    msg = unescape(at.error[0].value)
    for part in ("num_hidden_layers must be positive", "6 attention heads do not divide hidden size 100",
                 "4 key/value heads do not divide the 6 attention heads"):
        assert part in msg
    assert not at.metric
    at.text_area(key="mem_config_text").input("{'model_type': 'llama'").run()
    assert "not valid JSON" in at.error[0].value and not at.exception


def test_link_reproduces_a_calculation_and_rejects_bad_values() -> None:
    at = fresh(mem_preset="mistral-7b-v0.1", mem_seq_len="32768", mem_dtype="fp8", mem_batch="4", mem_gpu="24",
               mem_windows="false")
    assert not at.exception
    assert at.selectbox(key="mem_preset").value == "mistral-7b-v0.1" and at.number_input(key="mem_batch").value == 4
    assert metrics(at)["KV cache total (binary)"] == "8.00 GiB"  # 4 x 32,768 x 65,536 B, windows off
    at = fresh(mem_seq_len="-5", mem_dtype="fp64", mem_preset="gpt-9", mem_gpu="33.5")
    assert not at.exception
    warned = " ".join(plain(at.warning))
    assert "mem_seq_len" in warned and "mem_dtype" in warned and "mem_preset" in warned
    assert at.number_input(key="mem_seq_len").value == 8192  # invalid values fall back to the defaults
    assert at.selectbox(key="mem_gpu").value == "custom" and at.number_input(key="mem_gpu_custom").value == 33.5
