"""Issue 41, rules 14 and 15, as SGLang 0.5.23 writes them (the PyPI wheel sglang-0.5.23; paths under
python/sglang/srt/): the pool's budget with the multimodal reserve, the fixed overhead, the draft's layers in the
target's cell, the hybrid sliding-window pools and the pool line with its dtype. Every figure is worked by hand
in the docstring; the floats SGLang uses (GB of 2^30 as Python floats) are chosen exactly representable, so
the byte counts are exact, not approximate."""
from __future__ import annotations


import pytest

from kvviz.calculator import CalcError
from kvviz.calculator.server_log_engines import parse_sglang_log, reconcile_sglang
from kvviz.calculator.server_sglang import mm_reserve_gib, sglang_sizing
from kvviz.units import GIB
from memory_cli_checks import run_error, run_json


LLAMA = ("--preset", "llama-3-8b", "--engine", "sglang", "--seq-len", "8192", "--kv-cache-dtype", "bf16")


# ----------------------------------------------------------------------------- rule 14: the pool's budget
def test_rest_takes_the_multimodal_reserve(capsys):
    """mem_cache/kv_cache_configurator.py:3007 slack = before x (1 - mem_fraction_static); :3034-3038 rest =
    after - slack - mm_runtime_reservation_gb; :3060 int(rest x 2^30). 'avail mem' 80 GB before, 64.5 after,
    --mem-fraction-static 0.875: slack 80 x 0.125 = 10. A text model: no reserve, rest = 54.5 GB =
    58,518,929,408 B // 131,072 (Llama-3-8B: 8 x (128 + 128) x 32 x 2 B) = 446,464 tokens. Multimodal with
    the default cpu transport: SGLANG_VLM_CACHE_SIZE_MB 100 (environ.py:1598) / 1024 = 0.09765625 GB
    (:202-219), rest = 54.40234375 GB = 58,414,071,808 B -> 445,664 tokens; cuda_ipc adds
    SGLANG_MM_FEATURE_CACHE_MB 1,024 (environ.py:1622): 1.09765625 GB, 57,340,329,984 B -> 437,472."""
    base = ("--avail-mem-gib", "80,64.5", "--mem-fraction-static", "0.875")
    d = run_json(capsys, *LLAMA, *base)["engine"]
    assert (d["rest_bytes"], d["max_total_num_tokens"], d["mm_reserve_bytes"]) == (58_518_929_408, 446_464, 0)
    d = run_json(capsys, *LLAMA, *base, "--multimodal")["engine"]
    assert (d["rest_bytes"], d["max_total_num_tokens"], d["mm_reserve_bytes"]) == (58_414_071_808, 445_664,
                                                                                   104_857_600)
    assert [(p["what"], p["gib"]) for p in d["rest_parts"]] == [
        ("free after loading the weights", 64.5),
        ("- free before loading x (1 - mem_fraction_static 0.875)", -10.0),
        ("- multimodal reserve", -0.09765625),
        ("= the pool's budget (rest_memory)", 54.40234375)]
    d = run_json(capsys, *LLAMA, *base, "--multimodal", "--mm-feature-transport", "cuda_ipc")["engine"]
    assert (d["rest_bytes"], d["max_total_num_tokens"]) == (57_340_329_984, 437_472)
    # the env figures are inputs too: SGLANG_VLM_CACHE_SIZE_MB=0 with cpu transport reserves nothing (:213)
    d = run_json(capsys, *LLAMA, *base, "--multimodal", "--vlm-cache-size-mb", "0")["engine"]
    assert d["max_total_num_tokens"] == 446_464


def test_reserve_log_line_and_refusals(capsys):
    """The reserve's log line (kv_cache_configurator.py:214-218, "%.2f GB"), and bad inputs refused in a
    sentence: an unknown transport (arg_groups/fields/mm.py:144-158 names three), a negative MB figure."""
    assert mm_reserve_gib(True, "cuda_vmm") == (1124 / 1024, "Reserving 1.10 GB of the KV budget for post-sizing "
                                                "multimodal allocations (feature-transport pools + embedding cache).")
    assert mm_reserve_gib(False, "cuda_ipc") == (0.0, "")
    err = run_error(capsys, *LLAMA, "--avail-mem-gib", "80,64", "--mm-feature-transport", "nvlink")
    assert "invalid choice: 'nvlink'" in err
    err = run_error(capsys, *LLAMA, "--avail-mem-gib", "80,64", "--vlm-cache-size-mb", "-5")
    assert "--vlm-cache-size-mb" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- rule 15: the pool
def test_fixed_overhead_and_the_dtype_in_the_line(presets):
    """model_executor/pool_configurator.py:640: #tokens = max(rest - fixed overhead, 0) // cell, page-aligned
    (:641-647); the overhead is the page-shard scratch, 0 unless --enable-kv-cache-sharding (:251-256,
    mem_cache/page_interleave.py:245-259). The line names the pool's dtype (mem_cache/memory_pool.py:2088-2090;
    MLA's "KV size", :2096-2098). DeepSeek-V3 at TP 8, 1 GiB: cell (512 + 64) x 61 x 2 B = 70,272 B,
    1,073,741,824 // 70,272 = 15,279 tokens, (15,279 + 1) x 70,272 = 1,073,756,160 B = 1.00 GB. fp8 is
    --kv-cache-dtype fp8_e4m3: self.dtype stays torch.float8_e4m3fn though stored as uint8 (:2027-2033)."""
    sg = sglang_sizing(presets["deepseek-v3"], GIB, tp=8)
    assert (sg.cell_bytes, sg.tokens, sg.k_bytes) == (70_272, 15_279, 1_073_756_160)
    assert sg.line == "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 15279, KV size: 1.00 GB"
    assert sg.to_dict()["fixed_overhead_bytes"] == 0
    assert any(f.startswith("fixed overhead = 0 B") for f in sg.formula)
    # 65,536 B a token: 163,840 tokens; K = 163,841 x 8 x 128 x 32 x 1 B = 5,368,741,888 B = 5.00 GB
    fp8 = sglang_sizing(presets["llama-3-8b"], 10 * GIB, kv_dtype="fp8")
    assert fp8.line == "KV Cache is allocated. dtype: torch.float8_e4m3fn, #tokens: 163840, K size: 5.00 GB, V size: 5.00 GB"


def test_hybrid_swa_pools_with_pages_and_a_draft(presets):
    """HybridSWAPoolConfigurator (pool_configurator.py:656-916), gpt-oss-20b: 12 full and 12 sliding layers of
    8 KV heads x (64 + 64) x 2 B = 2,048 B a token. _recompute_cell_size (:786-803): cell = 2,048 x 12 + 0.8 x
    2,048 x 12 = 44,236.8; :915 int(10 GiB // 44,236.8) = 242,725; _solve_pool_sizes (:859-905) with
    --page-size 64: full 242,688, sliding int(242,688 x 0.8) = 194,150 -> 194,112. A one-layer draft that is
    not a hybrid SWA model adds a full layer (:731-763): cell 2,048 x 13 + 0.8 x 2,048 x 12 = 46,284.8,
    full = 231,985, sliding = int(231,985 x 0.8) = 185,588."""
    sg = sglang_sizing(presets["gpt-oss-20b"], 10 * GIB, page_size=64)
    assert (sg.tokens, sg.swa_tokens) == (242_688, 194_112)
    assert sg.line == "Use sliding window memory pool. full_layer_tokens=242688, swa_layer_tokens=194112"
    sd = sglang_sizing(presets["gpt-oss-20b"], 10 * GIB, draft=(1, 0))
    assert (sd.tokens, sd.swa_tokens, sd.draft_layers) == (231_985, 185_588, 1)


def test_hybrid_swa_pool_too_small_is_sglangs_error(presets):
    """validate_swa_pool_size (pool_configurator.py:198-216): a sliding pool at or below window + page_size
    admits no request. gpt-oss (window 128) at 7,000,000 B: full = int(7,000,000 // 44,236.8) = 158, sliding =
    int(158 x 0.8) = 126 <= 128 + 1."""
    with pytest.raises(CalcError) as e:
        sglang_sizing(presets["gpt-oss-20b"], 7_000_000)
    assert e.value.problems[0].startswith("SWA pool (126 tokens) cannot hold even one request: the prefill "
                                          "admission floor is sliding_window_size (128) + page_size (1).")


# ----------------------------------------------------------------------------- the reconciler, 0.5.23's lines
LOG_0523 = """\
[2026-05-02 10:00:00] server_args=ServerArgs(model_path='meta-llama/Meta-Llama-3-8B', kv_cache_dtype='auto', mem_fraction_static=0.875, tp_size=1)
[2026-05-02 10:00:05 TP0] Load weight begin. avail mem=80.00 GB
[2026-05-02 10:00:09 TP0] Load weight end. elapsed=3.90 s, type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=64.50 GB, mem usage=15.50 GB.
[2026-05-02 10:00:09 TP0] Reserving 1.10 GB of the KV budget for post-sizing multimodal allocations (feature-transport pools + embedding cache).
[2026-05-02 10:00:09 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 437472, K size: 26.70 GB, V size: 26.70 GB"""


def test_reconciler_reads_the_reserve_and_the_dtype(presets):
    """A log in 0.5.23's words (the lines its logger.info calls print: kv_cache_configurator.py:214-218,
    memory_pool.py:2088-2090), figures from test_rest_takes_the_multimodal_reserve's cuda_ipc case: 437,472
    tokens. Without the 1.10 GB reserve the avail mem figures give 446,464 +- their rounding (about 1,100
    tokens each way), which 437,472 is outside; with it, 437,472 is inside. K = (437,472 + 1) x 8 x 128 x 32 x 2
    = 28,670,230,528 B = 26.70 GB."""
    log = parse_sglang_log(LOG_0523)
    assert (log.tokens, log.dtype, log.mm_reserve_gb) == (437_472, "bf16", 1.10)
    rows, notes = reconcile_sglang(presets["llama-3-8b"], log)
    assert all(r.agrees for r in rows), [r.to_dict() for r in rows]
    assert "less the 1.10 GB multimodal reserve" in rows[0].why and not notes
    plain = parse_sglang_log(LOG_0523.replace("Reserving 1.10 GB", "Reserving nothing"))
    assert plain.mm_reserve_gb == 0.0
    assert not reconcile_sglang(presets["llama-3-8b"], plain)[0][0].agrees
