"""Issue 41's held-out set, round 2: real startup figures posted in public issues, reproduced by the
sizing rules written from the engines' source (the code was not fitted to them). Each case writes down
the model's published config.json fields the sizing reads, the flags the issue states, the logged lines,
and the URL. Earlier held-out logs: tests/calculator/test_calculator_servers.py (vllm#10517, LMCache#1739,
vllm-project/recipes#12, vllm#21348, vllm#27508, vllm#34076) and test_calculator_server_rules.py (vllm#19996).
"""
from __future__ import annotations

import pytest

from kvviz.calculator import parse_config
from kvviz.calculator.server_llamacpp import llamacpp_sizing
from kvviz.calculator.server_log import parse_vllm_log, reconcile
from kvviz.calculator.server_log_engines import (
    parse_llamacpp_log, parse_sglang_log, reconcile_llamacpp, reconcile_sglang,
)
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
    sizes are checked here; SGLang 0.5.23 writes the dtype into the line (mem_cache/memory_pool.py:2088-2090),
    as this log does, and kvviz's line is that text exactly."""
    spec = parse_config(QWEN3_30B_A3B)
    cell = 4 * 128 * 48 * 2 * 2
    sg = sglang_sizing(spec, 1_669_816 * cell)
    assert sg.tokens == 1_669_816 and sg.k_bytes == sg.v_bytes == 82_074_845_184
    assert sg.line == ("KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1669816, K size: 76.44 GB, "
                       "V size: 76.44 GB")


# ---- Round 3 (issue 41's held-out set, logs 7-12): llama.cpp and SGLang lines, read by server_log_engines ----

def agree_all(rows: list) -> list[dict]:
    assert rows and all(r.agrees for r in rows), [r.to_dict() for r in rows if not r.agrees]
    return [r.to_dict() for r in rows]


QWQ_32B = {  # https://huggingface.co/Qwen/QwQ-32B/blob/main/config.json
    "model_type": "qwen2", "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
    "hidden_size": 5120}
QWQ_LOG = """\
[2025-03-08 12:29:04] server_args=ServerArgs(model_path='/home/model/Qwen/QwQ-32B', kv_cache_dtype='auto', mem_fraction_static=0.85, max_total_tokens=None, tp_size=4, stream_interval=1)
[2025-03-08 12:29:13 TP3] Load weight begin. avail mem=21.63 GB
[2025-03-08 12:29:13 TP0] Load weight begin. avail mem=21.63 GB
[2025-03-08 12:29:13 TP1] Load weight begin. avail mem=21.63 GB
[2025-03-08 12:29:13 TP2] Load weight begin. avail mem=21.63 GB
[2025-03-08 12:29:21 TP1] Load weight end. type=Qwen2ForCausalLM, dtype=torch.bfloat16, avail mem=6.09 GB, mem usage=15.54 GB.
[2025-03-08 12:29:21 TP2] Load weight end. type=Qwen2ForCausalLM, dtype=torch.bfloat16, avail mem=6.09 GB, mem usage=15.54 GB.
[2025-03-08 12:29:21 TP3] Load weight end. type=Qwen2ForCausalLM, dtype=torch.bfloat16, avail mem=6.09 GB, mem usage=15.54 GB.
[2025-03-08 12:29:21 TP0] Load weight end. type=Qwen2ForCausalLM, dtype=torch.bfloat16, avail mem=6.09 GB, mem usage=15.54 GB.
[2025-03-08 12:29:21 TP0] KV Cache is allocated. #tokens: 46611, K size: 1.42 GB, V size: 1.42 GB"""


def test_sglang_dense_tp4_qwq_32b():
    """https://github.com/didier-durand/llms-in-clouds/blob/main/docs/sglang.md ("SGLang start sequence with Qwen
    QwQ-32B", SGLang 0.4.3.post4, 4 x L4, --tensor-parallel-size 4; the lines above are that log's, server_args
    cut to the fields the sizing reads). 8 KV heads / TP 4 = 2 a GPU: a token is 2 x 128 x 64 layers x 2 (K, V) x
    2 B = 65,536 B. rest = 6.09 - 21.63 x (1 - 0.85) = 2.8455 GB -> 46,620 tokens; the figures are printed to two
    decimals, so rest lies in [6.085 - 0.15 x 21.635, 6.095 - 0.15 x 21.625] = [2.83975, 2.85125] GB: 46,526-46,714
    tokens, and the log's 46,611 is inside (profile_max_num_token). K = (46,611 + 1 padding slot) x 2 x 128 x 64 x 2
    B = 1,527,382,016 B = 1.4225 GB -> "1.42"."""
    log = parse_sglang_log(QWQ_LOG)
    assert (log.tokens, log.before_gb, log.after_gb, log.mem_fraction_static, log.tp) == (46_611, 21.63, 6.09, 0.85, 4)
    rows, _ = reconcile_sglang(parse_config(QWQ_32B), log)
    d = agree_all(rows)
    assert d[0]["predicted"] == "46,526-46,714" and d[1]["predicted"] == "1.42 / 1.42 GB"
    exact = sglang_sizing(parse_config(QWQ_32B), 46_611 * 65_536, tp=4)
    # SGLang 0.4.3.post4 printed the line without its dtype; 0.5.23 (mem_cache/memory_pool.py:2088-2090) names it
    assert exact.k_bytes == 1_527_382_016
    assert exact.line == "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 46611, K size: 1.42 GB, V size: 1.42 GB"
    assert exact.line.replace("dtype: torch.bfloat16, ", "") in QWQ_LOG


KIMI_K25_TEXT = {  # https://huggingface.co/moonshotai/Kimi-K2.5/blob/main/config.json, its text_config (DeepSeek-V3 MLA)
    "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
    "hidden_size": 7168, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "max_position_embeddings": 262144}
KIMI_LOG = """\
[2026-02-26 16:30:34] server_args=ServerArgs(model_path='moonshotai/Kimi-K2.5', kv_cache_dtype='auto', mem_fraction_static=0.8260405859375, max_total_tokens=None, page_size=1, tp_size=8, pp_size=1)
[2026-02-26 16:31:00 TP7] Load weight begin. avail mem=283.68 GB
[2026-02-26 16:31:00 TP1] Load weight begin. avail mem=283.96 GB
[2026-02-26 16:31:00 TP3] Load weight begin. avail mem=283.53 GB
[2026-02-26 16:31:00 TP2] Load weight begin. avail mem=283.54 GB
[2026-02-26 16:31:00 TP5] Load weight begin. avail mem=283.60 GB
[2026-02-26 16:31:00 TP6] Load weight begin. avail mem=283.66 GB
[2026-02-26 16:31:00 TP0] Load weight begin. avail mem=283.56 GB
[2026-02-26 16:31:00 TP4] Load weight begin. avail mem=283.68 GB
[2026-02-26 16:41:05 TP1] Load weight end. elapsed=605.50 s, type=KimiK25ForConditionalGeneration, dtype=torch.bfloat16, avail mem=210.38 GB, mem usage=73.58 GB.
[2026-02-26 16:41:06 TP3] Load weight end. elapsed=606.34 s, type=KimiK25ForConditionalGeneration, dtype=torch.bfloat16, avail mem=209.96 GB, mem usage=73.58 GB.
[2026-02-26 16:41:06 TP6] Load weight end. elapsed=606.43 s, type=KimiK25ForConditionalGeneration, dtype=torch.bfloat16, avail mem=210.08 GB, mem usage=73.58 GB.
[2026-02-26 16:41:06 TP5] Load weight end. elapsed=606.46 s, type=KimiK25ForConditionalGeneration, dtype=torch.bfloat16, avail mem=210.02 GB, mem usage=73.58 GB.
[2026-02-26 16:41:06 TP2] Load weight end. elapsed=606.47 s, type=KimiK25ForConditionalGeneration, dtype=torch.bfloat16, avail mem=209.96 GB, mem usage=73.58 GB.
[2026-02-26 16:41:09 TP7] Load weight end. elapsed=609.07 s, type=KimiK25ForConditionalGeneration, dtype=torch.bfloat16, avail mem=210.10 GB, mem usage=73.58 GB.
[2026-02-26 16:41:14 TP4] Load weight end. elapsed=614.45 s, type=KimiK25ForConditionalGeneration, dtype=torch.bfloat16, avail mem=210.10 GB, mem usage=73.58 GB.
[2026-02-26 16:41:18 TP0] Load weight end. elapsed=618.04 s, type=KimiK25ForConditionalGeneration, dtype=torch.bfloat16, avail mem=209.98 GB, mem usage=73.58 GB.
[2026-02-26 16:41:18 TP0] Using KV cache dtype: torch.bfloat16
[2026-02-26 16:41:18 TP6] KV Cache is allocated. #tokens: 2454421, KV size: 160.63 GB"""


def test_sglang_mla_tp8_kimi_k25():
    """https://github.com/ajith-sirra-amd/Issues/blob/main/Kimi-K2.5-MI355X-SGLANG-ERROR.md (SGLang
    v0.5.8.post1 ROCm, 8 x MI355X, `--tp 8`; server_args cut to the fields the sizing reads). MLA: one latent of 512 + 64 values a token and layer, not split by
    TP: 61 x 576 x 2 B = 70,272 B a token. SGLang takes the smallest avail mem over the ranks: 283.53 GB before,
    209.96 GB after loading; rest = 209.96 - 283.53 x (1 - 0.8260405859375) = 160.637 GB -> 2,454,504 tokens, and
    over the figures' rounding (+-0.005 GB each) 2,454,415-2,454,594: the log's 2,454,421 is inside. KV size =
    (2,454,421 + 1) x 70,272 = 172,477,142,784 B = 160.632 GB -> "160.63"."""
    log = parse_sglang_log(KIMI_LOG)
    assert (log.before_gb, log.after_gb, log.tp, log.kv_gb) == (283.53, 209.96, 8, 160.63)
    d = agree_all(reconcile_sglang(parse_config(KIMI_K25_TEXT), log)[0])
    assert d[0]["predicted"] == "2,454,415-2,454,594" and d[1] == {
        "line": "KV size (MLA)", "logged": "160.63 GB", "predicted": "160.63 GB", "agrees": True,
        "why": "the latent buffer of #tokens + 1 slots"}
    assert sglang_sizing(parse_config(KIMI_K25_TEXT), 2_454_421 * 70_272, tp=8).k_bytes == 172_477_142_784


DEEPSEEK_R1 = {  # https://huggingface.co/deepseek-ai/DeepSeek-R1/blob/main/config.json
    "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "hidden_size": 7168, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "max_position_embeddings": 163840}
R1_LOG = """\
llama_kv_cache_init: layer 60: n_embd_head_qk_rope = 64, kv_lora_rank = 512
llama_kv_cache_init:      CUDA0 KV buffer size =  1166.65 MiB
llama_new_context_with_model: KV self size  = 1166.62 MiB, c^KV (q8_0): 1166.62 MiB, kv^T: not used
INFO [                    init] new slot | tid="137362671300608" timestamp=1742136993 id_slot=0 n_ctx_slot=32768"""


def test_llamacpp_mla_q8_0_deepseek_r1():
    """https://github.com/ikawrakow/ik_llama.cpp/pull/259 (ubergarm's run of DeepSeek-R1, one slot of 32,768
    tokens, q8_0 cache). ik_llama.cpp keeps the MLA latent as one K row (c^KV) of kv_lora_rank + rope = 576
    values, as llama.cpp does (llama-kv-cache.cpp: has_v = !is_mla): a q8_0 row is 576 / 32 x 34 = 612 B; 61
    layers x 32,768 cells x 612 B = 1,223,294,976 B = 1166.625 MiB -> "1166.62" (the CUDA buffer's 1166.65 is the
    allocation's alignment). This fork prints n_ctx_slot, not llama.cpp's line, so the context is given."""
    log = parse_llamacpp_log(R1_LOG)
    assert [(ln.type_k, ln.k_mib, ln.v_mib) for ln in log.lines] == [("q8_0", 1166.62, 0.0)]
    rows, notes = reconcile_llamacpp(parse_config(DEEPSEEK_R1), log, n_ctx=32768)
    agree_all(rows)
    ll = llamacpp_sizing(parse_config(DEEPSEEK_R1), 32768, 1, "q8_0", "q8_0")
    assert ll.total_bytes == 61 * 32768 * 612 == 1_223_294_976 and any("K only" in n for n in notes)


TINYLLAMA = {  # https://huggingface.co/TinyLlama/TinyLlama-1.1B-Chat-v1.0/blob/main/config.json
    "model_type": "llama", "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "hidden_size": 2048, "max_position_embeddings": 2048}
TINYLLAMA_LOG = """\
llama_kv_cache:      CUDA0 KV buffer size =     5.50 MiB
llama_kv_cache: size =    5.50 MiB (   256 cells,  22 layers,  1/1 seqs), K (f16):    2.75 MiB, V (f16):    2.75 MiB
llama_context: Flash Attention was auto, set to enabled"""


def test_llamacpp_dense_tinyllama():
    """https://github.com/hybridgroup/yzma/blob/main/README.md (the chat example: llama.cpp's libraries on an RTX
    4070 Laptop GPU, tinyllama-1.1b-chat-v1.0.Q2_K.gguf). 4 KV heads x 64 (2,048 / 32 heads) = 256 values a row:
    22 layers x 256 cells x 256 x 2 B = 2,883,584 B = 2.75 MiB for K and for V, 5.50 MiB in all."""
    log = parse_llamacpp_log(TINYLLAMA_LOG)
    rows, _ = reconcile_llamacpp(parse_config(TINYLLAMA), log)
    assert agree_all(rows)[0]["predicted"] == "5.50 MiB (256 cells, 22 layers), K 2.75, V 2.75"
    assert llamacpp_sizing(parse_config(TINYLLAMA), 256).lines == (TINYLLAMA_LOG.splitlines()[1],)


def test_llamacpp_sliding_gemma3_270m_at_8192_one_two_four_slots():
    """https://github.com/unslothai/unsloth/pull/7530, its test_matches_empirical_gemma3_270m_formula: "the formula
    measured from llama-server: total_kv = 24 + parallel x 15 (MiB) at ctx=8192" for 1, 2 and 4 slots = 39, 54
    and 84 MiB. The 3 full layers keep every cell: 3 x 8,192 x 1 KV head x 256 x 2 (K, V) x 2 B = 24 MiB whatever
    the slots; each of the S streams' sliding cache holds pad(min(8,192 / S, window 512 + n_ubatch 512), 256) =
    1,024 cells (llama-kv-cache-iswa.cpp:73), 15 layers x 1,024 x 1,024 B = 15 MiB a slot."""
    spec = parse_config(GEMMA3_270M)
    for slots, mib in ((1, 39), (2, 54), (4, 84)):
        ll = llamacpp_sizing(spec, 8192, slots)
        assert ll.total_bytes == mib * MIB
        assert [(c.label, c.cells, c.streams) for c in ll.caches] == [("non-SWA", 8192 // slots, slots),
                                                                      ("SWA", 1024, slots)]
        rows, _ = reconcile_llamacpp(spec, parse_llamacpp_log("\n".join(
            f"llama_kv_cache_iswa: creating {c.label} KV cache\n{line}" for c, line in zip(ll.caches, ll.lines))))
        agree_all(rows)


def test_cli_reconciles_llamacpp_and_sglang_logs(tmp_path, capsys):
    """`memory --engine llama.cpp|sglang --reconcile LOG` reads the held-out lines above (server_log_engines);
    a log with no KV line, or garbage, is one sentence (exit 2), never a traceback."""
    import json

    from kvviz.cli.main import main

    def run(config: dict, engine: str, log: str, *extra: str) -> dict:
        (tmp_path / "c.json").write_text(json.dumps(config))
        (tmp_path / "log.txt").write_text(log)
        assert main(["memory", "--config", str(tmp_path / "c.json"), "--engine", engine, "--reconcile",
                     str(tmp_path / "log.txt"), *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    d = run(QWQ_32B, "sglang", QWQ_LOG)
    assert d["agrees"] and [r["line"] for r in d["rows"]] == ["#tokens", "K size / V size"]
    assert run(KIMI_K25_TEXT, "sglang", KIMI_LOG)["agrees"]
    assert run(DEEPSEEK_R1, "llama.cpp", R1_LOG, "--max-model-len", "32768")["agrees"]
    d = run(TINYLLAMA, "llama.cpp", TINYLLAMA_LOG)
    assert d["agrees"] and d["engine"] == "llama.cpp"
    for engine, garbage in (("llama.cpp", "\x00nothing here\n" * 3), ("sglang", "KV Cache is allocated. #tokens: x")):
        (tmp_path / "bad.txt").write_text(garbage)
        with pytest.raises(SystemExit) as e:
            main(["memory", "--config", str(tmp_path / "c.json"), "--engine", engine, "--reconcile",
                  str(tmp_path / "bad.txt")])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "no " + ("llama.cpp" if engine == "llama.cpp" else "SGLang") + " KV-cache line found" in err
        assert "Traceback" not in err
    (tmp_path / "c.json").write_text(json.dumps(DEEPSEEK_R1))  # a pre-unified line without n_ctx: ask for it
    (tmp_path / "r1.txt").write_text(R1_LOG)
    with pytest.raises(SystemExit):
        main(["memory", "--config", str(tmp_path / "c.json"), "--engine", "llama.cpp", "--reconcile",
              str(tmp_path / "r1.txt")])
    assert "give the context (-c, --max-model-len)" in capsys.readouterr().err
