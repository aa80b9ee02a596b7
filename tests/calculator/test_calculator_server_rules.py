"""Engine sizing round 2 (issue 41): each rule read from the engines' source, with the file and line of
the version named (vLLM 0.33.0 and the llama.cpp bundled in llama-cpp-python 0.3.36, their PyPI sdists),
hand-worked, and checked against the figures real engines printed (issue 40's vLLM CPU runs, vllm#19996).
"""
from __future__ import annotations

import json

import pytest

from kvviz.calculator import CalcError, load_presets, parse_config
from kvviz.calculator.server_llamacpp import llamacpp_sizing
from kvviz.calculator.server_log import parse_vllm_log, reconcile
from kvviz.calculator.server_vllm import VLLMSettings, vllm_sizing
from kvviz.calculator.servers import EngineRequest, engine_report
from kvviz.units import GIB
from memory_cli_checks import run_error, run_json

MIB = 1024**2


# ----------------------------------------------------------------------------- rule 1: the one tokens line
def test_cpu_backend_smollm2_measured_by_vllm(capsys):
    """Issue 40: vLLM's CPU build served SmolLM2-135M with VLLM_CPU_KVCACHE_SPACE=1 and printed "CPU KV cache
    size: 46,592 tokens, Maximum concurrency for 2,048 tokens per request: 22.75x". The CPU backend's block
    is 128 (vllm/platforms/cpu.py:550-563), its budget the variable's GiB (:341-344). Page = 128 x 3 KV heads
    x 64 x 2 x 2 B = 98,304 B; 30 layers a block = 2,949,120 B; 1 GiB // that = 364 blocks; a 2,048 request
    = 16 blocks: 22.75x; int(22.75 x 2,048) = 46,592 (v1/core/kv_cache_utils.py:1120-1153, one line, "CPU")."""
    d = run_json(capsys, "--preset", "smollm2-135m", "--engine", "vllm", "--device", "cpu", "--kv-memory-gib", "1",
                 "--max-model-len", "2048")["engine"]
    assert (d["block_size"], d["bytes_per_block"], d["num_blocks"], d["kv_cache_tokens"]) == (128, 2_949_120, 364, 46_592)
    assert d["log_lines"][1] == ("CPU KV cache size: 46,592 tokens, Maximum concurrency for 2,048 tokens per request: "
                                 "22.75x")


def test_cpu_backend_gemma3_270m_hybrid_tokens_line():
    """Issue 40: Gemma 3 270M's config with dummy weights, 1 GiB, --max-model-len 32768 printed "CPU KV cache
    size: 202,849 tokens, Maximum concurrency for 32,768 tokens per request: 6.19x". Six groups of 3 layers
    (5 sliding, 1 full), page 128 x 1 x 256 x 2 x 2 = 131,072 B: 1 GiB // (3 x 131,072) = 2,730 blocks. The
    CPU backend has no async scheduling (cpu.py:347-348): one batch in flight. Each sliding group holds
    ceil((511 + 4,096) / 128) + 1 = 37 blocks (kv_cache_interface.py:937-944), the full one 256: 441 blocks a
    request; 2,730 / 441 = 6.1905x; int(6.1905... x 32,768) = 202,849. blocks // groups x block = 58,240 was
    kvviz's old line. 4,096 batched tokens is the offline vllm.LLM's CPU default (engine/arg_utils.py:3027-3036;
    `vllm serve` batches 2,048 there, 7.56x)."""
    spec = load_presets()["gemma-3-270m"]
    v = vllm_sizing(spec, VLLMSettings(GIB, 32768, block_size=128, device="cpu", max_num_batched_tokens=4096))
    assert (v.num_blocks, [g.blocks_per_request for g in v.groups]) == (2730, [37] * 5 + [256])
    assert v.lines[1] == "CPU KV cache size: 202,849 tokens, Maximum concurrency for 32,768 tokens per request: 6.19x"
    assert v.tokens_by_groups == 58_240
    serve = vllm_sizing(spec, VLLMSettings(GIB, 32768, block_size=128, device="cpu"))
    assert f"{serve.max_concurrency:.2f}" == "7.56"  # 2,730 / (5 x (ceil(2,559 / 128) + 1) + 256) = 2,730 / 361


def test_reconciler_reads_the_one_line_format():
    """The 0.33 line carries tokens and concurrency together; the reconciler reads both, knows the CPU
    backend from its first word, and compares int(concurrency x max_model_len), not blocks // groups."""
    spec = load_presets()["gemma-3-270m"]
    log = parse_vllm_log("INFO [gpu_worker.py:400] Available KV cache memory: 1.00 GiB\n(EngineCore pid=7) INFO "
                         "[kv_cache_utils.py:1140] CPU KV cache size: 202,849 tokens, Maximum concurrency for 32,768 "
                         "tokens per request: 6.19x\n")
    assert (log.device, log.tokens, log.concurrency_len, log.concurrency, log.one_line) == (
        "CPU", 202_849, 32_768, 6.19, True)
    rows, notes = reconcile(spec, log, VLLMSettings(0, 32768, block_size=128, max_num_batched_tokens=4096))
    assert all(r.agrees for r in rows), [r.to_dict() for r in rows]
    assert rows[1].what == "CPU KV cache size" and any("CPU backend" in n for n in notes)
    # without the 4,096 batched tokens the concurrency says which setting differs
    rows, _ = reconcile(spec, log, VLLMSettings(0, 32768, block_size=128))
    assert not all(r.agrees for r in rows)


# ----------------------------------------------------------------------------- rule 9: the error's wording
def test_too_long_error_reads_model_s_and_links_the_docs(presets):
    """v1/core/kv_cache_planning.py:66-86: "the model's max seq len", the CPU remark and the docs link; the
    printed memory is the available less the null block (:1528-1537). The reconciler reads both wordings:
    an error that says "model's" adds one block back to the printed memory before it estimates."""
    spec = presets["llama-3-8b"]
    v = vllm_sizing(spec, VLLMSettings(GIB, 16384))
    # GiB as vllm/utils/mem_utils.py:30-31 prints them, round(x, 2): "2.0", as vLLM 0.32 printed here.
    assert "with the model's max seq len (16384), (2.0 GiB KV cache is needed" in v.lines[1]
    assert "memory (1.0 GiB)" in v.lines[1] and v.lines[1].endswith(
        "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
    log = parse_vllm_log(v.lines[1])
    assert log.model_s and log.too_long == (16384, 2.0, 1.0, 8176)
    rows, _ = reconcile(spec, log, VLLMSettings(0, 16384))
    assert all(r.agrees for r in rows), [r.to_dict() for r in rows]


# ----------------------------------------------------------------------------- rule 2: in flight
def test_sliding_blocks_hold_two_batches_under_async_scheduling(presets):
    """kv_cache_interface.py:937-944: window - 1 + extra retained + max_in_flight_tokens; config/vllm.py:588-609:
    in flight = max_concurrent_batches x max_num_batched_tokens, 2 batches under async scheduling (the GPU
    default, config/vllm.py:1685-1719), PP + 1 with PP (model runner V2), 1 with --no-async-scheduling.
    gpt-oss-20b, window 128, 2,048 batched: ceil((127 + 4,096) / 16) + 1 = 265; without async 137; at PP 2
    three batches: ceil((127 + 6,144) / 16) + 1 = 393."""
    spec = presets["gpt-oss-20b"]
    blocks = {name: vllm_sizing(spec, s).groups[0].blocks_per_request for name, s in (
        ("async", VLLMSettings(10 * GIB, 131072)), ("sync", VLLMSettings(10 * GIB, 131072, async_scheduling=False)),
        ("pp2", VLLMSettings(10 * GIB, 131072, pp=2)), ("cpu", VLLMSettings(10 * GIB, 131072, device="cpu")))}
    assert blocks == {"async": 265, "sync": 137, "pp2": 393, "cpu": 137}


# ----------------------------------------------------------------------------- rule 3: the 16,384 tier
def test_sixteen_thousand_tier_on_160_gib_gpus(presets):
    """engine/arg_utils.py:2973-3004: >= 160 GiB (B200) batches 16,384 for `vllm serve`: gpt-oss's sliding
    group then holds ceil((127 + 2 x 16,384) / 16) + 1 = 2,057 blocks."""
    d, _ = engine_report(presets["gpt-oss-20b"], EngineRequest("vllm", 131072, kv_memory_gib=10, gpu_gib=178.4,
                                                               gpu_name="B200"))
    assert d["max_num_batched_tokens"] == 16384 and d["groups"][0]["blocks_per_request"] == 2057


# ----------------------------------------------------------------------------- rule 8: a draft's layers
EAGLE_LLAMA31_8B = {  # https://huggingface.co/yuhuili/EAGLE-LLaMA3.1-Instruct-8B/blob/main/config.json
    "model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 2048, "vocab_size": 128256}
LLAMA31_8B = {  # https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json
    "model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 4096, "max_position_embeddings": 131072}
LOG_19996 = """\
INFO 06-23 14:21:48 [gpu_worker.py:232] Available KV cache memory: 51.63 GiB
INFO 06-23 14:21:48 [kv_cache_utils.py:716] GPU KV cache size: 410,128 tokens
INFO 06-23 14:21:48 [kv_cache_utils.py:720] Maximum concurrency for 131,072 tokens per request: 3.13x"""


def test_eagle_draft_layers_hold_kv_real_log():
    """vllm#19996 (Llama-3.1-8B + EAGLE, H100): 51.63 GiB, 410,128 tokens, 3.13x. The draft's one layer has
    the target's page (8 KV heads x 128), so a block is 33 x 65,536 B = 2,162,688 B: 51.63 GiB holds
    25,631-25,636 blocks, 410,096-410,176 tokens (that vLLM's blocks x 16); 32 layers would give 422,944.
    The log is a two-line one: sized with that vLLM's rules (older)."""
    spec, draft = parse_config(LLAMA31_8B), parse_config(EAGLE_LLAMA31_8B)
    log = parse_vllm_log(LOG_19996)
    rows, _ = reconcile(spec, log, VLLMSettings(0, 131072, draft=draft))
    assert len(rows) == 3 and all(r.agrees for r in rows), [r.to_dict() for r in rows]
    v = vllm_sizing(spec, VLLMSettings(int(51.63 * GIB), 131072, draft=draft))
    assert v.bytes_per_block == 33 * 65_536 and v.draft_layers == 1 and v.groups[0].layers[-1] == 32
    rows, _ = reconcile(spec, log, VLLMSettings(0, 131072))  # without the draft: named as the likely cause
    assert not rows[1].agrees and "--draft-config" in rows[1].why


def test_draft_config_cli_and_other_pages(capsys, tmp_path):
    """--draft-config FILE through the CLI; a draft with other KV heads joins the target's full-attention
    group as one UniformTypeKVCacheSpecs group (kv_cache_planning.py:1141-1146): a block is the pages summed,
    32 x 65,536 + 2 x 32,768 B (a 2-layer draft with 4 KV heads)."""
    (tmp_path / "t.json").write_text(json.dumps(LLAMA31_8B))
    (tmp_path / "d.json").write_text(json.dumps({**EAGLE_LLAMA31_8B, "num_hidden_layers": 2, "num_key_value_heads": 4}))
    d = run_json(capsys, "--config", str(tmp_path / "t.json"), "--engine", "vllm", "--kv-memory-gib", "10",
                 "--max-model-len", "8192", "--draft-config", str(tmp_path / "d.json"))["engine"]
    assert d["bytes_per_block"] == 32 * 65_536 + 2 * 32_768 and d["draft_layers"] == 2
    assert d["num_blocks"] == 10 * GIB // (32 * 65_536 + 2 * 32_768)
    assert "sized for vLLM and SGLang only" in run_error(capsys, "--config", str(tmp_path / "t.json"), "--engine", "llama.cpp",
                                              "--max-model-len", "8192", "--draft-config", str(tmp_path / "d.json"))


# rules 4 and 5 (mixed pages on a hybrid model, bytes per block): tests/calculator/test_calculator_server_vllm_groups.py


def test_sglang_draft_pool_holds_the_targets_tokens(capsys, tmp_path):
    """SGLang 0.5.23: the target's cell carries the EAGLE draft's layers at the target's per-layer size
    (model_executor/pool_configurator.py:259-320: cell += int(cell x draft layers / layers)), and the draft
    worker reuses the target's MemoryPoolConfig (mem_cache/kv_cache_configurator.py:470-476) for a pool of its
    own layers with its own line (mem_cache/memory_pool.py:2083-2100). Llama-3.1-8B at 10 GiB rest: cell
    8 x 128 x 32 x 2 x 2 = 131,072 B + int(131,072 x 1 / 32) = 4,096 -> 135,168 B; 10,737,418,240 // 135,168 =
    79,437 tokens (0.5.10.post1, which left the draft out of the cell, held 81,920); the draft's one layer:
    (79,437 + 1 padding slot) x 8 x 128 x 1 x 2 B = 162,689,024 B of K (0.1515 GiB -> "0.15 GB"), as much V
    (fp16: kvviz's --dtype default)."""
    (tmp_path / "t.json").write_text(json.dumps(LLAMA31_8B))
    (tmp_path / "d.json").write_text(json.dumps(EAGLE_LLAMA31_8B))
    d = run_json(capsys, "--config", str(tmp_path / "t.json"), "--engine", "sglang", "--kv-memory-gib", "10",
                 "--max-model-len", "8192", "--draft-config", str(tmp_path / "d.json"))["engine"]
    assert (d["cell_bytes"], d["max_total_num_tokens"], d["draft_layers_in_cell"]) == (135_168, 79_437, 1)
    assert (d["draft"]["k_bytes"], d["draft"]["v_bytes"], d["draft"]["layers"]) == (162_689_024, 162_689_024, 1)
    assert d["draft"]["log_line"] == ("KV Cache is allocated. dtype: torch.float16, #tokens: 79437, K size: 0.15 GB, "
                                      "V size: 0.15 GB")


# ----------------------------------------------------------------------------- rule 11: -ub
def test_ubatch_size_sizes_the_sliding_cache(presets, capsys):
    """llama-kv-cache-iswa.cpp:73: GGML_PAD(min(size_base, n_swa + n_ubatch), 256). gpt-oss-20b (window
    128, 12 sliding layers of 8 x 64 values) at -ub 2048: pad(2,176, 256) = 2,304 cells, 12 x 1,024 B x
    2,304 x 2 (K, V) = 54 MiB; at the default 512, 768 cells and 18 MiB. n_ubatch is at most -b
    (llama-context.cpp:246-248): -ub 4096 with -b 2048 is 2,048."""
    swa = llamacpp_sizing(presets["gpt-oss-20b"], 131072, n_ubatch=2048).caches[1]
    assert (swa.cells, swa.bytes) == (2304, 54 * MIB)
    assert llamacpp_sizing(presets["gpt-oss-20b"], 131072).caches[1].cells == 768
    d = run_json(capsys, "--preset", "gpt-oss-20b", "--engine", "llama.cpp", "--max-model-len", "131072",
                 "-ub", "4096")["engine"]
    assert d["caches"][1]["cells"] == 2304 and any("-ub 4,096 becomes 2,048" in n for n in d["notes"])


# ----------------------------------------------------------------------------- rule 12: per-layer rows
def test_llamacpp_mla_is_k_only(presets):
    """conversion/deepseek.py:326, 350: MLA is stored as one KV head of kv_lora_rank + qk_rope_head_dim
    values; llama-kv-cache.cpp:226-227 (has_v = !is_mla): K only. DeepSeek-V3: 61 layers x 576 values x
    2 B x 4,096 cells = 274.5 MiB, V 0."""
    ll = llamacpp_sizing(presets["deepseek-v3"], 4096)
    c = ll.caches[0]
    assert (c.k_bytes, c.v_bytes) == (61 * 576 * 2 * 4096, 0)
    assert ll.lines[0].endswith("K (f16):  274.50 MiB, V (f16):    0.00 MiB")


def test_llamacpp_flash_attention_off_refuses_a_quantized_v(presets, capsys):
    """llama-context.cpp:467: "quantized V cache was requested, but this requires Flash Attention". With
    -fa off an f16 V is sized as before (every layer's V row is the same width here, so padding to
    n_embd_v_gqa_max, llama-kv-cache.cpp:209-210, adds nothing)."""
    with pytest.raises(CalcError, match="requires Flash Attention"):
        llamacpp_sizing(presets["llama-3-8b"], 8192, type_v="q8_0", flash_attn=False)
    off = llamacpp_sizing(presets["llama-3-8b"], 8192, flash_attn=False)
    assert off.total_bytes == llamacpp_sizing(presets["llama-3-8b"], 8192).total_bytes == 1024 * MIB
    assert "requires Flash Attention" in run_error(capsys, "--preset", "llama-3-8b", "--engine", "llama.cpp",
                                                   "--max-model-len", "8192", "-ctv", "q8_0", "-fa", "off")


# ----------------------------------------------------------------------------- rule 13: shared layers
GEMMA3N_E2B_TEXT = {  # https://huggingface.co/google/gemma-3n-E2B-it/blob/main/config.json (text_config)
    "model_type": "gemma3n_text", "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "hidden_size": 2048, "num_kv_shared_layers": 10, "sliding_window": 512,
    "max_position_embeddings": 32768,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 6}


def test_layers_reusing_another_layers_cache_allocate_nothing():
    """llama-hparams.cpp:321-331 (has_kv: il < n_layer_kv_from_start) and llama-model.cpp's reuse callback for
    Gemma 3n: the last num_kv_shared_layers read earlier layers' K/V. Gemma 3n E2B: 30 layers, 10 shared,
    so 20 caches: 16 sliding + 4 full. vLLM likewise gives a layer with kv_sharing_target_layer_name no spec
    (model_executor/models/gemma3n.py:312)."""
    spec = parse_config(GEMMA3N_E2B_TEXT)
    assert spec.kv_shared_layers == 10
    full, swa = llamacpp_sizing(spec, 8192).caches
    assert (full.layers, swa.layers) == (4, 16)
    v = vllm_sizing(spec, VLLMSettings(GIB, 8192))
    assert sum(len(g.layers) for g in v.groups) == 20 and max(i for g in v.groups for i in g.layers) == 19


# ----------------------------------------------------------------------------- rule 7: KV formats
@pytest.mark.parametrize("kv_dtype, page", [
    ("fp8_e4m3", 16 * 8 * 256),                      # (128 + 128) x 1 B, 8 KV heads, 16 tokens = 32,768
    ("int8_per_token_head", 16 * 8 * (256 + 8)),     # + an fp32 scale for K and one for V = 33,792
    ("fp8_per_token_head", 16 * 8 * (256 + 8)),
    ("int4_per_token_head", 16 * 8 * (128 + 8)),     # two values a byte: (64 + 64) + 8 = 136 -> 17,408
])
def test_scaled_kv_formats_pages(presets, kv_dtype, page):
    """config/cache.py:44-68 lists the formats; triton_attn.py:307-319 (TritonAttentionBackend.customize_spec)
    packs one fp32 scale after each head's K and V data (int4: two values a byte); the page is KV heads x
    tokens x that content (kv_cache_interface.py:585-602). Llama-3-8B: 8 KV heads x 128, block 16."""
    v = vllm_sizing(presets["llama-3-8b"], VLLMSettings(10 * GIB, 8192, kv_dtype=kv_dtype))
    assert v.page_bytes == page and v.num_blocks == 10 * GIB // (32 * page)


def test_mla_scaled_and_ds_mla_formats(presets):
    """MLA keeps one latent of kv_lora_rank + qk_rope_head_dim = 576 values a token (DeepSeek-V3).
    int8_per_token_head: 576 + 2 x 4 = 584 B (mla_attention.py:1598-1612); fp8_ds_mla's packed token is 656 B
    (mla_attention.py:1383-1388); bf16 1,152 B. A dense model cannot use the ds_mla layout."""
    spec = presets["deepseek-v3"]
    pages = {dt: vllm_sizing(spec, VLLMSettings(10 * GIB, 8192, block_size=64, kv_dtype=dt)).page_bytes
             for dt in ("bf16", "int8_per_token_head", "fp8_ds_mla", "nvfp4_ds_mla")}
    assert pages == {"bf16": 64 * 1152, "int8_per_token_head": 64 * 584, "fp8_ds_mla": 64 * 656,
                     "nvfp4_ds_mla": 64 * 352}
    with pytest.raises(CalcError, match="has no MLA"):
        vllm_sizing(presets["llama-3-8b"], VLLMSettings(10 * GIB, 8192, kv_dtype="fp8_ds_mla"))
    with pytest.raises(CalcError, match="not modelled yet"):
        vllm_sizing(presets["llama-3-8b"], VLLMSettings(10 * GIB, 8192, kv_dtype="turboquant_k8v4"))


def test_scaled_format_through_the_cli_and_a_log(capsys, presets):
    """--kv-cache-dtype takes vLLM's names; a log's kv_cache_dtype=int8_per_token_head is read as such."""
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "vllm", "--kv-memory-gib", "10", "--max-model-len",
                 "8192", "--kv-cache-dtype", "int8_per_token_head")["engine"]
    assert (d["kv_dtype"], d["page_size_bytes"]) == ("int8_per_token_head", 33_792)
    log = parse_vllm_log("config: kv_cache_dtype=int8_per_token_head, max_seq_len=8192\n"
                         "Available KV cache memory: 10.00 GiB\n")
    assert log.setting("kv_dtype") == "int8_per_token_head"


# ----------------------------------------------------------------------------- rule 6: pipeline stages
def test_pp_layer_partition_and_each_stages_memory(presets, capsys):
    """vllm/distributed/utils.py:214-223: VLLM_PP_LAYER_PARTITION gives each stage's layers (its count must
    match pp and its sum the layers, in vLLM's own words); kv_cache_planning.py:1461-1590: each worker's
    blocks come from its own memory and its own layers, and every worker keeps the smallest. Llama-3-8B
    (65,536 B a layer and block) split 20 + 12 with 10 GiB and 6 GiB: 10 GiB // (20 x 65,536) = 8,192 and
    6 GiB // (12 x 65,536) = 8,192 blocks; an even split 16 + 16 would leave the second stage 6,144."""
    spec = presets["llama-3-8b"]
    v = vllm_sizing(spec, VLLMSettings(0, 8192, pp=2, pp_layers=(20, 12), stage_memory=(10 * GIB, 6 * GIB)))
    assert v.stages == ((0, 20), (20, 32)) and v.num_blocks == 8192
    assert v.lines[:2] == ("(stage 0) Available KV cache memory: 10.00 GiB",
                           "(stage 1) Available KV cache memory: 6.00 GiB")
    even = vllm_sizing(spec, VLLMSettings(0, 8192, pp=2, stage_memory=(10 * GIB, 6 * GIB)))
    assert even.num_blocks == 6 * GIB // (16 * 65_536) == 6144
    with pytest.raises(CalcError, match=r"sum\(partitions\)=31 does not match num_hidden_layers=32"):
        vllm_sizing(spec, VLLMSettings(GIB, 8192, pp=2, pp_layers=(20, 11)))
    with pytest.raises(CalcError, match=r"len\(partitions\)=3 does not match pp_size=2"):
        vllm_sizing(spec, VLLMSettings(GIB, 8192, pp=2, pp_layers=(10, 10, 12)))
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "vllm", "--max-model-len", "8192",
                 "--pp-layer-partition", "20,12", "--stage-kv-memory-gib", "10,6")["engine"]
    assert (d["pp"], d["num_blocks"], d["pp_layer_partition"]) == (2, 8192, [20, 12])
    assert "Invalid partition string" in run_error(capsys, "--preset", "llama-3-8b", "--engine", "vllm",
                                                   "--max-model-len", "8192", "--pp-layer-partition", "20,x")


# ----------------------------------------------------------------------------- rule 10: the estimate
def test_available_memory_estimate_follows_request_memory(presets):
    """v1/worker/utils.py:716-726: requested = ceil(total x gpu_memory_utilization); gpu_worker.py:702-757:
    available = requested - the profiled non-KV memory - the CUDA graphs' estimate only when
    VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is set (opt-in). 24 GiB x 0.9: 25,769,803,776 x 0.9 =
    23,192,823,398.4 -> 23,192,823,399 B. The parts that are estimated carry their spread."""
    from kvviz.calculator.servers import vllm_estimate

    spec = presets["llama-3-8b"]
    est = vllm_estimate(spec, EngineRequest("vllm", 8192, gpu_gib=24.0, params=8_030_261_248))
    assert est.parts[0][1] == 23_192_823_399 and est.parts[0][2] == 0
    graphs = est.parts[-1]
    assert graphs[1:] == (0, 0) and "not subtracted" in graphs[0]
    on = vllm_estimate(spec, EngineRequest("vllm", 8192, gpu_gib=24.0, params=8_030_261_248, cudagraph_estimate=True))
    assert on.parts[-1][1:] == (-GIB // 2, GIB // 2) and on.available == est.available - GIB // 2
    assert est.spread == sum(u for _, _, u in est.parts) > 0


# ----------------------------------------------------------------------------- rules 14, 15: SGLang
# SGLang 0.5.23 (its PyPI wheel); more of rules 14 and 15 in tests/calculator/test_calculator_sglang_0523.py.
def test_sglang_rest_from_its_avail_mem_lines(capsys):
    """mem_cache/kv_cache_configurator.py:2990-3060 (_profile_available_bytes): rest = the memory free after
    loading - the memory free before x (1 - mem_fraction_static) - the multimodal reserve (0 for a text
    model), in GB of 2^30, then int(rest x 2^30) // cell (model_executor/pool_configurator.py:637-647). 'avail mem' 80 GB before, 64 after, 0.9: 64 - 80 x 0.1 = 56 GB =
    60,129,542,144 B; Llama-3-8B's cell 8 x 128 x 32 x 2 x 2 = 131,072 B: 458,752 tokens."""
    d = run_json(capsys, "--preset", "llama-3-8b", "--engine", "sglang", "--seq-len", "8192",
                 "--avail-mem-gib", "80,64")["engine"]
    assert (d["rest_bytes"], d["max_total_num_tokens"], d["exact"]) == (60_129_542_144, 458_752, True)
    assert "avail mem" in d["formula"][1]


def test_sglang_hybrid_swa_pools(presets):
    """HybridSWAPoolConfigurator (model_executor/pool_configurator.py:656-916) for the architectures
    configs/model_config.py:2651-2697 names (gpt-oss): cell = 2,048 B x 12 full + 0.8 x 2,048 B x 12 sliding =
    44,236.8 (:786-803), full = int(10 GiB // 44,236.8) = 242,725 (:915), sliding = int(242,725 x 0.8) = 194,180
    (swa_full_tokens_ratio 0.8, arg_groups/fields/schedule.py:150-162). Without the hybrid pool: 10 GiB //
    (8 x 64 x 24 x 2 x 2 B) = 218,453. Gemma 3 is not such an architecture: one pool."""
    from kvviz.calculator.server_sglang import sglang_sizing

    sg = sglang_sizing(presets["gpt-oss-20b"], 10 * GIB)
    assert (sg.tokens, sg.swa_tokens) == (242_725, 194_180)
    assert sg.line == "Use sliding window memory pool. full_layer_tokens=242725, swa_layer_tokens=194180"
    assert sglang_sizing(presets["gpt-oss-20b"], 10 * GIB, hybrid_swa=False).tokens == 218_453
    g = sglang_sizing(presets["gemma-3-4b"], 10 * GIB)
    assert g.swa_tokens is None and "one pool" in g.notes[0]
