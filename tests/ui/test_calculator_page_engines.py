"""AppTest over the calculator page's Engine section: the three engines side by side and the
startup-log reconciler, for each engine's log (pasted text shown as cells, a log without KV lines
answered in a sentence)."""
from __future__ import annotations

import pandas as pd
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


def test_reconciler_reads_llamacpp_and_sglang_logs() -> None:
    """The reconciler's engine choice: llama.cpp's and SGLang's own lines for Llama 3 8B, worked by hand
    (32 layers x 8 KV heads x 128 x 2 B = 64 KiB a token for K and as much for V): -c 8192 is 512 MiB each,
    1,024 MiB in all; SGLang's pool of 81,920 tokens is 81,920 x 64 KiB x 32 layers = 5.00 GB (GiB) each.
    A changed figure disagrees, and a log without the engine's line is one sentence naming that line."""
    at = AppTest.from_function(_script, default_timeout=60).run()
    at.number_input(key="mem_seq_len").set_value(8192).run()
    at.radio(key="mem_eng_log_engine").set_value("llama.cpp").run()
    line = ("llama_kv_cache: size = 1024.00 MiB (  8192 cells,  32 layers,  1/1 seqs), K (f16):  512.00 MiB, "
            "V (f16):  512.00 MiB")
    rows = _paste(at, "llama_context: n_ctx = 8192\n" + line)
    assert list(rows["agrees"]) == [True] and "8,192 cells, 32 layers" in rows["kvviz"][0]
    assert list(_paste(at, line.replace("512.00 MiB, V", "256.00 MiB, V"))["agrees"]) == [False]
    assert _paste(at, "<b>not a log</b>") is None and "no llama.cpp KV-cache line found" in unescape(at.error[0].value)
    # An older build's line states no cells: the log's own n_ctx sizes it (4,096 cells: 256 MiB each for K
    # and V), not the sidebar's 8,192; without it, the sidebar's context does, and a note says so.
    old = "KV self size  =  512.00 MiB, K (f16):  256.00 MiB, V (f16):  256.00 MiB"
    assert list(_paste(at, "llama_new_context_with_model: n_ctx = 4096\n" + old)["agrees"]) == [True]
    assert list(_paste(at, old)["agrees"]) == [False]
    assert any("sized at the sidebar's context, 8,192 tokens" in unescape(c.value) for c in at.caption)

    at.radio(key="mem_eng_log_engine").set_value("SGLang").run()
    pool = "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 81920, K size: 5.00 GB, V size: 5.00 GB"
    rows = _paste(at, pool)
    assert list(rows["line"]) == ["K size / V size"] and list(rows["agrees"]) == [True]
    assert any("only the sizes are compared" in c.value for c in at.caption)
    assert list(_paste(at, pool.replace("#tokens: 81920", "#tokens: 163840"))["agrees"]) == [False]
    assert _paste(at, "hello") is None and "no SGLang KV-cache line found" in unescape(at.error[0].value)
    # the pasted text stays as typed across the engine choice
    at.radio(key="mem_eng_log_engine").set_value("vLLM").run()
    assert at.text_area(key="mem_eng_log").value == "hello" and "no vLLM KV-cache line found" in unescape(
        at.error[0].value)


def _paste(at: AppTest, text: str) -> pd.DataFrame | None:
    """Paste ``text`` into the reconciler: its table of rows, or None where it answered with an error."""
    at.text_area(key="mem_eng_log").input(text).run()
    assert not at.exception
    if at.error:
        return None
    return next(d.value for d in at.table if "why" in d.value.columns)


def test_length_mix_box() -> None:
    at = AppTest.from_function(_script, default_timeout=60).run()
    at.number_input(key="mem_eng_kv_gib").set_value(30.0).run()
    at.text_input(key="mem_eng_pcts").input("0:1000,100:1000").run()
    m = {x.label: x.value for x in at.metric}
    # every request 1,000 tokens = 63 blocks: 15,360 / 63 = 243.8 at once
    assert m["vLLM: requests of this length mix at once"] == "243.8"
    at.text_input(key="mem_eng_pcts").input("90:5,50:x").run()
    assert not at.exception and "is not PERCENTILE:TOKENS" in at.warning[-1].value.replace("\\", "")


def test_cpu_backend_async_and_ubatch_controls() -> None:
    """Issue 41's options with the engines' own flag names: vLLM --device cpu (block 128 while the sidebar
    keeps vLLM's GPU default of 16; SmolLM2 at VLLM_CPU_KVCACHE_SPACE=1 printed "CPU KV cache size: 46,592
    tokens", issue 40), llama.cpp -ub (gpt-oss-20b's sliding cache: pad(128 + 2,048, 256) = 2,304 cells),
    and async scheduling off (gpt-oss: one batch in flight, ceil((127 + 2,048) / 16) + 1 = 137 blocks)."""
    at = AppTest.from_function(_script, default_timeout=60).run()
    at.selectbox(key="mem_preset").set_value("smollm2-135m").run()
    at.number_input(key="mem_seq_len").set_value(2048).run()
    at.number_input(key="mem_eng_kv_gib").set_value(1.0).run()
    at.selectbox(key="mem_eng_device").set_value("cpu").run()
    assert not at.exception
    m = {x.label: x.value for x in at.metric}
    assert m["vLLM: CPU KV cache size"] == "46,592 tokens"
    assert any("CPU KV cache size: 46,592 tokens, Maximum concurrency for 2,048 tokens per request: 22.75x"
               in c.value for c in at.code)
    at.selectbox(key="mem_eng_device").set_value("cuda").run()
    at.selectbox(key="mem_preset").set_value("gpt-oss-20b").run()
    at.number_input(key="mem_seq_len").set_value(131072).run()
    at.number_input(key="mem_eng_ub").set_value(2048).run()
    at.number_input(key="mem_eng_batched").set_value(2048).run()  # the sidebar's GPU would batch 8,192
    code = "\n".join(c.value for c in at.code)
    assert "(  2304 cells,  12 layers,  1/1 seqs)" in code
    assert "+ 1 = 265 + full: ceil(131,072 / 16) = 8,192; 8,457 blocks in all" in code  # async: 2 x 2,048 in flight
    at.checkbox(key="mem_eng_async").uncheck().run()
    assert "+ 1 = 137 + full: ceil(131,072 / 16) = 8,192; 8,329 blocks in all" in "\n".join(c.value for c in at.code)


def test_sglang_multimodal_reserve_controls() -> None:
    """SGLang 0.5.23 takes a multimodal model's reserve off the pool's budget (mem_cache/kv_cache_configurator.py
    :202-219, 3034-3038): SGLANG_VLM_CACHE_SIZE_MB = 100 MB (environ.py:1598), / 1024 = 0.09765625 GB of 2^30,
    i.e. 104,857,600 B = 800 of Llama-3-8B's 131,072-byte tokens; with --mm-feature-transport cuda_ipc also
    SGLANG_MM_FEATURE_CACHE_MB = 1,024 MB (environ.py:1622): 1,124 MiB = 8,992 tokens. The rest memory is
    estimated here (available KV memory 0), so the reserve comes off it; a given rest memory is the budget itself."""
    at = AppTest.from_function(_script, default_timeout=60).run()
    assert not at.exception

    def tokens() -> int:
        return int({x.label: x.value for x in at.metric}["SGLang: #tokens"].replace(",", ""))

    plain = tokens()
    at.checkbox(key="mem_eng_sgl_mm").check().run()
    assert not at.exception and plain - tokens() == 800
    code = "\n".join(c.value for c in at.code)
    assert "- multimodal reserve: -0.0977 GiB" in code
    assert "Reserving 0.10 GB of the KV budget for post-sizing multimodal allocations" in code
    at.selectbox(key="mem_eng_sgl_transport").set_value("cuda_ipc").run()
    assert plain - tokens() == 8_992
    assert "Reserving 1.10 GB of the KV budget" in "\n".join(c.value for c in at.code)
    at.number_input(key="mem_eng_kv_gib").set_value(30.0).run()  # rest given: no reserve taken from it
    assert tokens() == 30 * 1024**3 // 131072
