"""``kvviz watch`` and the Live server page's reading: a real vLLM's /metrics (captured from vLLM
0.32's CPU build serving SmolLM2 after 8 requests, tests/data/), SGLang's and llama.cpp's names,
Prometheus' quantile rule by hand, and every way a server can fail to answer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvviz.cli.main import main
from kvviz.calculator.presets import find_preset, load_presets
from kvviz.watch.scrape import ScrapeError, fetch_text, parse_target
from kvviz.watch.server_calc import match_preset, server_calc
from kvviz.watch.server_metrics import Histogram, rates, read_metrics
from kvviz.watch.watch import read_server

from fake_server import serve

DATA = Path(__file__).resolve().parents[1] / "data"
VLLM = (DATA / "vllm_metrics_smollm2.txt").read_text()
MODELS = (DATA / "vllm_models_smollm2.json").read_text()

SGLANG = """# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen3-8B"} 0.25
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="Qwen/Qwen3-8B"} 1000.0
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="Qwen/Qwen3-8B"} 4000.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen3-8B"} 3.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen3-8B"} 1.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="Qwen/Qwen3-8B"} 800.0
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="Qwen/Qwen3-8B"} 200.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="Qwen/Qwen3-8B"} 5000.0
"""
LLAMACPP = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 96641
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 23210
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def test_a_real_vllm_reading() -> None:
    r = read_metrics(VLLM, json.loads(MODELS))
    assert (r.engine, r.model, r.max_model_len) == ("vllm", "HuggingFaceTB/SmolLM2-135M-Instruct", 2048)
    assert (r.requests_running, r.requests_waiting, r.kv_cache_usage, r.preemptions) == (0.0, 0.0, 0.0, 0.0)
    # 8 requests of 5 prompt tokens, 32 generated each (the capture's workload)
    assert (r.prefix_cache_queries, r.prefix_cache_hits, r.prompt_tokens, r.generation_tokens) == (40.0, 0.0, 40.0, 256.0)
    assert (r.block_size, r.num_blocks, r.kv_tokens_capacity) == (128, 364, 46_592)
    assert r.ttft is not None and r.ttft.count == 8


def test_histogram_quantile_is_prometheus_rule_by_hand() -> None:
    h = read_metrics(VLLM).ttft
    # 8 TTFTs: 1 <= 0.75 s, 5 <= 2.5 s, 8 <= 5 s. p50: rank 4 in (1.0, 2.5]: 1.0 + 1.5 * (4 - 1) / (5 - 1).
    assert h.quantile(0.5) == pytest.approx(2.125)
    # p90: rank 7.2 in (2.5, 5.0]: 2.5 + 2.5 * (7.2 - 5) / (8 - 5).
    assert h.quantile(0.9) == pytest.approx(2.5 + 2.5 * 2.2 / 3)
    inf = Histogram(((1.0, 1.0), (float("inf"), 3.0)), 3.0, 9.0)
    assert inf.quantile(0.99) == 1.0  # in +Inf: the highest finite bound, as histogram_quantile says
    assert Histogram((), 0.0, 0.0).quantile(0.5) is None


def test_the_calculator_beside_vllm_equals_vllms_own_figures() -> None:
    r = read_metrics(VLLM, json.loads(MODELS))
    spec = match_preset(r.model, load_presets())
    assert spec is not None and spec.key == find_preset("smollm2-135m", load_presets()).key
    calc = server_calc(r, spec)
    # The server's own labels say kv_cache_size_tokens="46592", kv_cache_max_concurrency="22.75", and its
    # log said "CPU KV cache size: 46,592 tokens, Maximum concurrency for 2,048 tokens per request: 22.75x".
    assert calc.kv_cache_tokens == int(r.cache_config["kv_cache_size_tokens"]) == 46_592
    assert calc.max_concurrency == pytest.approx(float(r.cache_config["kv_cache_max_concurrency"]), abs=0.005)
    assert calc.max_concurrency == 364 / 16  # 2,048 tokens = 16 blocks of 128
    # 30 layers x 3 KV heads x 64 x 2 (K, V) x 2 B (bf16) x 128 tokens x 364 blocks: vLLM's 1 GiB, floored to blocks
    assert calc.kv_cache_bytes == 30 * 3 * 64 * 2 * 2 * 128 * 364


def test_sglang_and_llamacpp_readings() -> None:
    s = read_metrics(SGLANG, {"data": [{"id": "Qwen/Qwen3-8B"}]})
    assert (s.engine, s.kv_cache_usage, s.requests_running, s.requests_waiting) == ("sglang", 0.25, 3.0, 1.0)
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.kv_tokens_capacity, s.kv_tokens_used) == (800, 200, 4000, 1000)
    assert s.preemptions is None  # not counted is not zero
    calc = server_calc(s, match_preset(s.model, load_presets()))
    assert calc.kv_cache_tokens == 4000 and calc.used_tokens == 1000
    slots = [{"id": 0, "n_ctx": 4096}, {"id": 1, "n_ctx": 4096}]
    ll = read_metrics(LLAMACPP, None, slots)
    assert (ll.engine, ll.requests_running, ll.requests_waiting, ll.generation_tokens) == ("llama.cpp", 2, 1, 23210)
    assert ll.kv_cache_usage is None and ll.kv_tokens_capacity == 8192


def test_rates_from_counter_deltas_and_a_restart() -> None:
    a = read_metrics(VLLM)
    b = read_metrics(VLLM.replace("vllm:prefix_cache_queries_total{", "vllm:prefix_cache_queries_total{x=\"1\",", 1)
                     .replace(" 256.0\n", " 356.0\n"))
    rt = rates(b, a, 2.0)
    assert rt.generation_tok_s == 50.0  # 100 tokens in 2 s
    restarted = rates(a, b, 2.0)  # the counter went down: no rate rather than a negative one
    assert restarted.generation_tok_s is None


@pytest.mark.parametrize("typed, base", [
    ("localhost:8000", "http://localhost:8000"), ("http://h:8000/", "http://h:8000"),
    ("http://h:8000/metrics", "http://h:8000"), ("https://h/v1", "https://h"), ("http://[::1]:9/", "http://[::1]:9")])
def test_urls_as_people_type_them(typed: str, base: str) -> None:
    assert parse_target(typed).base == base


@pytest.mark.parametrize("typed, says", [("", "no server URL"), ("ftp://h", "only http"), ("http://", "names no host"),
                                          ("http://h:99999", "not a URL")])
def test_bad_urls_get_one_line(typed: str, says: str) -> None:
    with pytest.raises(ScrapeError, match=says):
        parse_target(typed)


def test_every_failure_is_one_clear_line(tmp_path: Path) -> None:
    with serve({"/metrics": (200, VLLM.encode()), "/v1/models": (200, MODELS.encode())},
               need_header=("Authorization", "Bearer k")) as url:
        with pytest.raises(ScrapeError, match="HTTP 401.*--header"):
            fetch_text(parse_target(url), "/metrics")
        ok = read_server(parse_target(url, ["Authorization: Bearer k"]), load_presets())
        assert ok.calc.kv_cache_tokens == 46_592
    with serve({"/metrics": (200, b"<html>hello</html>")}) as url:
        with pytest.raises(ScrapeError, match="not Prometheus|not vLLM"):
            read_server(parse_target(url), {})
    with serve({"/metrics": (200, b"\xff\xfe\x00binary")}) as url:
        with pytest.raises(ScrapeError, match="not UTF-8"):
            read_server(parse_target(url), {})
    with serve({"/metrics": (200, b"# TYPE x gauge\nx 1\n")}) as url:
        with pytest.raises(ScrapeError, match="not vLLM's, SGLang's or llama.cpp's"):
            read_server(parse_target(url), {})
    with serve({"/metrics": (200, VLLM.encode())}, delay_s=1.0) as url:
        with pytest.raises(ScrapeError, match="no answer within 0.2 s"):
            fetch_text(parse_target(url), "/metrics", timeout_s=0.2)
    with serve({}) as url:
        port = url.rsplit(":", 1)[1]
    with pytest.raises(ScrapeError, match="connection refused"):
        fetch_text(parse_target(f"http://127.0.0.1:{port}"), "/metrics")


def test_a_server_without_v1_models_still_reads(capsys: pytest.CaptureFixture[str]) -> None:
    with serve({"/metrics": (200, VLLM.encode())}) as url:
        snap = read_server(parse_target(url), load_presets())
    assert snap.reading.model is None and "no model name" in snap.notes[0]
    assert snap.calc.why_not and "does not know the served model" in snap.calc.why_not


def test_watch_once_json_equals_metrics_read_directly(capsys: pytest.CaptureFixture[str]) -> None:
    with serve({"/metrics": (200, VLLM.encode()), "/v1/models": (200, MODELS.encode())}) as url:
        assert main(["watch", url, "--once", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    direct = read_metrics(VLLM, json.loads(MODELS))
    for key in ("engine", "model", "kv_cache_usage", "requests_running", "requests_waiting", "prefix_cache_queries",
                "prefix_cache_hits", "preemptions", "generation_tokens", "block_size"):
        assert obj[key] == getattr(direct, key), key
    assert obj["calculator"] == {"kv_cache_tokens": 46_592, "max_concurrency": 22.75}


def test_watch_counts_readings_and_refused_server_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with serve({"/metrics": (200, VLLM.encode()), "/v1/models": (200, MODELS.encode())}) as url:
        assert main(["watch", url, "--count", "2", "--interval", "0.2"]) == 0
    out = capsys.readouterr().out
    assert out.count("vllm HuggingFaceTB/SmolLM2-135M-Instruct") == 2
    assert "the pool holds 46,592 tokens, maximum concurrency 22.75x at 2,048 tokens" in out
    with serve({}) as url:
        dead = url
    with pytest.raises(SystemExit) as e:
        main(["watch", dead, "--once"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "connection refused" in err and "Traceback" not in err


@pytest.mark.parametrize("config, gib, max_len, tokens, conc", [
    # vLLM 0.32's CPU build, 2026-11-28, on this machine: "CPU KV cache size: 46,592 tokens, Maximum
    # concurrency for 2,048 tokens per request: 22.75x" for SmolLM2-135M-Instruct itself.
    ("smollm2", 1.0, 2048, 46_592, "22.75"),
    # ... and "CPU KV cache size: 247,802 tokens, Maximum concurrency for 32,768 tokens per request: 7.56x"
    # for Gemma 3 270M's config with dummy weights: 5 sliding groups of 21 blocks (511 + 2,048 batched
    # tokens: the CPU build schedules synchronously, one step in flight) and 1 global group of 256.
    ("gemma3-270m", 1.0, 32768, 247_802, "7.56"),
])
def test_the_vllm_cpu_lines_seen_on_this_machine(config: str, gib: float, max_len: int, tokens: int, conc: str) -> None:
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm_layouts import LAYOUTS

    from kvviz.calculator.server_vllm import VLLMSettings, vllm_sizing
    from kvviz.calculator.hf_config import parse_config

    s = vllm_sizing(parse_config(LAYOUTS[config], config),
                    VLLMSettings(kv_memory_bytes=int(gib * (1 << 30)), max_model_len=max_len, block_size=128,
                                 kv_dtype="bf16", max_num_batched_tokens=2048, device="cpu"))
    assert (s.tokens_newest, f"{s.max_concurrency:.2f}") == (tokens, conc)
