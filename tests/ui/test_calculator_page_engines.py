"""AppTest over the calculator page's Engine section: the three engines side by side and the
vLLM log reconciler (pasted text shown as cells, a log without KV lines answered in a sentence)."""
from __future__ import annotations

from streamlit.testing.v1 import AppTest

from kvviz.ui.common.plain_text import unescape

LOG = ("INFO [gpu_worker.py:276] Available KV cache memory: 30.00 GiB\n"
       "INFO [kv_cache_utils.py:849] GPU KV cache size: 245,760 tokens\n"
       "INFO [kv_cache_utils.py:853] Maximum concurrency for 8,192 tokens per request: 30.00x\n")


def _script() -> None:
    from kvviz.ui.pages.calculator.calculator import page

    page()


def test_engines_side_by_side_and_reconciler() -> None:
    at = AppTest.from_function(_script, default_timeout=60)
    at.run()
    assert not at.exception and not at.error
    at.number_input(key="mem_eng_kv_gib").set_value(30.0).run()
    m = {x.label: x.value for x in at.metric}
    # Llama-3-8B, bf16, 30 GiB: 30 GiB // (16 x 8 x 128 x 2 x 2 B) // 32 layers = 15,360 blocks x 16
    assert m["vLLM: GPU KV cache size"] == "245,760 tokens"
    assert m["llama.cpp: KV allocated"] == "1.00 GiB"  # -c 8192: 32 layers x 8,192 cells x 2 x 2,048 B
    assert m["SGLang: #tokens"] == f"{30 * 1024**3 // 131072:,}"
    at.text_area(key="mem_eng_log").input(LOG).run()
    rows = next(d.value for d in at.table if "why" in d.value.columns)  # a table: its "why" sentences wrap
    assert list(rows["agrees"]) == [True, True, True]
    at.text_area(key="mem_eng_log").input("<b>not a log</b>").run()
    assert not at.exception
    assert "no vLLM KV-cache line found" in unescape(at.error[0].value)


def test_length_mix_box() -> None:
    at = AppTest.from_function(_script, default_timeout=60).run()
    at.number_input(key="mem_eng_kv_gib").set_value(30.0).run()
    at.text_input(key="mem_eng_pcts").input("0:1000,100:1000").run()
    m = {x.label: x.value for x in at.metric}
    # every request 1,000 tokens = 63 blocks: 15,360 / 63 = 243.8 at once
    assert m["vLLM: requests of this length mix at once"] == "243.8"
    at.text_input(key="mem_eng_pcts").input("90:5,50:x").run()
    assert not at.exception and "is not PERCENTILE:TOKENS" in at.warning[-1].value.replace("\\", "")
