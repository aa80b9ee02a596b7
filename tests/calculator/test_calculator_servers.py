"""Engine sizing: vLLM V1's blocks, tokens, concurrency and too-long error; llama.cpp's and SGLang's
allocations; each against hand-worked figures that follow the engines' own source, and against
real startup logs from public issues (held out: the code was written from the sources, not fitted
to these lines).
"""
from __future__ import annotations

import pytest

from kvviz.calculator import CalcError, parse_config
from kvviz.calculator.server_llamacpp import llamacpp_sizing, row_bytes
from kvviz.calculator.server_log import gib_range, parse_vllm_log, reconcile
from kvviz.calculator.server_sglang import sglang_sizing
from kvviz.calculator.server_vllm import VLLMSettings, pp_partition, vllm_sizing
from kvviz.units import GIB

MIB = 1024**2


# ----------------------------------------------------------------------------- held-out real logs
# Each: the model's config fields the sizing needs (from its config.json), the flags, the log lines,
# and where they were posted.
LLAMA31_8B = {  # https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json
    "model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 4096, "max_position_embeddings": 131072}
QWEN3_CODER_480B = {  # https://huggingface.co/Qwen/Qwen3-Coder-480B-A35B-Instruct/blob/main/config.json
    "model_type": "qwen3_moe", "num_hidden_layers": 62, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_size": 6144, "max_position_embeddings": 262144}
QWEN3_14B = {  # https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json
    "model_type": "qwen3", "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_size": 5120, "max_position_embeddings": 40960}
QWEN3_235B = {  # https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json
    "model_type": "qwen3_moe", "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "hidden_size": 4096, "max_position_embeddings": 40960}

REAL_LOGS = [
    pytest.param(LLAMA31_8B, {"max_model_len": 20000}, """\
Memory profiling results: total_gpu_memory=23.58GiB initial_memory_usage=15.34GiB peak_torch_memory=17.06GiB memory_usage_post_profile=15.35GiB non_torch_memory=0.35GiB kv_cache_size=3.81GiB gpu_memory_utilization=0.90
GPU blocks: 1952, # CPU blocks: 2048
Maximum concurrency for 20000 tokens per request: 1.56x""",
                 id="vllm#10517 Llama-3.1-8B RTX 3090 20k fits (dense, bf16, V0 lines)"),
    pytest.param(LLAMA31_8B, {"max_model_len": 29000}, """\
Memory profiling results: total_gpu_memory=23.58GiB initial_memory_usage=15.34GiB peak_torch_memory=17.98GiB memory_usage_post_profile=15.35GiB non_torch_memory=0.35GiB kv_cache_size=2.89GiB gpu_memory_utilization=0.90
# GPU blocks: 1478, # CPU blocks: 2048
Maximum concurrency for 29000 tokens per request: 0.82x
The model's max seq len (29000) is larger than the maximum number of tokens that can be stored in KV cache (23648). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.""",
                 id="vllm#10517 Llama-3.1-8B 29k too long (dense, V0 error)"),
    pytest.param(QWEN3_14B, {"max_model_len": 32768}, """\
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [gpu_worker.py:298] Available KV cache memory: 6.51 GiB
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [kv_cache_utils.py:864] GPU KV cache size: 42,656 tokens
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [kv_cache_utils.py:868] Maximum concurrency for 32,768 tokens per request: 1.30x""",
                 id="LMCache#1739 Qwen3-14B one GPU fits (dense, bf16, V1 lines)"),
    pytest.param(QWEN3_CODER_480B, {"max_model_len": 262144}, """\
ValueError: To serve at least one request with the models's max seq len (262144), (62.00 GiB KV cache is needed, which is larger than the available KV cache memory (48.66 GiB). Based on the available memory, the estimated maximum model length is 205728. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.""",
                 id="vllm-project/recipes#12 Qwen3-Coder-480B-A35B-FP8 DP8 0.9 too long (MoE, V1 error)"),
    pytest.param(QWEN3_CODER_480B, {"max_model_len": 262144}, """\
ValueError: To serve at least one request with the models's max seq len (262144), (62.00 GiB KV cache is needed, which is larger than the available KV cache memory (55.65 GiB). Based on the available memory, the estimated maximum model length is 235296. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.""",
                 id="vllm-project/recipes#12 Qwen3-Coder-480B-A35B-FP8 DP8 0.95 too long"),
]


@pytest.mark.parametrize(("config", "flags", "log"), REAL_LOGS)
def test_real_vllm_logs_are_reproduced(config, flags, log):
    """Posted at https://github.com/vllm-project/vllm/issues/10517, https://github.com/LMCache/LMCache/issues/1739
    and https://github.com/vllm-project/recipes/pull/12: every KV line agrees, tokens and blocks within
    the rounding of the printed GiB, the concurrency to its two decimals, the too-long error's needed
    GiB exactly and its estimated maximum model length within the rounding."""
    spec = parse_config(config)
    parsed = parse_vllm_log(log)
    rows, _ = reconcile(spec, parsed, VLLMSettings(0, flags["max_model_len"]))
    assert len(rows) >= 2
    assert all(r.agrees for r in rows), [r.to_dict() for r in rows if not r.agrees]


def test_real_log_with_tp_explains_the_smallest_gpu():
    """vllm#21348 (Qwen3-235B-A22B-FP8, TP 4): 'Available KV cache memory: 8.11 GiB' but 178,880
    tokens, fewer than 8.11 GiB holds (94 layers x 1 KV head per GPU x 128 x 2 x 2 B x 16 = 770,048 B
    a block: 11,301-11,315 blocks). vLLM keeps the smallest block count over the GPUs and logs one
    GPU's memory: the reconciler says so instead of agreeing."""
    spec = parse_config(QWEN3_235B)
    log = parse_vllm_log("Available KV cache memory: 8.11 GiB\nGPU KV cache size: 178,880 tokens\n")
    rows, _ = reconcile(spec, log, VLLMSettings(0, 40960, tp=4))
    tok = next(r for r in rows if r.what == "GPU KV cache size")
    assert not tok.agrees and tok.predicted == "180,816-181,040 tokens"
    assert "smallest block count over all GPUs" in tok.why


def test_real_sglang_line_k_size():
    """vllm#21348's SGLang line for the same model at TP 4: '#tokens: 367404, K size: 8.23 GB, V size:
    8.23 GB'. memory_pool.py allocates #tokens + page_size (1) slots of 1 KV head x 128 x 94 layers x 2 B
    for K and for V, printed in 2^30-byte GB."""
    spec = parse_config(QWEN3_235B)
    cell = 1 * 128 * 94 * 2 * 2
    sg = sglang_sizing(spec, 367404 * cell, tp=4)
    assert sg.tokens == 367404
    # that log's SGLang (mid-2025) printed no dtype; 0.5.23 names it (mem_cache/memory_pool.py:2088-2090)
    assert sg.line == "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 367404, K size: 8.23 GB, V size: 8.23 GB"


# ----------------------------------------------------------------------------- hand-worked vLLM
def test_vllm_dense_hand_worked(presets):
    """Llama-3-8B, bf16, block 16, 30 GiB available: page = 16 x 8 x 128 x 2 x 2 = 65,536 B
    (AttentionSpec.page_size_bytes); blocks = 32,212,254,720 // 65,536 // 32 layers = 15,360
    (get_kv_cache_config_from_groups); one 8,192 request = 512 blocks: 30.00x; the tokens, int(30.0 x 8,192)
    = 245,760, on one line with the concurrency (vLLM 0.33 v1/core/kv_cache_utils.py:1120-1153)."""
    v = vllm_sizing(presets["llama-3-8b"], VLLMSettings(30 * GIB, 8192))
    assert (v.page_bytes, v.num_blocks, v.kv_cache_tokens) == (65_536, 15_360, 245_760)
    assert v.lines[1:] == ("GPU KV cache size: 245,760 tokens, Maximum concurrency for 8,192 tokens per request: 30.00x",)
    assert v.fits and v.needed_bytes == 32 * 512 * 65_536 and v.estimated_max_model_len is None


def test_vllm_fp8_halves_the_page(presets):
    """--kv-cache-dtype fp8 stores one byte a value (torch.uint8): the page halves, the blocks double."""
    bf16 = vllm_sizing(presets["llama-3-8b"], VLLMSettings(30 * GIB, 8192))
    fp8 = vllm_sizing(presets["llama-3-8b"], VLLMSettings(30 * GIB, 8192, kv_dtype="fp8"))
    assert fp8.page_bytes * 2 == bf16.page_bytes and fp8.num_blocks == 2 * bf16.num_blocks == 30_720


def test_vllm_too_long_error_and_estimate(presets):
    """vLLM 0.33 v1/core/kv_cache_planning.py:1528-1559 checks a request against the available memory less
    the null block the pool holds back (one block of 32 x 65,536 B = 2 MiB). 1 GiB + 2 MiB holds exactly
    one 8,192-token Llama-3-8B request (32 x 512 x 65,536 B = 1 GiB); 1 GiB does not: the error (:66-86,
    "model's", with the docs link), whose estimate is 511 blocks = 8,176 tokens (the binary search,
    :100-148). Logs of earlier vLLM ("models's", no null block) are sized with ``older``."""
    spec = presets["llama-3-8b"]
    assert vllm_sizing(spec, VLLMSettings(GIB + 2 * 1024**2, 8192)).fits
    v = vllm_sizing(spec, VLLMSettings(GIB, 8192))
    assert not v.fits and v.needed_bytes == 32 * 512 * 65_536 and v.estimated_max_model_len == 8176
    assert v.lines[1] == ("ValueError: To serve at least one request with the model's max seq len (8192), (1.0 GiB "
                          "KV cache is needed, which is larger than the available KV cache memory (1.0 GiB). Based on "
                          "the available memory, the estimated maximum model length is 8176. Try increasing "
                          "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing "
                          "`max_model_len` when initializing the engine. See "
                          "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
    assert "models's" not in v.lines[1]
    old = vllm_sizing(spec, VLLMSettings(GIB, 8193, older=True))
    assert not old.fits and old.estimated_max_model_len == 8192 and "the models's max seq len (8193)" in old.lines[1]
    assert vllm_sizing(spec, VLLMSettings(GIB, 8192, older=True)).fits


def test_vllm_tp_splits_and_refuses(presets):
    """Llama-3-70B (64 heads, 8 KV heads, 80 layers) at TP 4: 2 KV heads a GPU, page 16 x 2 x 128 x 2 x 2
    = 16,384 B; 40 GiB: 42,949,672,960 // 16,384 // 80 = 32,768 blocks = 524,288 tokens. TP 16 > 8 KV heads:
    1 head each (max(1, 8 // 16)), page 8,192 B. TP 3 does not divide the 64 heads: vLLM refuses."""
    spec = presets["llama-3-70b"]
    v = vllm_sizing(spec, VLLMSettings(40 * GIB, 8192, tp=4))
    assert (v.kv_heads_per_gpu, v.page_bytes, v.num_blocks, v.kv_cache_tokens) == (2, 16_384, 32_768, 524_288)
    assert vllm_sizing(spec, VLLMSettings(40 * GIB, 8192, tp=16)).page_bytes == 8_192
    with pytest.raises(CalcError, match="must be divisible by tensor parallel size"):
        vllm_sizing(spec, VLLMSettings(40 * GIB, 8192, tp=3))


def test_vllm_pp_stages(presets):
    """vllm/distributed/utils.py get_pp_indices: 32 layers over 3 stages = [11, 11, 10] (the remainder
    to the stages before the last); each stage's blocks = available // page // its layers, and vLLM keeps
    the smallest: 10 GiB // 65,536 // 11 = 14,894 blocks."""
    assert pp_partition(32, 3) == [(0, 11), (11, 22), (22, 32)]
    assert pp_partition(62, 4) == [(0, 15), (15, 31), (31, 47), (47, 62)]  # 15 each, +1 to stages 2 and 1
    v = vllm_sizing(presets["llama-3-8b"], VLLMSettings(10 * GIB, 8192, pp=3))
    assert v.num_blocks == 10 * GIB // 65_536 // 11 == 14_894
    assert v.needed_bytes == 11 * 512 * 65_536


def test_vllm_gpt_oss_hybrid_groups(presets):
    """gpt-oss-20b: 24 layers, even ones sliding (window 128), 8 KV heads x 64. kv_cache_utils groups
    12 sliding + 12 full as 2 groups of 12 (equal counts), page 16 x 8 x 64 x 2 x 2 = 32,768 B.
    10 GiB: blocks = 10,737,418,240 // (12 x 32,768) = 27,306. One 131,072-token request: the sliding group
    holds ceil(min(127 + 4,096 in flight, L) / 16) + 1 = 265 blocks (vLLM 0.33 kv_cache_interface.py:917-944:
    window - 1 + max_in_flight_tokens, which is 2 x max_num_batched_tokens 2,048 under async scheduling,
    config/vllm.py:588-609), the full group 8,192: 8,457, so 27,306 / 8,457 = 3.2288x and
    int(3.2288... x 131,072) = 423,205 tokens (kv_cache_utils.py:1120-1128)."""
    v = vllm_sizing(presets["gpt-oss-20b"], VLLMSettings(10 * GIB, 131072))
    assert [(g.kind, g.span, len(g.layers)) for g in v.groups] == [("sliding", 128, 12), ("full", None, 12)]
    assert v.groups[0].layers == tuple(range(0, 24, 2))
    assert (v.page_bytes, v.bytes_per_block, v.num_blocks, v.kv_cache_tokens) == (32_768, 393_216, 27_306, 423_205)
    assert v.tokens_by_groups == 27_306 // 2 * 16 == 218_448  # what vLLM 0.9-0.11 printed
    assert [g.blocks_per_request for g in v.groups] == [265, 8192]
    assert v.lines[1] == ("GPU KV cache size: 423,205 tokens, Maximum concurrency for 131,072 tokens per request: "
                          "3.23x")
    # --max-num-batched-tokens 8192 (H100-class default) widens the sliding group's share: 2 x 8,192 in flight
    assert vllm_sizing(presets["gpt-oss-20b"], VLLMSettings(10 * GIB, 131072, max_num_batched_tokens=8192)) \
        .groups[0].blocks_per_request == -(-(127 + 16384) // 16) + 1 == 1033
    # --no-async-scheduling: one batch in flight (config/vllm.py:596-598), as older vLLM held
    for s in (VLLMSettings(10 * GIB, 131072, async_scheduling=False), VLLMSettings(10 * GIB, 131072, older=True)):
        assert vllm_sizing(presets["gpt-oss-20b"], s).groups[0].blocks_per_request == -(-(127 + 2048) // 16) + 1 == 137
    # --disable-hybrid-kv-cache-manager: one group, every layer keeps every token
    off = vllm_sizing(presets["gpt-oss-20b"], VLLMSettings(10 * GIB, 131072, hybrid=False))
    assert len(off.groups) == 1 and off.num_blocks == 10 * GIB // 32_768 // 24


def test_vllm_gpt_oss_pp_projects_the_groups(presets):
    """PP 2 splits gpt-oss's 24 layers 12/12; each stage holds 6 layers of each group, so its blocks =
    available // page // 6 (_project_kv_cache_groups_to_worker, get_kv_cache_config_from_groups)."""
    v = vllm_sizing(presets["gpt-oss-20b"], VLLMSettings(10 * GIB, 131072, pp=2))
    assert v.num_blocks == 10 * GIB // 32_768 // 6


def test_vllm_gemma3_padding_groups(presets):
    """Gemma-3-1B: 26 layers, every 6th global: 4 full, 22 sliding (window 512), 1 KV head x 256.
    group size = 4 (22 >= 1.5 x 4); the sliding layers make ceil(22 / 4) = 6 groups, padded to 24: 7
    groups. page 16 x 1 x 256 x 2 x 2 = 16,384 B; 10 GiB // (4 x 16,384) = 163,840 blocks; a 32,768 request:
    each sliding group ceil((511 + 2 x 2,048) / 16) + 1 = 289 blocks (vLLM 0.33 kv_cache_interface.py:937-944),
    6 x 289 + 2,048 = 3,782 blocks: 43.32x, int(163,840 / 3,782 x 32,768) = 1,419,542 tokens
    (kv_cache_utils.py:1120-1128; vLLM 0.9-0.11 printed 163,840 // 7 x 16 = 374,480)."""
    v = vllm_sizing(presets["gemma-3-1b"], VLLMSettings(10 * GIB, 32768))
    assert v.group_size == 4 and len(v.groups) == 7
    assert sorted(len(g.layers) for g in v.groups) == [3, 3, 4, 4, 4, 4, 4]
    assert (v.num_blocks, v.kv_cache_tokens, v.tokens_by_groups) == (163_840, 1_419_542, 374_480)
    assert sum(g.blocks_per_request for g in v.groups) == 6 * 289 + 2048
    assert v.lines[1] == ("GPU KV cache size: 1,419,542 tokens, Maximum concurrency for 32,768 tokens per request: "
                          "43.32x")
    assert any("2 padding layer(s)" in n for n in v.notes)


def test_vllm_refuses_linear_layers_and_int8(presets):
    with pytest.raises(CalcError, match="linear-attention / Mamba"):
        vllm_sizing(presets["qwen3-next-80b-a3b"], VLLMSettings(10 * GIB, 8192))
    with pytest.raises(CalcError, match="'int8' is not one kvviz sizes"):
        vllm_sizing(presets["llama-3-8b"], VLLMSettings(10 * GIB, 8192, kv_dtype="int8"))


def test_gib_range_brackets_the_print():
    lo, hi = gib_range(10.55)
    assert f"{lo / GIB:.2f}" == f"{hi / GIB:.2f}" == "10.55"
    assert f"{(lo - 1) / GIB:.2f}" == "10.54" and f"{(hi + 1) / GIB:.2f}" == "10.56"


# ----------------------------------------------------------------------------- llama.cpp
def test_llamacpp_llama3_8b_line(presets):
    """llama-kv-cache.cpp: each of 32 layers keeps 8,192 cells of a 1,024-value K row and V row in f16:
    512 MiB each (hand-worked; the format string is llama_kv_cache's own)."""
    ll = llamacpp_sizing(presets["llama-3-8b"], 8192)
    assert ll.lines == ("llama_kv_cache: size = 1024.00 MiB (  8192 cells,  32 layers,  1/1 seqs), "
                        "K (f16):  512.00 MiB, V (f16):  512.00 MiB",)


def test_llamacpp_quantized_blocks(presets):
    """ggml type sizes: q8_0 is 34 bytes per 32 values, q4_0 18 bytes per 32. A 1,024-value row: 1,088 B
    and 576 B; K at -c 8192 over 32 layers: 272 MiB and 144 MiB."""
    assert (row_bytes("q8_0", 1024), row_bytes("q4_0", 1024), row_bytes("f16", 1024)) == (1088, 576, 2048)
    ll = llamacpp_sizing(presets["llama-3-8b"], 8192, type_k="q8_0", type_v="q4_0")
    assert ll.caches[0].k_bytes == 272 * MIB and ll.caches[0].v_bytes == 144 * MIB
    assert "K (q8_0):  272.00 MiB, V (q4_0):  144.00 MiB" in ll.lines[0]


def test_llamacpp_padding_and_streams(presets):
    """llama-context.cpp: n_ctx = pad(N, 256); without --kv-unified each of S sequences gets
    pad(n_ctx / S, 256) cells: -c 10000 -np 3 -> 10,240 / 3 = 3,413 -> 3,584 cells, 3 streams."""
    spec = presets["llama-3-8b"]
    assert llamacpp_sizing(spec, 35000).caches[0].cells == 35072
    ll = llamacpp_sizing(spec, 10000, n_seq=3)
    c = ll.caches[0]
    assert (c.cells, c.streams, ll.n_ctx_padded) == (3584, 3, 10752)
    assert c.k_bytes == 32 * 2048 * 3584 * 3 and " 3/3 seqs" in ll.lines[0]
    u = llamacpp_sizing(spec, 10000, n_seq=3, unified=True).caches[0]
    assert (u.cells, u.streams) == (10240, 1)


def test_llamacpp_refuses_more_sequences_than_llama_max_seq(presets):
    """llama-context.cpp throws "n_seq_max must be <= 256" (LLAMA_MAX_SEQ, src/llama-cparams.h); the
    page reaches the engine with any -np, the CLI's parser stops 257 first."""
    spec = presets["llama-3-8b"]
    assert llamacpp_sizing(spec, 65536, n_seq=256).caches[0].cells == 256
    with pytest.raises(CalcError, match="n_seq_max must be <= 256"):
        llamacpp_sizing(spec, 4096, n_seq=257)


def test_llamacpp_gemma3_swa(presets):
    """llama-kv-cache-iswa.cpp: Gemma-3-4B's 29 sliding layers (window 1,024) keep min(n_ctx_seq,
    1,024 + n_ubatch 512) = 1,536 cells; the 5 global layers all 32,768. Rows are 4 x 256 = 1,024 values.
    --swa-full gives the sliding layers all 32,768 cells too."""
    spec = presets["gemma-3-4b"]
    ll = llamacpp_sizing(spec, 32768)
    full, swa = ll.caches
    assert (full.cells, full.layers, swa.cells, swa.layers) == (32768, 5, 1536, 29)
    assert full.k_bytes == 5 * 2048 * 32768 and swa.k_bytes == 29 * 2048 * 1536
    assert llamacpp_sizing(spec, 32768, swa_full=True).caches[1].cells == 32768
    assert llamacpp_sizing(spec, 32768, n_seq=2, unified=True).caches[1].cells == 2 * 1024 + 512


# ----------------------------------------------------------------------------- SGLang
def test_sglang_pool(presets):
    """SGLang 0.5.23 model_executor/pool_configurator.py:490-497 (cell) and 637-647 (#tokens): cell = 8 KV heads x
    (128 + 128) x 32 layers x 2 B = 131,072 B; 10 GiB of rest memory holds 81,920 tokens; the pool's 81,921 slots
    of K are 5.00 GB (2^30), logged with the pool's dtype (mem_cache/memory_pool.py:2088-2090)."""
    sg = sglang_sizing(presets["llama-3-8b"], 10 * GIB)
    assert (sg.cell_bytes, sg.tokens) == (131_072, 81_920)
    assert sg.line == "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 81920, K size: 5.00 GB, V size: 5.00 GB"
    assert sglang_sizing(presets["llama-3-8b"], 10 * GIB, kv_dtype="fp8").tokens == 163_840
    assert sglang_sizing(presets["llama-3-8b"], 10 * GIB, page_size=64).tokens == 81_920 // 64 * 64


def test_sglang_mla(presets):
    """MLATokenToKVPool: one (kv_lora_rank + qk_rope_head_dim) = 576 latent a layer, no V buffer."""
    spec = presets["deepseek-v3"]
    sg = sglang_sizing(spec, GIB, tp=8)
    assert sg.cell_bytes == 576 * 61 * 2 and sg.v_bytes == 0


# ----------------------------------------------------------------------------- presets
def test_gpu_presets_carry_usable_memory():
    """What nvidia-smi reports as total: L4 23,034 MiB, L40S 46,068, H100 SXM 81,559, H200 143,771,
    A100 80 GB 81,920; the nominal size stays beside it."""
    from kvviz.calculator import load_gpus

    g = load_gpus()
    assert {k: g[k].usable_mib for k in ("l4", "l40s", "h100-sxm", "h200", "a100-80gb")} == {
        "l4": 23_034, "l40s": 46_068, "h100-sxm": 81_559, "h200": 143_771, "a100-80gb": 81_920}
    assert g["l4"].memory_gib == 24 and g["l4"].usable_gib == 23_034 / 1024
    assert g["rtx-4090"].usable_mib is None and g["rtx-4090"].usable_gib == 24.0


def test_preset_fixes(presets):
    """Llama-4-Scout-17B-16E (the base model's config) has max_position_embeddings 262,144; Qwen3-Next's
    parameter count says its MTP layer is not counted, as DeepSeek-V3's does."""
    scout = presets["llama-4-scout"]
    assert scout.max_positions == 262_144 and "(base)" in scout.name
    for key in ("qwen3-next-80b-a3b", "deepseek-v3"):
        assert "MTP layer not counted" in presets[key].params_note


def test_provenance_names_fields_and_class_defaults(presets, capsys):
    """Each shape figure says where it came from: the field read, the class default filled in for a
    nested text_config (Gemma 3 leaves num_key_value_heads out), or the rule (head_dim = hidden / heads)."""
    import json

    from kvviz.cli.main import main

    gemma = dict(presets["gemma-3-4b"].provenance)
    assert gemma["n_kv_heads"].startswith("gemma3_text config class default num_key_value_heads=4")
    assert gemma["sliding_window"] == "config.json sliding_window = 1024"
    gpt2 = dict(presets["gpt2"].provenance)
    assert gpt2["head_dim"] == "hidden_size / num_attention_heads = 768 / 12"
    assert gpt2["n_kv_heads"].startswith("absent: every query head")
    assert dict(presets["llama-4-scout"].provenance)["max_position_embeddings"] == \
        "config.json max_position_embeddings = 262144"
    assert main(["memory", "--preset", "gemma-3-4b", "--seq-len", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["provenance"]["n_layers"] == "config.json num_hidden_layers = 34"


# ----------------------------------------------------------------------------- length distribution
def test_length_mix_by_hand(presets):
    """Llama-3-8B, 30 GiB, block 16: 15,360 blocks. Requests of 1,024, 3,500 and 112 tokens take 64, 219
    and 7 blocks (96.67 on average): 15,360 / 96.67 = 158.9 at once, against 15,360 / 2,048 = 7.5 at
    max_model_len 32,768. Of the 290 x 16 = 4,640 slots held, 4 are empty (the 3,500-token request's last block)."""
    from kvviz.calculator.server_mix import length_mix, parse_lengths_csv

    v = vllm_sizing(presets["llama-3-8b"], VLLMSettings(30 * GIB, 32768))
    lengths = parse_lengths_csv("prompt_tokens,output_tokens\n1000,24\n3000,500\n100,12\n")
    assert lengths == [1024, 3500, 112]
    mix = length_mix(v, lengths)
    assert mix.mean_blocks == pytest.approx(290 / 3) and mix.concurrent_requests == pytest.approx(15_360 * 3 / 290)
    assert mix.max_len_concurrency == 7.5 and mix.waste_share == pytest.approx(4 / 4640)
    assert length_mix(v, [40_000]).too_long == 1


def test_length_percentiles_and_bad_input():
    from kvviz.calculator.server_mix import lengths_from_percentiles, parse_lengths_csv, parse_percentiles

    pts = parse_percentiles("50:2000, 90:8000,99:16000")
    assert pts == [(50.0, 2000), (90.0, 8000), (99.0, 16000)]
    xs = lengths_from_percentiles(pts, 100)
    assert len(xs) == 100 and xs == sorted(xs) and xs[49] <= 2000 <= xs[50] and xs[-1] == 16000
    for bad in ("", "90", "50:10,90:5", "150:3", "50:x"):
        with pytest.raises(CalcError):
            parse_percentiles(bad)
    for bad in ("", "length\n", "foo,bar\n1,2", "12\nabc", "0"):
        with pytest.raises(CalcError):
            parse_lengths_csv(bad)


def test_profiling_rest_line_is_the_available_memory():
    """vLLM's later V0 worker logs 'the rest of the memory reserved for KV Cache is 1.57GiB' (posted in
    vllm#14447); the reconciler takes it as the available memory, like V1's 'Available KV cache memory'."""
    log = parse_vllm_log("INFO [worker.py:267] model weights take 21.21GiB; non_torch_memory takes 0.20GiB; "
                         "PyTorch activation peak memory takes 0.37GiB; the rest of the memory reserved for KV Cache "
                         "is 1.57GiB.")
    assert log.available_gib == 1.57 and log.found


def test_estimate_brackets_a_real_profile(presets):
    """vllm#10517 (Llama-3.1-8B on an RTX 3090, 23.58 GiB, utilization 0.9, 20,000 batched tokens: V0
    without chunked prefill) logged kv_cache_size=3.81GiB. The estimate from the GPU, the weights and the
    typical overheads lands within its stated spread of that figure (and is not exact: it says so)."""
    from kvviz.calculator.servers import EngineRequest, vllm_estimate

    spec = parse_config(LLAMA31_8B)
    est = vllm_estimate(spec, EngineRequest("vllm", 20000, gpu_gib=23.58, params=8_030_261_248,
                                            max_num_batched_tokens=20000))
    assert abs(est.available - 3.81 * GIB) <= est.spread
    assert est.spread < 2 * GIB and "estimate" in est.to_dict()["kind"]


def test_vllm_serve_default_batched_tokens(presets):
    """vLLM 0.33 vllm/engine/arg_utils.py:2973-3004 (get_batch_defaults): `vllm serve` batches 16,384 tokens
    on a GPU of >= 160 GiB (B200, B300), 8,192 on one of >= 70 GiB that is neither an A100 nor a GB10,
    2,048 otherwise; the CPU backend 2,048 x world size (:3027-3036). gpt-oss's sliding group then holds
    ceil((127 + 2 x 8,192) / 16) + 1 = 1,033 blocks a request on an H100 (two batches in flight)."""
    from kvviz.calculator.server_vllm_defaults import default_batched_tokens
    from kvviz.calculator.servers import EngineRequest, engine_report

    assert default_batched_tokens(79.6, "H100 SXM (80 GB)") == 8192
    assert default_batched_tokens(178.0, "B200") == default_batched_tokens(160.0) == 16384
    assert default_batched_tokens(159.9, "H200") == 8192
    assert default_batched_tokens(80.0, "A100 80GB SXM") == 2048 and default_batched_tokens(22.5, "L4") == 2048
    assert default_batched_tokens(119.0, "NVIDIA GB10") == 2048
    assert default_batched_tokens(None) == 2048
    assert default_batched_tokens(None, device="cpu", world_size=2) == 4096
    d, _ = engine_report(presets["gpt-oss-20b"], EngineRequest("vllm", 131072, kv_memory_gib=10, gpu_gib=79.6,
                                                               gpu_name="H100 SXM (80 GB)"))
    assert d["groups"][0]["blocks_per_request"] == 1033 and d["max_num_batched_tokens"] == 8192
    assert d["tokens_in_flight"] == 16384 and d["async_scheduling"]


GPT_OSS_120B = {  # https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json (layer_types alternate)
    "model_type": "gpt_oss", "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_size": 2880, "sliding_window": 128, "max_position_embeddings": 131072,
    "layer_types": ["sliding_attention", "full_attention"] * 18}
QWEN3_CODER_30B = {  # https://huggingface.co/Qwen/Qwen3-Coder-30B-A3B-Instruct/blob/main/config.json
    "model_type": "qwen3_moe", "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "hidden_size": 2048, "max_position_embeddings": 262144}


def test_real_hybrid_error_gpt_oss_120b():
    """vllm#27508: `vllm serve openai/gpt-oss-120b --max-num-batched-tokens 1024` on an H100 logged
    '(4.54 GiB KV cache is needed, ... available KV cache memory (1.71 GiB)'. Two groups of 18 layers,
    page 16 x 8 x 64 x 2 x 2 = 32,768 B; a 131,072 request: 8,192 full blocks + ceil((127 + 1,024) / 16) + 1
    = 73 sliding ones: 18 x 32,768 x 8,265 = 4,874,895,360 B = 4.54 GiB. At the 2,048 default it would be
    4.58: the reconciler names the flag."""
    spec = parse_config(GPT_OSS_120B)
    log = parse_vllm_log("ValueError: To serve at least one request with the models's max seq len (131072), (4.54 GiB "
                         "KV cache is needed, which is larger than the available KV cache memory (1.71 GiB). Based on "
                         "the available memory, the estimated maximum model lengt")
    rows, _ = reconcile(spec, log, VLLMSettings(0, 131072, max_num_batched_tokens=1024))
    need = next(r for r in rows if r.what.startswith("KV needed"))
    assert need.agrees and "(4,874,895,360 B)" in need.predicted
    rows, _ = reconcile(spec, log, VLLMSettings(0, 131072, max_num_batched_tokens=2048))
    need = next(r for r in rows if r.what.startswith("KV needed"))
    assert not need.agrees and "--max-num-batched-tokens 1024" in need.why


def test_real_pp_error_explained():
    """vllm#34076 (Qwen3-Coder-30B-A3B-Instruct-FP8, PP 2): '(24.0 GiB KV cache is needed ... (3.18 GiB) ...
    estimated maximum model length is 34736' is the whole model's 48 layers x 2,048 B x 262,144 tokens = 24 GiB
    against one GPU: the version the issue reports did not project the check onto each stage. At pp 1 every
    figure reproduces; at pp 2 the reconciler says why the stage's own 12 GiB differs."""
    spec = parse_config(QWEN3_CODER_30B)
    log = parse_vllm_log("ValueError: To serve at least one request with the models's max seq len (262144), (24.0 GiB "
                         "KV cache is needed, which is larger than the available KV cache memory (3.18 GiB). Based on "
                         "the available memory, the estimated maximum model length is 34736. Try increasing")
    rows, _ = reconcile(spec, log, VLLMSettings(0, 262144))
    assert all(r.agrees for r in rows) and len(rows) == 3
    rows, _ = reconcile(spec, log, VLLMSettings(0, 262144, pp=2))
    need = next(r for r in rows if r.what.startswith("KV needed"))
    assert not need.agrees and "vllm#34076" in need.why


def test_llamacpp_swa_cache_padded_to_256_real_gpt_oss_log(presets):
    """A published llama.cpp startup log of gpt-oss-20b at -c 131072 (llama_kv_cache_iswa):
    "creating SWA KV cache, size = 768 cells": min(131,072, window 128 + n_ubatch 512) = 640, padded
    to 256 (llama-kv-cache-iswa.cpp GGML_PAD(..., 256)). kvviz said 640 cells, 7.50 MiB."""
    ll = llamacpp_sizing(presets["gpt-oss-20b"], 131072)
    assert ll.lines == (
        "llama_kv_cache: size = 3072.00 MiB (131072 cells,  12 layers,  1/1 seqs), K (f16): 1536.00 MiB, "
        "V (f16): 1536.00 MiB",
        "llama_kv_cache: size =   18.00 MiB (   768 cells,  12 layers,  1/1 seqs), K (f16):    9.00 MiB, "
        "V (f16):    9.00 MiB")
