"""The gemma-3-270m preset (what `memory --preset gemma-3-270m` prints): its parameter
count, its per-layer KV bytes and vLLM's / llama.cpp's figures, all worked by hand here.

Independent reference for the count: the tensor shapes of gemma-3-270m-q4_k_m.gguf (sha256
a5fd3b62...6818, read with gguf.GGUFReader): token_embd 262,144 x 640 (no output.weight: tied),
output_norm 640, and per block attn_q 640 x 1,024, attn_k and attn_v 640 x 256, attn_output
1,024 x 640, q/k norms 256 each, four 640-wide norms, ffn gate/up 640 x 2,048 and down
2,048 x 640 = 5,573,632 a block; 18 x 5,573,632 + 167,772,160 + 640 = 268,098,176. The header
agrees with the preset: block_count 18, embedding_length 640, feed_forward_length 2048,
head_count 4, head_count_kv 1, key/value_length 256, sliding_window 512, context_length 32768.
"""
from __future__ import annotations

import json

import pytest

from kvviz.cli.main import main
from kvviz.calculator import MemoryRequest, calculate, load_presets
from kvviz.calculator.server_llamacpp import llamacpp_sizing
from kvviz.calculator.server_vllm import VLLMSettings, vllm_sizing
from kvviz.units import GIB

MIB = 1024**2
SPEC = load_presets()["gemma-3-270m"]
BLOCK = 640 * 1024 + 640 * 256 * 2 + 1024 * 640 + 256 * 2 + 640 * 4 + 640 * 2048 * 3


def test_shape_and_exact_parameter_count_from_the_gguf_tensors() -> None:
    assert BLOCK == 5_573_632
    assert SPEC.params == 18 * BLOCK + 262_144 * 640 + 640 == 268_098_176
    assert (SPEC.n_layers, SPEC.n_heads, SPEC.n_kv_heads, SPEC.head_dim, SPEC.hidden, SPEC.max_positions,
            SPEC.vocab_size) == (18, 4, 1, 256, 640, 32_768, 262_144)
    assert [i for i in range(18) if not SPEC.layer(i).caps] == [5, 11, 17]  # every 6th layer is global
    assert {SPEC.layer(i).span for i in range(18) if SPEC.layer(i).caps} == {512}
    assert SPEC.window_summary() == "15 layers x 512, 3 global layers"


# One token on one layer: 1 KV head x 256 head_dim x 2 (K, V) x 2 bytes (bf16) = 1,024 B.
# 15 sliding layers hold min(L, 512) tokens, the 3 global layers hold L.
@pytest.mark.parametrize("seq_len, expected", [
    (100, 18 * 100 * 1024),                         # 1,843,200: below the window every layer holds all
    (512, 18 * 512 * 1024),                         # 9,437,184: the window just full
    (513, 15 * 512 * 1024 + 3 * 513 * 1024),        # 9,440,256: only the global layers grow
    (32_768, 15 * 512 * 1024 + 3 * 32_768 * 1024),  # 108,527,616 at the full context
])
def test_kv_bytes_by_hand(seq_len: int, expected: int) -> None:
    assert calculate(SPEC, MemoryRequest(seq_len=seq_len, kv_dtype="bf16")).kv_bytes == expected


def test_vllm_groups_blocks_and_concurrency_by_hand() -> None:
    """vLLM 0.33 v1/core/kv_cache_planning.py:416-560: 3 full and 15 sliding layers -> group size 3
    (15 >= 1.5 x 3), 1 full group + 5 sliding groups, no padding. Page 16 x 1 x 256 x 2 x 2 = 16,384 B.
    10 GiB // (3 x 16,384) = 218,453 blocks. One 32,768 request: full 2,048 blocks, each sliding group
    cdiv(min(511 + 2 x 2,048 in flight, 32,768), 16) + 1 = 289 (kv_cache_interface.py:937-944,
    config/vllm.py:588-609): 2,048 + 5 x 289 = 3,493; 218,453 / 3,493 = 62.54x, and the tokens
    int(62.5402... x 32,768) = 2,049,318 (kv_cache_utils.py:1120-1128)."""
    v = vllm_sizing(SPEC, VLLMSettings(10 * GIB, 32_768))
    assert v.page_bytes == 16_384 and v.group_size == 3
    assert sorted((g.kind, len(g.layers)) for g in v.groups) == [("full", 3)] + [("sliding", 3)] * 5
    assert (v.num_blocks, v.kv_cache_tokens) == (218_453, 2_049_318)
    assert sum(g.blocks_per_request for g in v.groups) == 2_048 + 5 * 289
    assert v.lines[1] == ("GPU KV cache size: 2,049,318 tokens, Maximum concurrency for 32,768 tokens per request: "
                          "62.54x")


def test_vllm_too_long_and_its_estimate_by_hand() -> None:
    """0.1 GiB = 107,374,182 B, less the null block 3 x 16,384 = 49,152 B (kv_cache_planning.py:1528-1537):
    107,325,030 B. Needed: 3 layers x 16,384 x 3,493 = 171,687,936 B (0.16 GiB). The longest L that fits:
    49,152 x (cdiv(L, 16) + 5 x 289) <= 107,325,030 -> cdiv(L, 16) <= 738 -> 11,808."""
    v = vllm_sizing(SPEC, VLLMSettings(int(0.1 * GIB), 32_768))
    assert not v.fits and v.needed_bytes == 171_687_936 and v.estimated_max_model_len == 11_808


def test_llamacpp_swa_cache_by_hand() -> None:
    """src/llama-kv-cache-iswa.cpp: the 3 global layers get 32,768 cells, the 15 sliding ones
    512 + n_ubatch 512 = 1,024; a K row is 256 f16 values = 512 B."""
    full, swa = llamacpp_sizing(SPEC, 32_768).caches
    assert (full.cells, full.layers, full.k_bytes) == (32_768, 3, 3 * 512 * 32_768)  # 48 MiB
    assert (swa.cells, swa.layers, swa.k_bytes) == (1_024, 15, 15 * 512 * 1_024)  # 7.5 MiB
    assert full.k_bytes == 48 * MIB


def test_cli_preset(capsys) -> None:
    assert main(["memory", "--preset", "gemma-3-270m", "--seq-len", "32768", "--dtype", "bf16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["preset"], d["params"], d["kv_bytes"]) == ("gemma-3-270m", 268_098_176, 108_527_616)
