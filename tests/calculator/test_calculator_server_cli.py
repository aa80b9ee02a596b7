"""`memory --engine` and `memory --reconcile`: the JSON engine object, the reconciler's rows, and
garbage, truncated or hostile logs answered with a sentence, never a traceback (fuzzed)."""
from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvviz.cli.main import main
from kvviz.calculator import CalcError, load_presets
from kvviz.calculator.server_log import parse_vllm_log, reconcile
from kvviz.calculator.server_vllm import VLLMSettings
from memory_cli_checks import run_error, run_json

REAL = """\
(EngineCore_DP0 pid=1) INFO 09-21 [gpu_worker.py:276] Available KV cache memory: 30.00 GiB
(EngineCore_DP0 pid=1) INFO 09-21 [kv_cache_utils.py:849] GPU KV cache size: 245,760 tokens
(EngineCore_DP0 pid=1) INFO 09-21 [kv_cache_utils.py:853] Maximum concurrency for 8,192 tokens per request: 30.00x
ValueError: To serve at least one request with the models's max seq len (8193), (1.00 GiB KV cache is needed, which is larger than the available KV cache memory (1.00 GiB). Based on the available memory, the estimated maximum model length is 8192. Try
"""


def test_engine_json_object(capsys):
    d = run_json(capsys, "--preset", "gpt-oss-20b", "--engine", "vllm", "--kv-memory-gib", "10",
                 "--max-model-len", "131072")
    e = d["engine"]
    assert e["name"] == "vllm" and e["block_size"] == 16
    # vLLM 0.33: 2 x 2,048 tokens in flight, so the sliding group holds ceil((127 + 4,096) / 16) + 1 = 265
    # blocks; int(27,306 / 8,457 x 131,072) = 423,205 tokens (kv_cache_utils.py:1120-1128)
    assert (e["num_blocks"], e["kv_cache_tokens"], e["fits"]) == (27_306, 423_205, True)
    assert round(e["max_concurrency"], 2) == 3.23 and e["estimated_max_model_len"] is None
    assert [(g["kind"], g["n_layers"], g["page_size_bytes"]) for g in e["groups"]] == [
        ("sliding", 12, 32_768), ("full", 12, 32_768)]
    assert e["needed_bytes"] == 12 * 32_768 * (265 + 8192)
    assert e["available_kv_source"] == "given (exact)" and e["estimate"] is None
    assert run_json(capsys, "--preset", "gpt2", "--seq-len", "8")["engine"] is None


def test_engine_too_long_and_fp8(capsys):
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "vllm", "--kv-memory-gib", "1", "--max-model-len",
                 "16384", "--kv-cache-dtype", "fp8")
    # fp8 halves the page: 1 GiB // (32 x 32,768 B) = 1,024 blocks = 16,384 tokens exactly, but the too-long
    # check holds the null block back (kv_cache_planning.py:1528-1537): 1,023 blocks fit, 16,368 tokens
    assert not d["engine"]["fits"] and d["engine"]["estimated_max_model_len"] == 16368
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "vllm", "--kv-memory-gib", "1", "--max-model-len",
                 "16368", "--kv-cache-dtype", "fp8")
    assert d["engine"]["fits"] and d["engine"]["num_blocks"] == 1024
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "vllm", "--kv-memory-gib", "1", "--max-model-len", "16384")
    assert not d["engine"]["fits"] and d["engine"]["estimated_max_model_len"] == 8176


def test_engine_estimate_states_its_parts(capsys):
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "vllm", "--seq-len", "8192", "--gpu-model", "h100-sxm")
    est = d["engine"]["estimate"]
    assert d["engine"]["available_kv_source"] == "estimated from the GPU"
    assert est["available_bytes"] == sum(p["bytes"] for p in est["parts"]) and est["uncertainty_bytes"] > 0
    assert "weights" in est["parts"][1]["what"]


def test_engine_refusals(capsys):
    assert "tp 3 does not divide the 64 attention heads" in run_error(
        capsys, "--preset", "llama-3-70b", "--engine", "vllm", "--kv-memory-gib", "10", "--seq-len", "8", "--tp", "3")
    assert "give --kv-memory-gib" in run_error(capsys, "--preset", "llama-3-8b", "--engine", "vllm", "--seq-len", "8")


def test_llamacpp_and_sglang_cli(capsys):
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "llama.cpp", "--max-model-len", "8192")
    assert d["engine"]["kv_bytes"] == 1024 * 1024**2 and d["engine"]["log_lines"][0].startswith("llama_kv_cache: size")
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "llama.cpp", "--max-model-len", "8192", "-ctk", "q8_0")
    assert d["engine"]["caches"][0]["k_bytes"] == 272 * 1024**2
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "sglang", "--seq-len", "8192", "--kv-memory-gib", "10")
    assert d["engine"]["max_total_num_tokens"] == 81_920 and d["engine"]["exact"]


def test_reconcile_cli(tmp_path, capsys):
    f = tmp_path / "log.txt"
    f.write_text(REAL)
    d = run_json(capsys, "--preset", "llama-3-8b", "--reconcile", str(f))
    assert d["agrees"], d["rows"]
    assert [r["line"] for r in d["rows"]][:3] == ["Available KV cache memory", "GPU KV cache size",
                                                  "Maximum concurrency for 8,192 tokens"]
    f.write_text(REAL.replace("245,760", "491,520").replace("30.00x", "60.00x"))
    d = run_json(capsys, "--preset", "llama-3-8b", "--reconcile", str(f))
    tok = d["rows"][1]
    assert not tok["agrees"] and "fp8" in tok["why"]
    f.write_text("hello\nworld\n")
    assert "no vLLM KV-cache line found" in run_error(capsys, "--preset", "llama-3-8b", "--reconcile", str(f))
    assert "error:" in run_error(capsys, "--preset", "llama-3-8b", "--reconcile", str(tmp_path / "missing.txt"))


_SPEC = load_presets()["gpt-oss-20b"]
_LINES = REAL.splitlines() + [
    "GPU blocks: 1952, # CPU blocks: 2048", "kv_cache_size=3.81GiB", "max_seq_len=4096, tensor_parallel_size=2",
    "The model's max seq len (29000) is larger than the maximum number of tokens that can be stored in KV cache (23648).",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(_LINES), st.text(max_size=200),
                          st.sampled_from(_LINES).flatmap(lambda s: st.integers(0, len(s)).map(lambda n: s[:n]))),
                max_size=12),
       st.integers(1, 1 << 20), st.sampled_from([1, 2, 8]))
def test_reconciler_fuzzed(parts, max_len, tp):
    """Garbage, truncated lines and real lines mixed: the parser and the reconciler return rows or raise
    CalcError with a sentence; nothing else escapes."""
    log = parse_vllm_log("\n".join(parts))
    try:
        rows, notes = reconcile(_SPEC, log, VLLMSettings(0, max_len, tp=tp))
    except CalcError as e:
        assert e.problems and all(isinstance(p, str) and p for p in e.problems)
        return
    assert all(isinstance(r.agrees, bool) and r.why for r in rows)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=400))
def test_reconciler_cli_never_tracebacks(tmp_path_factory, data):
    f = tmp_path_factory.mktemp("fuzz") / "log.txt"
    f.write_bytes(data)
    try:
        main(["memory", "--preset", "llama-3-8b", "--reconcile", str(f), "--max-model-len", "8192", "--json"])
    except SystemExit as e:
        assert e.code == 2


def test_length_mix_cli(tmp_path, capsys):
    f = tmp_path / "lengths.csv"
    f.write_text("length\n1024\n3500\n112\n")
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "vllm", "--kv-memory-gib", "30", "--max-model-len",
                 "32768", "--lengths", str(f))
    mix = d["engine"]["length_mix"]
    assert mix["requests"] == 3 and round(mix["concurrent_requests"], 1) == 158.9
    assert round(mix["ratio_to_max_len_sizing"], 1) == 21.2
    f.write_text("length\nabc\n")
    assert "row 2" in run_error(capsys, "--preset", "llama-3-8b", "--engine", "vllm", "--kv-memory-gib", "30",
                                "--seq-len", "8", "--lengths", str(f))


def test_engine_provenance(capsys):
    """The engine object says where its inputs came from: gpt-oss's KV heads from num_key_value_heads,
    the window from sliding_window, the block size from the flag (vLLM's default named)."""
    e = run_json(capsys, "--preset", "gpt-oss-20b", "--engine", "vllm", "--kv-memory-gib", "10", "--seq-len", "1000",
                 "--tp", "2")["engine"]
    prov = e["provenance"]
    assert prov["kv_heads_per_gpu"] == "max(1, n_kv_heads // tp 2); n_kv_heads: config.json num_key_value_heads = 8"
    assert prov["sliding_window"] == "config.json sliding_window = 128"
    assert prov["block_size"].startswith("16: --block-size") and "Available KV cache memory" in prov["available_kv_bytes"]
    d = run_json(capsys, "--preset", "gpt-oss-20b", "--engine", "sglang", "--kv-memory-gib", "10", "--seq-len", "8")
    assert d["engine"]["log_line"].startswith("Use sliding window memory pool.")  # SGLang's hybrid SWA pools


def test_reconcile_profiling_parts(tmp_path, capsys):
    """vllm#10517's V0 lines: 'Loading model weights took 14.9888 GB' (V0's GB is 2^30 bytes) beside
    Llama-3.1-8B's 8,030,261,248 bf16 parameters (14.96 GiB: within 2%), and non_torch_memory=0.35GiB
    inside the estimate's 0.50 +- 0.40 GiB."""
    f = tmp_path / "log.txt"
    f.write_text("Loading model weights took 14.9888 GB\n"
                 "Memory profiling results: total_gpu_memory=23.58GiB initial_memory_usage=15.34GiB "
                 "peak_torch_memory=17.06GiB memory_usage_post_profile=15.35GiB non_torch_memory=0.35GiB "
                 "kv_cache_size=3.81GiB gpu_memory_utilization=0.90\n"
                 "GPU blocks: 1952, # CPU blocks: 2048\nMaximum concurrency for 20000 tokens per request: 1.56x\n")
    d = run_json(capsys, "--preset", "llama-3-8b", "--reconcile", str(f), "--weight-dtype", "bf16")
    rows = {r["line"]: r for r in d["rows"]}
    assert rows["model weights (profiling)"]["agrees"] and rows["model weights (profiling)"]["predicted"] == "14.96 GiB"
    assert rows["non-torch memory (profiling)"]["agrees"] and d["agrees"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_huge_kv_memory_is_an_error_not_an_overflow(capsys, engine):
    # 1e300 GiB passed argparse's finite check but overflowed int(gib x 2^30) into a traceback.
    err = run_error(capsys, "--preset", "smollm2-135m", "--seq-len", "4096", "--engine", engine,
                    "--kv-memory-gib", "1e300")
    assert "error: the KV memory must be a positive number of GiB up to 1,000,000" in err


def test_sglang_empty_pool_is_sglangs_error(capsys):
    # A GPU too small for the weights left a negative rest memory and a silent "#tokens: 0" pool. SGLang 0.5.23
    # refuses a rest <= 0 with its own sentence (mem_cache/kv_cache_configurator.py:3043-3058), and a budget
    # that holds no token with "Not enough memory" (model_executor/pool_configurator.py:94-100).
    err = run_error(capsys, "--preset", "smollm2-135m", "--seq-len", "4096", "--engine", "sglang", "--gpu", "0.001")
    assert "do not fit in the GPU's 0.001 GiB: SGLang fails while loading them" in err
    # 'avail mem' 10 GB before, 0.5 after, 0.9: 0.5 - 1.0 < 0; minimum = 1 - 0.5 / 10 = 0.95
    err = run_error(capsys, "--preset", "smollm2-135m", "--engine", "sglang", "--seq-len", "8", "--avail-mem-gib", "10,0.5")
    assert ("error: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.9. Raise "
            "--mem-fraction-static above 0.950 (minimum viable = 1 - available/pre = 0.9500).") in err
    # 1.00001 - 10 x 0.1 = 0.00001 GB = 10,737 B: no 30 x 3 x 64 x 2 x 2 = 23,040-byte SmolLM2 token
    err = run_error(capsys, "--preset", "smollm2-135m", "--engine", "sglang", "--seq-len", "8", "--avail-mem-gib", "10,1.00001")
    assert "error: Not enough memory. Please try to increase --mem-fraction-static." in err


def test_llamacpp_refuses_more_than_256_sequences(capsys):
    # llama-context.cpp throws "n_seq_max must be <= 256" (LLAMA_MAX_SEQ); kvviz printed 0-cell streams.
    err = run_error(capsys, "--preset", "smollm2-135m", "--seq-len", "4096", "--engine", "llama.cpp",
                    "--parallel", "257")
    assert "error: argument --parallel/-np: expected an integer from 1 to 256 (llama.cpp's n_seq_max)" in err
    assert run_json(capsys, "--preset", "smollm2-135m", "--seq-len", "65536", "--engine", "llama.cpp",
                    "--parallel", "256")["engine"]["caches"][0]["cells"] == 256
