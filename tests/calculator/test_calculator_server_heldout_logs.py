"""Issue 41's held-out set, round 2: real startup figures posted in public issues, reproduced by the
sizing rules written from the engines' source (the code was not fitted to them). Each case writes down
the model's published config.json fields the sizing reads, the flags the issue states, the logged lines,
and the URL. Earlier held-out logs: tests/calculator/test_calculator_servers.py (vllm#10517, LMCache#1739,
vllm-project/recipes#12, vllm#21348, vllm#27508, vllm#34076) and test_calculator_server_rules.py (vllm#19996).
"""
from __future__ import annotations

from kvviz.calculator import parse_config
from kvviz.calculator.server_llamacpp import llamacpp_sizing
from kvviz.calculator.server_log import parse_vllm_log, reconcile
from kvviz.calculator.server_sglang import sglang_sizing
from kvviz.calculator.server_vllm import VLLMSettings, vllm_sizing
from kvviz.units import GIB

MIB = 1024**2

DEEPSEEK_V2_LITE = {  # https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json (MLA)
    "model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "hidden_size": 2048, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "max_position_embeddings": 163840}
GEMMA3_270M = {  # https://huggingface.co/google/gemma-3-270m/blob/main/config.json (5 sliding : 1 full)
    "model_type": "gemma3_text", "hidden_size": 640, "head_dim": 256, "num_attention_heads": 4,
    "num_hidden_layers": 18, "num_key_value_heads": 1, "max_position_embeddings": 32768, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3}
QWEN3_30B_A3B = {  # https://huggingface.co/Qwen/Qwen3-30B-A3B-Instruct-2507/blob/main/config.json
    "model_type": "qwen3_moe", "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "hidden_size": 2048, "max_position_embeddings": 262144}


def agree(config: dict, log: str, settings: VLLMSettings) -> list[dict]:
    rows, _ = reconcile(parse_config(config), parse_vllm_log(log), settings)
    assert len(rows) >= 2
    assert all(r.agrees for r in rows), [r.to_dict() for r in rows if not r.agrees]
    return [r.to_dict() for r in rows]


def test_vllm_mla_too_long_deepseek_v2_lite():
    """https://github.com/vllm-project/vllm/issues/15871 (DeepSeek-V2-Lite-Chat, vLLM 0.8.3 V1, max seq len
    32,768): "(0.95 GiB KV cache is needed, which is larger than the available KV cache memory (0.93 GiB)".
    MLA keeps one latent of 512 + 64 values a token and layer (kv_cache_interface.py's MLA page): 27 x 576 x
    2 B = 31,104 B a token; 32,768 tokens = 1,019,215,872 B = 0.949 GiB -> "0.95"."""
    rows = agree(DEEPSEEK_V2_LITE, (
        "ERROR 04-02 12:33:23 [core.py:380] ValueError: To serve at least one request with the models's max seq len "
        "(32768), (0.95 GiB KV cache is needed, which is larger than the available KV cache memory (0.93 GiB). Try "
        "increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."),
        VLLMSettings(0, 32768, block_size=64))
    assert rows[1]["predicted"] == "0.95 GiB (1,019,215,872 B)"


PP_LOG = """\
(VllmWorker rank=3 pid=19834) INFO 07-09 09:47:45 [gpu_worker.py:233] Available KV cache memory: 11.33 GiB
(VllmWorker rank=2 pid=19833) INFO 07-09 09:47:45 [gpu_worker.py:233] Available KV cache memory: 11.33 GiB
(VllmWorker rank=1 pid=19832) INFO 07-09 09:47:45 [gpu_worker.py:233] Available KV cache memory: 12.13 GiB
(VllmWorker rank=0 pid=19831) INFO 07-09 09:47:45 [gpu_worker.py:233] Available KV cache memory: 12.13 GiB
INFO 07-09 09:47:46 [kv_cache_utils.py:716] GPU KV cache size: 807,792 tokens
INFO 07-09 09:47:46 [kv_cache_utils.py:720] Maximum concurrency for 1,024 tokens per request: 788.86x"""


def test_vllm_pipeline_split_mla_deepseek_v2_lite():
    """https://github.com/vllm-project/vllm/pull/20665: `vllm serve deepseek-ai/DeepSeek-V2-Lite --max-model-len=1024
    --tensor-parallel-size=2 --pipeline-parallel-size=2` on L4s. get_pp_indices splits 27 layers 14 + 13
    (vllm/distributed/utils.py); MLA is not split by TP; a 16-token page is 16 x 576 x 2 = 18,432 B. Stage 0
    (ranks 0-1, 12.13 GiB): 14 x 18,432 = 258,048 B a block, 12.125-12.135 GiB // that = 50,452-50,493 blocks;
    stage 1 (ranks 2-3, 11.33 GiB): 13 x 18,432 = 239,616 B, 50,748-50,793 blocks. vLLM keeps the smaller:
    stage 0's, 807,232-807,888 tokens; the log's 807,792 = 50,487 blocks x 16, and 50,487 / 64 blocks a
    request = 788.86x."""
    agree(DEEPSEEK_V2_LITE, PP_LOG, VLLMSettings(0, 1024, tp=2, pp=2))
    spec = parse_config(DEEPSEEK_V2_LITE)
    stages = (int(12.13 * GIB), int(11.33 * GIB))
    v = vllm_sizing(spec, VLLMSettings(stages[0], 1024, tp=2, pp=2, stage_memory=stages, older=True))
    assert v.stages == ((0, 14), (14, 27)) and v.bytes_per_block == 14 * 18_432
    assert v.num_blocks == stages[0] // (14 * 18_432) == 50_473  # at exactly 12.13 GiB: stage 0 is the smaller
    assert 50_452 <= 807_792 // 16 <= 50_493


def test_llamacpp_sliding_cells_gemma3_270m_three_and_four_slots():
    """https://github.com/unslothai/unsloth/pull/7530 (a live llama-server, build 10107, Gemma 3 270M): "ctx 1024
    with 3 slots allocates 1536 cells / 27.0 MiB, but 4 slots allocates 1024 cells / 18.0 MiB". Non-unified
    streams: -c 1,024 over 3 sequences is 342 a stream, padded to 512 (3 x 512 = 1,536 cells), over 4 is 256
    (1,024 cells). The sliding cache holds min(stream, window 512 + n_ubatch 512) padded to 256, here the whole
    stream, so every layer keeps the stream's cells: 18 layers x 1 KV head x 256 x 2 (K, V) x 2 B = 18,432 B a
    cell; 1,536 cells = 27.0 MiB, 1,024 cells = 18.0 MiB."""
    spec = parse_config(GEMMA3_270M)
    three = llamacpp_sizing(spec, 1024, 3, "f16", "f16")
    four = llamacpp_sizing(spec, 1024, 4, "f16", "f16")
    assert three.total_bytes == 27 * MIB and four.total_bytes == 18 * MIB
    assert {(c.cells, c.streams) for c in three.caches} == {(512, 3)}  # 1,536 cells in every layer
    assert {(c.cells, c.streams) for c in four.caches} == {(256, 4)}  # 1,024


def test_sglang_k_size_from_tokens_qwen3_30b_a3b():
    """https://github.com/sgl-project/sglang/pull/18263 (Qwen3-30B-A3B, one GPU): "KV Cache is allocated. dtype:
    torch.bfloat16, #tokens: 1669816, K size: 76.44 GB, V size: 76.44 GB". The pool allocates #tokens + 1
    padding slot of 4 KV heads x 128 x 48 layers x 2 B for K (memory_pool.py), in 2^30-byte GB:
    1,669,817 x 49,152 = 82,074,845,184 B = 76.44. The #tokens came from that PR's own budget, so only the
    sizes are checked here; newer SGLang writes the dtype into the line, which 0.5.10.post1 (the source
    kvviz follows) does not: kvviz's line is the same figures without it."""
    spec = parse_config(QWEN3_30B_A3B)
    cell = 4 * 128 * 48 * 2 * 2
    sg = sglang_sizing(spec, 1_669_816 * cell)
    assert sg.tokens == 1_669_816 and sg.k_bytes == sg.v_bytes == 82_074_845_184
    assert sg.line == "KV Cache is allocated. #tokens: 1669816, K size: 76.44 GB, V size: 76.44 GB"
