"""Issue 37, class 3: the calculator takes every value its inputs allow, and prints only true digits.

References are independent of the code under test: Python's Fraction for exact quotients, the
published Llama 3 8B shape (32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 131,072 B per
token) for the cache.
"""
from __future__ import annotations

import json
from fractions import Fraction
from html import unescape

import pandas as pd
import pytest

from kvviz.calculator import ConfigError, parse_config_text
from kvviz.ui.common.frames import safe_frame
from kvviz.units import GIB, exact_ratio, fmt_bytes, fmt_count
from test_calculator_page import fresh, metrics

LLAMA3_8B_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def _reference(n: int, div: int) -> str:
    """n / div to 2 decimals, half up, from Fraction: no float anywhere."""
    hundredths = int(Fraction(n * 100, div) + Fraction(1, 2))
    return f"{hundredths // 100:,}.{hundredths % 100:02d}"


@pytest.mark.parametrize("n", [0, 1, GIB - 1, GIB, 3 * GIB // 2, 2**87, 2**87 + 2 * 10**15, 10**26 + 7, 2**100 - 1])
@pytest.mark.parametrize("div", [GIB, 10**9, 1024])
def test_exact_ratio_agrees_with_fractions(n: int, div: int) -> None:
    assert exact_ratio(n, div) == _reference(n, div)


def test_a_float_quotient_would_be_off_by_gibibytes() -> None:
    """The reported figure: float division prints ...862,640.00 GiB; the true value is ...862,645.15."""
    n = LLAMA3_8B_KV_PER_TOKEN * 10**12 * 2**30 + 2 * 10**15  # the cache + 10^15 bf16 parameters
    assert f"{n / GIB:,.2f}" == "131,072,000,001,862,640.00"
    assert exact_ratio(n, GIB) == "131,072,000,001,862,645.15" == _reference(n, GIB)
    assert fmt_bytes(n, both_units=True).startswith("131,072,000,001,862,645.15 GiB (")


def test_the_reported_link_shows_the_exact_total() -> None:
    at = fresh(mem_seq_len="1000000000000", mem_batch="1073741824", mem_params="1000000000000000")
    assert not at.exception, at.exception
    m = metrics(at)
    assert m["KV cache total (binary)"] == "131,072,000,000,000,000.00 GiB"  # 131,072 B x 10^12 x 2^30 / 2^30
    assert m["Total (binary)"] == "131,072,000,001,862,645.15 GiB"


@pytest.mark.parametrize("query", [
    {"mem_seq_len": "1000000000000", "mem_batch": "1073741824"},  # the two reported links
    {"mem_seq_len": "1099511627776", "mem_batch": "8192"},
    {"mem_seq_len": "1099511627776", "mem_batch": "1073741824", "mem_beams": "16", "mem_dtype": "fp32",
     "mem_paged": "true", "mem_block_size": "4096"},  # every multiplier at its bound
    {"mem_preset": "deepseek-v2", "mem_seq_len": "1099511627776", "mem_batch": "1073741824", "mem_beams": "16"},
])
def test_every_table_takes_the_largest_values(query: dict[str, str]) -> None:
    at = fresh(**query)
    assert not at.exception, at.exception
    tables = [d.value for d in at.dataframe]
    (layers,) = [t for t in tables if "tokens held (each)" in t.columns]
    seq, batch = int(query["mem_seq_len"]), int(query["mem_batch"]) * int(query.get("mem_beams", "1"))
    kv = layers["KV bytes"].tolist()
    assert all(isinstance(v, str) for v in kv)  # past int64: exact text
    if query.get("mem_preset", "llama-3-8b") == "llama-3-8b" and "mem_dtype" not in query:
        assert kv == [f"{LLAMA3_8B_KV_PER_TOKEN * seq * batch:,}"]
    (side,) = [t for t in tables if "kv_bytes_per_token" in t.columns]
    assert side["kv_bytes"].tolist()[0] == f"{int(side['kv_bytes_per_token'].tolist()[0]) * seq * batch:,}"


def test_safe_frame_keeps_small_columns_numeric() -> None:
    df = safe_frame([{"a": 1, "b": 2**63, "c": 1.5, "d": None, "e": 2.0**60},
                     {"a": 2, "b": None, "c": 2.5, "d": "x", "e": 3.0}])
    assert df["a"].dtype == "int64" and df["c"].dtype == "float64"
    assert df["b"].tolist() == ["9,223,372,036,854,775,808", None]
    assert df["e"].tolist() == ["1.15292150460685e+18", "3"]  # 15 true significant digits, no more
    assert pd.api.types.is_object_dtype(df["b"])


def test_a_300_digit_config_value_gets_a_short_message() -> None:
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 1e308,
           "num_key_value_heads": 8, "vocab_size": 32000, "intermediate_size": 11008}
    with pytest.raises(ConfigError) as e:
        parse_config_text(json.dumps(cfg), "pasted config.json")
    (problem,) = [p for p in e.value.problems if p.startswith("hidden_size")]
    assert problem == ("hidden_size = about 1.00e+308 (a 309-digit number) is implausibly large "
                       "(limit 10,000,000)")
    assert len(str(e.value)) < 200, str(e.value)


@pytest.mark.parametrize("v, shown", [(8192, "8,192"), (-5, "-5"), (10**23, "100,000,000,000,000,000,000,000"),
                                      (10**24, "about 1.00e+24 (a 25-digit number)"),
                                      (-(10**400), "about -1.00e+400 (a 401-digit number)")])
def test_fmt_count_caps_long_numbers(v: int, shown: str) -> None:
    assert fmt_count(v) == shown


def test_the_page_shows_the_short_message() -> None:
    at = fresh(mem_source="import")
    at.text_area(key="mem_config_text").input(json.dumps(
        {"model_type": "llama", "num_hidden_layers": -1e308, "num_attention_heads": 32, "hidden_size": 1e308,
         "num_key_value_heads": 8}))
    at.run()
    assert not at.exception and len(at.error) == 1
    msg = unescape(at.error[0].value)
    assert "hidden_size = about 1.00e+308 (a 309-digit number)" in msg.replace("\\", "")
    assert "num_hidden_layers must be positive (got about -1.00e+308" in msg.replace("\\", "")
    assert len(msg) < 400, msg
