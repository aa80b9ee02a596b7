"""The calculator page's Engine section in a real browser: vLLM's CPU backend chosen with its own flag
name (--device cpu) shows the figure vLLM's CPU build printed for SmolLM2 at VLLM_CPU_KVCACHE_SPACE=1
(issue 40: "CPU KV cache size: 46,592 tokens, Maximum concurrency for 2,048 tokens per request:
22.75x"), on one line as vLLM 0.33 prints it. Elements are found by ``.st-key-<key>``."""
from __future__ import annotations

import re
import warnings

from conftest import _wait_idle

LINE = "CPU KV cache size: 46,592 tokens, Maximum concurrency for 2,048 tokens per request: 22.75x"


def _choose(page, key: str, option: str) -> None:  # type: ignore[no-untyped-def]
    """Open a selectbox and pick ``option``. A rerun that lands between the click and the list's drawing
    closes the list again (seen once in a CI run on a loaded machine), so open it again, up to 3 times."""
    for _ in range(3):
        _wait_idle(page, 180_000)
        page.locator(f".st-key-{key} input").click()  # a combobox: its options open under the input
        try:
            page.get_by_role("option", name=option).wait_for(timeout=20_000)
        except Exception:  # noqa: BLE001 - playwright's TimeoutError: the list closed; open it again
            page.keyboard.press("Escape")
            continue
        page.get_by_role("option", name=option).click()
        return
    raise AssertionError(f"the {key} selectbox never listed {option!r}")


def test_cpu_backend_line_and_new_controls(page, app_url: str, screenshot) -> None:  # type: ignore[no-untyped-def]
    page.goto(f"{app_url}/calculator?mem_preset=smollm2-135m&mem_seq_len=2048")
    _wait_idle(page, 180_000)  # the page's first run draws every chart: slow on a loaded machine
    page.wait_for_selector(".st-key-mem_eng_kv_gib input", timeout=180_000)
    for key in ("mem_eng_device", "mem_eng_async", "mem_eng_ub", "mem_eng_fa", "mem_eng_draft"):
        assert page.locator(f".st-key-{key}").count() == 1, key
    kv = page.locator(".st-key-mem_eng_kv_gib input")
    kv.fill("1")
    kv.press("Enter")
    _wait_idle(page, 180_000)
    _choose(page, "mem_eng_device", "cpu")
    page.wait_for_function("t => document.body.innerText.includes(t)", arg=LINE, timeout=180_000)
    _wait_idle(page, 180_000)
    assert page.get_by_text("vLLM: CPU KV cache size").count() >= 1
    page.locator(".st-key-mem_eng_device").scroll_into_view_if_needed()
    path = screenshot(page, "calculator-engines-cpu.png")
    assert path.exists()


# A one-layer draft of SmolLM2's attention shape (3 KV heads x 64): SGLang 0.5.23 counts its layer in the
# target's cell (model_executor/pool_configurator.py:311-314: 23,040 + int(23,040 x 1 / 30) = 23,808 B) and
# gives it a pool of its own with the target's #tokens. 1 GiB // 23,808 B = 45,100 tokens; the draft's K:
# (45,100 + 1) x 3 x 64 x 1 x 2 B = 17,318,784 B = 0.0161 GiB ("0.02 GB"), in the line with its dtype
# (mem_cache/memory_pool.py:2088-2090).
DRAFT = ('{"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, '
         '"hidden_size": 576, "max_position_embeddings": 8192, "vocab_size": 49152}')
DRAFT_LINE = "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 45100, K size: 0.02 GB, V size: 0.02 GB"


def test_draft_config_upload_gives_sglang_its_draft_pool(page, app_url: str, screenshot, tmp_path) -> None:  # type: ignore[no-untyped-def]
    link = f"{app_url}/calculator?mem_preset=smollm2-135m&mem_seq_len=2048"
    page.goto(link)
    _wait_idle(page, 180_000)
    page.wait_for_selector(".st-key-mem_eng_kv_gib input", timeout=180_000)
    draft = tmp_path / "draft.json"
    draft.write_text(DRAFT)
    # The KV size typed, then the draft uploaded: the exact line must follow. Once in a clean CI run on a
    # loaded machine it never came (180 s): the Enter's rerun had not begun when the idle wait passed,
    # and the upload landed in it. So each try types the size again, waits for the file's name in the
    # uploader, and gives the line 90 s; the line asserted is the same.
    # Once (a clean CI run, 2026-11-29) every setting of the page read its lowest value or first option
    # (GPT-2, context 1, bandwidth 1 GB/s) by the end of its three tries, so SmolLM2's draft line never came;
    # not reproduced in 8 runs since, loaded or not. A try that finds the link's settings gone says so
    # (a warning in the report) and opens the link again.
    for _ in range(3):
        if "mem_preset=smollm2-135m" not in page.url:
            warnings.warn(f"the calculator's settings were reset to {page.url.split('?')[-1][:80]!r}; opening the link again")
            page.goto(link)
            _wait_idle(page, 180_000)
        kv = page.locator(".st-key-mem_eng_kv_gib input")
        kv.fill("1")
        kv.press("Enter")
        page.wait_for_timeout(300)  # the Enter's rerun starts (a wait for a start, not for readiness)
        _wait_idle(page, 180_000)
        page.locator(".st-key-mem_eng_draft input[type=file]").set_input_files(str(draft))
        try:
            page.locator(".st-key-mem_eng_draft").get_by_text("draft.json").first.wait_for(timeout=60_000)
            page.wait_for_function("t => document.body.innerText.includes(t)", arg=DRAFT_LINE, timeout=90_000)
            break
        except Exception:  # noqa: BLE001 - playwright's TimeoutError: try the size and the upload again
            continue
    else:
        raise AssertionError(f"the draft's pool line never appeared: {DRAFT_LINE!r}")
    _wait_idle(page, 180_000)
    page.get_by_text(DRAFT_LINE).first.scroll_into_view_if_needed()
    assert screenshot(page, "calculator-engines-sglang-draft.png").exists()


def _generate_and_back(page, back: str) -> None:  # type: ignore[no-untyped-def]
    """Through the sidebar to the Generate page, and back to the calculator until ``back`` is drawn."""
    page.get_by_role("link", name=re.compile("^Generate")).click()
    page.wait_for_selector(".st-key-prompt textarea")
    _wait_idle(page, 180_000)
    page.get_by_role("link", name=re.compile("KV memory calculator")).click()
    page.wait_for_selector(back)
    _wait_idle(page, 180_000)


def test_the_calculation_survives_a_visit_to_another_page(page, app_url: str) -> None:  # type: ignore[no-untyped-def]
    """Streamlit forgets a widget's value after a run of a page that does not draw it: the calculator's
    settings, the engine's and a pasted log came back as the defaults (Llama 3 8B, 8,192 tokens, an
    empty box) after a visit to the Generate page, until each widget kept its state across pages."""
    page.goto(f"{app_url}/calculator?mem_preset=smollm2-135m&mem_seq_len=2048")
    _wait_idle(page, 180_000)
    kv = page.locator(".st-key-mem_eng_kv_gib input")
    kv.fill("1.5")
    kv.press("Enter")
    _wait_idle(page, 180_000)
    log = page.locator(".st-key-mem_eng_log textarea")
    log.fill(LINE)
    log.press("Control+Enter")
    _wait_idle(page, 180_000)
    _generate_and_back(page, ".st-key-mem_eng_kv_gib input")
    assert "mem_preset=smollm2-135m" in page.url and "mem_seq_len=2048" in page.url, page.url
    assert page.locator(".st-key-mem_seq_len input").input_value() == "2048"
    assert page.locator(".st-key-mem_eng_kv_gib input").input_value() == "1.50"
    assert page.locator(".st-key-mem_eng_log textarea").input_value() == LINE
    # A pasted config.json, whose box the preset hid on the first visit (a value Streamlit had kept
    # under its key from then, "", came back instead of the paste until the widgets kept their state).
    page.locator(".st-key-mem_source label").filter(has_text="Import").click()
    _wait_idle(page, 180_000)
    config = page.locator(".st-key-mem_config_text textarea")
    config.fill(DRAFT)
    config.press("Control+Enter")
    page.get_by_text("1 layers").first.wait_for(timeout=180_000)
    _generate_and_back(page, ".st-key-mem_config_text textarea")
    assert page.locator(".st-key-mem_config_text textarea").input_value() == DRAFT
