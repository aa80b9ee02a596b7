"""Issue 37, class 4: a vLLM log whose settings kvviz cannot use says so, instead of passing silently.

The reported log's "non-default args" say max_model_len -5, tensor_parallel_size 0 and
kv_cache_dtype 'fp9'; each was dropped without a word and the reconciliation ran on other values.
"""
from __future__ import annotations

import json
from html import unescape
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kvviz.cli.main import main
from kvviz.calculator.server_log import VLLM_KV_DTYPES, parse_vllm_log, settings_from_log

KV_LINES = """INFO 01-01 00:00:10 [gpu_worker.py:276] Available KV cache memory: 30.00 GiB
INFO 01-01 00:00:10 [kv_cache_utils.py:1013] GPU KV cache size: 245,760 tokens
INFO 01-01 00:00:10 [kv_cache_utils.py:1017] Maximum concurrency for 8,192 tokens per request: 30.00x
"""
BAD_ARGS = ("INFO 01-01 00:00:00 [utils.py:326] non-default args: {'model': 'meta-llama/Meta-Llama-3-8B', "
            "'max_model_len': -5, 'tensor_parallel_size': 0, 'kv_cache_dtype': 'fp9'}\n")
GIVEN = {"max_model_len": None, "tp": None, "block_size": None, "kv_dtype": None}


def test_each_ignored_setting_is_named_with_why() -> None:
    flags, said = settings_from_log(parse_vllm_log(BAD_ARGS + KV_LINES), GIVEN)
    assert said[:2] == [
        "the log's max_model_len -5 ignored: it must be an integer from 1 to 1,099,511,627,776, so kvviz uses the "
        "value set here (or vLLM's default) instead",
        "the log's tensor_parallel_size 0 ignored: it must be an integer from 1 to 1,024, so kvviz uses the value "
        "set here (or vLLM's default) instead"]
    assert any(s.startswith("the log's kv_cache_dtype 'fp9' ignored: vLLM's choices are auto, bfloat16, fp8")
               for s in said)
    # what was used instead: max_model_len from the KV lines, tp and the dtype left to the page's own settings
    assert flags == {"max_model_len": 8192, "tp": None, "block_size": None, "kv_dtype": None}


@pytest.mark.parametrize("line, setting", [
    ("'block_size': 0", "block_size 0 ignored"), ("block_size=99999", "block_size 99,999 ignored"),
    ("pipeline_parallel_size=0", "pipeline_parallel_size 0 ignored"),
    ("max_num_batched_tokens=-1", "max_num_batched_tokens -1 ignored"),
    ("--tensor-parallel-size 5000", "tensor_parallel_size 5,000 ignored"),
])
def test_other_impossible_settings_are_named(line: str, setting: str) -> None:
    log = parse_vllm_log(f"INFO args: {line}\n" + KV_LINES)
    assert any(setting in s for s in log.ignored), log.ignored
    assert all(v > 0 for k, v in log.settings if k != "kv_dtype")


def test_good_settings_pass_without_a_note() -> None:
    log = parse_vllm_log("non-default args: {'max_model_len': 4096, 'tensor_parallel_size': 2, "
                         "'kv_cache_dtype': 'fp8_e5m2'}\n" + KV_LINES)
    assert log.ignored == () and dict(log.settings) == {"max_model_len": 4096, "tp": 2, "kv_dtype": "fp8_e5m2"}
    flags, said = settings_from_log(log, GIVEN)
    assert (flags["tp"], flags["kv_dtype"]) == (2, "fp8") and not any("ignored" in s for s in said)
    for dt in VLLM_KV_DTYPES:
        assert not any("ignored" in s for s in settings_from_log(parse_vllm_log(
            f"kv_cache_dtype='{dt}'\n" + KV_LINES), GIVEN)[1])


def test_the_cli_prints_what_it_ignored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "vllm.log"
    f.write_text(BAD_ARGS + KV_LINES)
    assert main(["memory", "--preset", "llama-3-8b", "--reconcile", str(f), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    notes = " ".join(d["notes"])
    assert "max_model_len -5 ignored" in notes and "tensor_parallel_size 0 ignored" in notes
    assert "kv_cache_dtype 'fp9' ignored" in notes
    assert d["settings"]["max_model_len"] == 8192 and d["settings"]["tp"] == 1


def _script() -> None:
    from kvviz.ui.pages.calculator.calculator import page

    page()


def test_the_page_shows_what_it_ignored() -> None:
    at = AppTest.from_function(_script, default_timeout=60).run()
    at.text_area(key="mem_eng_log").input(BAD_ARGS + KV_LINES).run()
    assert not at.exception and not at.error
    captions = [unescape(c.value).replace("\\", "") for c in at.caption]
    assert any("the log's max_model_len -5 ignored" in c for c in captions), captions
    assert any("the log's tensor_parallel_size 0 ignored" in c for c in captions)
    assert any("the log's kv_cache_dtype 'fp9' ignored" in c for c in captions)
