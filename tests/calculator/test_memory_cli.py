"""``python -m kvviz memory``: one JSON object on stdout, argparse-style errors with exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvviz.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["memory", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one object, nothing else


def run_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["memory", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "kvviz memory: error:" in err and "Traceback" not in err
    return err


def test_contract_keys_and_values(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--preset", "llama-3-8b", "--seq-len", "8192", "--dtype", "bf16")
    assert {"kv_bytes_per_token", "kv_bytes", "weights_bytes", "warnings"} <= set(d)
    assert d["kv_bytes_per_token"] == 131_072 and d["kv_bytes"] == 1024**3
    assert d["kv_bytes_mha"] == 4 * 1024**3
    assert d["weights_bytes"] == 2 * 8_030_261_248 and d["warnings"] == []
    assert d["source"].endswith("Meta-Llama-3-8B/blob/main/config.json")


def test_all_options(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--preset", "Llama-2-7B", "--seq-len", "1000", "--batch", "2", "--beams", "3", "--dtype", "int4",
                 "--group-size", "32", "--zero-point", "--paged", "--block-size", "16", "--weight-dtype", "int8",
                 "--gpu", "80", "--reserve", "0.2")
    per_vector = 64 + (128 // 32) * 2 * 2  # packed int4 + one fp16 scale and zero point per 32 values
    assert d["kv_bytes_per_token"] == 32 * 2 * 32 * per_vector
    assert d["kv_bytes"] == 6 * 1008 * d["kv_bytes_per_token"]
    assert d["paging_waste_bytes"] == 6 * 8 * d["kv_bytes_per_token"]
    assert d["weights_bytes"] == 6_738_415_616
    gpu = d["gpu"]
    assert gpu["fits"] is True and gpu["usable_bytes"] == int(80 * 1024**3 * 0.8)
    assert gpu["max_batch"] > 2 and gpu["max_seq_len"] > 1000


def test_windows_beyond_max_positions_and_no_windows(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--preset", "mistral-7b-v0.1", "--seq-len", "65536")
    assert d["kv_bytes"] == 131_072 * 4096 and any("max_position_embeddings" in w for w in d["warnings"])
    d = run_json(capsys, "--preset", "mistral-7b-v0.1", "--seq-len", "65536", "--no-windows")
    assert d["kv_bytes"] == 131_072 * 65536


def test_config_file_and_params(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mamba-ish", "num_hidden_layers": 4, "num_attention_heads": 8,
                               "num_key_value_heads": 2, "hidden_size": 512}))
    d = run_json(capsys, "--config", str(cfg), "--seq-len", "100")
    assert d["kv_bytes"] == 100 * 4 * 2 * 2 * 64 * 2 and d["weights_bytes"] is None
    assert any("--params" in w for w in d["warnings"])
    d = run_json(capsys, "--config", str(cfg), "--seq-len", "100", "--params", "1.5B", "--weight-dtype", "fp32")
    assert d["weights_bytes"] == 6_000_000_000


def test_human_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", "--preset", "deepseek-v2", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "MLA" in out and "GiB" in out and "GB" in out and "512 kv_lora_rank + 64 qk_rope_head_dim" in out


def test_list_presets(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--list-presets")
    keys = [p["key"] for p in d["presets"]]
    assert len(keys) >= 22 + 5 and "kvviz:random:tiny-gqa" in keys and "falcon-7b" in keys


def test_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "--seq-len" in run_error(capsys, "--preset", "gpt2")
    assert "unknown preset" in run_error(capsys, "--preset", "gpt-5", "--seq-len", "1")
    assert "one of the arguments" in run_error(capsys, "--seq-len", "1")
    assert "--seq-len: expected an integer from 1 to" in run_error(capsys, "--preset", "gpt2", "--seq-len", "0")
    assert "invalid choice" in run_error(capsys, "--preset", "gpt2", "--seq-len", "1", "--dtype", "fp64")
    assert "parameter count" in run_error(capsys, "--preset", "gpt2", "--seq-len", "1", "--params", "lots")
    assert "no such file" in run_error(capsys, "--config", str(tmp_path / "nope.json"), "--seq-len", "1")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama", "num_hidden_layers": -2, "num_attention_heads": 5, "hidden_size": 64}')
    err = run_error(capsys, "--config", str(bad), "--seq-len", "1")
    assert "num_hidden_layers must be positive" in err and "5 attention heads do not divide hidden size 64" in err
    bad.write_text("{oops")
    assert "not valid JSON" in run_error(capsys, "--config", str(bad), "--seq-len", "1")


def test_module_entry_point_prints_only_json() -> None:
    out = subprocess.run([sys.executable, "-m", "kvviz", "memory", "--preset", "opt-13b", "--seq-len", "1", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout)["kv_bytes_per_token"] == 800 * 1024


# ---------------------------------------------------- per-layer layouts, tensor parallelism, cost
def test_layers_breakdown_and_state_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--preset", "qwen3-next-80b-a3b", "--seq-len", "1000", "--dtype", "bf16",
                 "--weight-dtype", "bf16")
    assert d["layers"] == [
        {"kind": "full", "span": None, "count": 12, "tokens_held": 1000, "bytes": 12 * 1000 * 2048,
         "bytes_per_gpu": 12 * 1000 * 2048, "state_bytes": 0},
        {"kind": "linear", "span": None, "count": 36, "tokens_held": 0, "bytes": 0, "bytes_per_gpu": 0,
         "state_bytes": 36 * 1_097_728},
    ]
    assert d["kv_bytes"] == 12 * 1000 * 2048 and d["state_bytes"] == 36 * 1_097_728 and d["state_dtype"] == "bf16"
    d = run_json(capsys, "--preset", "gemma-3-1b", "--seq-len", "1000", "--dtype", "bf16")
    assert [(g["kind"], g["span"], g["count"], g["tokens_held"]) for g in d["layers"]] == [
        ("sliding", 512, 22, 512), ("full", None, 4, 1000)]
    assert d["state_bytes"] == 0 and d["state_dtype"] is None


def test_state_dtype_flag(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--preset", "qwen3-next-80b-a3b", "--seq-len", "1", "--state-dtype", "fp32")
    assert d["state_bytes"] == 36 * (8192 * 3 + 32 * 128 * 128) * 4


def test_tp_per_gpu_and_replication(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--preset", "llama-3-8b", "--seq-len", "8192", "--dtype", "bf16", "--tp", "16")
    assert (d["tp"], d["kv_heads_per_gpu"], d["kv_head_replication"]) == (16, 1, 2)
    assert d["kv_bytes"] == 1024**3 and d["kv_bytes_per_gpu"] == 1024**3 // 8
    assert d["weights_bytes_per_gpu"] == -(-2 * 8_030_261_248 // 16)
    assert any("replicated 2x" in w for w in d["warnings"])
    d = run_json(capsys, "--preset", "deepseek-v2", "--seq-len", "100", "--tp", "8")
    assert d["kv_bytes_per_gpu"] == d["kv_bytes"] and d["kv_heads_per_gpu"] is None
    err = run_error(capsys, "--preset", "llama-3-8b", "--seq-len", "1", "--tp", "3")
    assert "tp 3 neither divides nor is a multiple of the 8 KV heads" in err
    assert "--tp: expected an integer from 1 to 1,024 (GPUs)" in run_error(capsys, "--preset", "gpt2", "--seq-len", "1",
                                                                           "--tp", "5000")


def test_gpu_model_bandwidth_price_and_cost(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--preset", "llama-3-8b", "--seq-len", "8192", "--dtype", "bf16", "--weight-dtype", "bf16",
                 "--gpu-model", "h100-sxm")
    assert d["gpu"]["gib"] == 80 and d["gpu"]["fits"] is True
    c = d["cost"]
    moved = 2 * 8_030_261_248 + 2**30
    assert c["bandwidth_bytes_per_s"] == 3350e9 and c["efficiency"] == 0.7 and c["bytes_per_step_per_gpu"] == moved
    assert c["tokens_per_s"] == pytest.approx(3350e9 * 0.7 / moved)
    assert c["usd_per_million_tokens"] == pytest.approx(2.5 / (c["tokens_per_s"] * 3600) * 1e6)
    assert c["kind"].startswith("upper-bound")
    d = run_json(capsys, "--preset", "llama-3-8b", "--seq-len", "8192", "--gpu-model", "h100-sxm", "--gpu", "40",
                 "--bandwidth", "1000", "--price", "0", "--efficiency", "0.5")
    assert d["gpu"]["gib"] == 40 and d["cost"]["bandwidth_bytes_per_s"] == 1e12
    assert d["cost"]["usd_per_million_tokens"] == 0 and d["cost"]["efficiency"] == 0.5
    d = run_json(capsys, "--preset", "llama-3-8b", "--seq-len", "8192", "--bandwidth", "1000")
    assert d["cost"]["usd_per_million_tokens"] is None and d["gpu"] is None
    assert "fraction in (0, 1]" in run_error(capsys, "--preset", "gpt2", "--seq-len", "1", "--efficiency", "2")
    assert "invalid choice" in run_error(capsys, "--preset", "gpt2", "--seq-len", "1", "--gpu-model", "tpu")
    assert "positive GB/s" in run_error(capsys, "--preset", "gpt2", "--seq-len", "1", "--bandwidth", "-3")


def test_human_text_shows_kinds_tp_and_cost(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", "--preset", "gpt-oss-20b", "--seq-len", "4096", "--tp", "2", "--gpu-model", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "12 sliding (window 128) layers: 128 tokens each" in out and "12 full layers: 4,096 tokens each" in out
    assert "per GPU (tp 2):" in out and "decode roofline (upper bound):" in out and "$ per 1M tokens" in out


def test_list_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--list-gpus")
    assert [g["key"] for g in d["gpus"]] == ["h100-sxm", "h200", "a100-80gb", "l40s", "l4", "rtx-4090"]
    assert all(g["source"].startswith("https://") for g in d["gpus"])
