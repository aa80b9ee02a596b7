"""Issue 41, rules 4 and 5: vLLM's bytes per block and its grouping of mixed pages, hand-worked from the
vLLM 0.33.0 sdist (vllm/v1/core/kv_cache_planning.py and vllm/v1/kv_cache_interface.py, line numbers of
that version). Every figure below is worked by hand in the test's docstring; the code must reproduce it.

Shared by every case: gpt-oss-20b (the preset: 24 layers alternating sliding 128 / full, 8 KV heads of 64)
has a page of 16 tokens x 8 x (64 + 64) x 2 B = 32,768 B; 10 GiB = 10,737,418,240 B; max_model_len 8,192;
a GPU with the default 2,048 batched tokens and async scheduling, so 4,096 tokens in flight. A sliding
group then holds ceil(min(127 + 4,096, 8,192) / 16) + 1 = 265 blocks a request (kv_cache_interface.py:
937-944), a full one ceil(8,192 / 16) = 512.
"""
from __future__ import annotations

import pytest

from kvviz.calculator import CalcError, load_presets, parse_config
from kvviz.calculator.server_vllm import VLLMSettings, vllm_sizing
from kvviz.calculator.server_vllm_groups import LayerSpec, bytes_per_block, group_layers, stride_alignment, unify_pages
from kvviz.units import GIB

# A one-layer EAGLE-style Llama draft (https://huggingface.co/yuhuili/EAGLE-LLaMA3.1-Instruct-8B/blob/main/
# config.json), its heads varied per case; head_dim = hidden / attention heads.
DRAFT = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 2048, "vocab_size": 128256}


@pytest.fixture(scope="module")
def gpt_oss():
    return load_presets()["gpt-oss-20b"]


def size(spec, draft: dict, **kw):
    return vllm_sizing(spec, VLLMSettings(10 * GIB, 8192, draft=parse_config({**DRAFT, **draft}), **kw))


def test_a_draft_with_the_targets_spec_joins_its_bucket(gpt_oss):
    """kv_cache_planning.py:484-486 buckets equal specs; :524-533's own example, "gpt-oss-20b + eagle, with
    12 sw + 13 full": a draft of 64 heads x 64 (8 KV heads) has the full layers' spec, so 12 sliding + 13
    full, group size 13 (13 < 1.5 x 12), one padding layer. Bytes per block = 13 x 32,768 = 425,984
    (:574-584); 10 GiB // 425,984 = 25,206 blocks; 265 + 512 = 777 blocks a request; 25,206 / 777 =
    32.4402x; int(32.44015... x 8,192) = 265,749 tokens."""
    v = size(gpt_oss, {"num_attention_heads": 64})
    assert (v.group_size, len(v.groups), v.bytes_per_block, v.num_blocks) == (13, 2, 425_984, 25_206)
    assert [len(g.layers) for g in v.groups] == [12, 13] and v.groups[1].layers[-1] == 24  # the draft's layer
    assert v.kv_cache_tokens == 265_749 and round(v.max_concurrency, 4) == 32.4402


def test_a_smaller_draft_page_takes_more_tokens_a_block(gpt_oss):
    """unify_kv_cache_spec_page_size (kv_cache_planning.py:346-410): a draft of 2 KV heads x 128 has a
    page of 16 x 2 x 256 x 2 = 16,384 B, which divides 32,768: its block becomes 2 x 16 = 32 tokens
    (:392-395). Its spec now differs from every target layer's, so three buckets (12 sliding, 12 full,
    1 draft): 12 >= 1.5 x 1, group size 1, 25 groups (:519-533). Bytes per block 32,768; 10 GiB // 32,768
    = 327,680 blocks. A request: 12 x 265 + 12 x 512 + ceil(8,192 / 32) = 3,180 + 6,144 + 256 = 9,580
    blocks; 327,680 / 9,580 = 34.2046x; int(34.20459... x 8,192) = 280,204 tokens."""
    v = size(gpt_oss, {"num_key_value_heads": 2})
    assert (v.group_size, len(v.groups), v.bytes_per_block, v.num_blocks) == (1, 25, 32_768, 327_680)
    draft = v.groups[-1]
    assert (draft.layers, draft.block_size, draft.blocks_per_request, draft.page_bytes) == ((24,), 32, 256, 32_768)
    assert sum(g.blocks_per_request for g in v.groups) == 9_580 and v.kv_cache_tokens == 280_204
    assert "32 tokens a block" in v.notes[0] and "block-outermost" in v.notes[-1]
    assert v.to_dict()["groups"][-1]["block_size"] == 32


def test_a_draft_page_that_does_not_divide_is_padded(gpt_oss):
    """kv_cache_planning.py:396-399: a draft of 24 heads, 3 KV heads x 128 (hidden 3,072) has a page of
    16 x 3 x 256 x 2 = 24,576 B; 32,768 % 24,576 != 0 and it is not MLA, so its page is padded to 32,768
    (8,192 B unused a block) at 16 tokens. 25 groups of one layer again, 327,680 blocks; a request
    3,180 + 6,144 + 512 = 9,836 blocks; 327,680 / 9,836 = 33.3144x; int(33.31435... x 8,192) = 272,911."""
    v = size(gpt_oss, {"num_attention_heads": 24, "num_key_value_heads": 3, "hidden_size": 3072})
    assert (v.bytes_per_block, v.num_blocks, v.groups[-1].block_size, v.groups[-1].blocks_per_request) == (
        32_768, 327_680, 16, 512)
    assert v.kv_cache_tokens == 272_911 and "padded to 32,768 B, 8,192 B unused" in v.notes[0]


def test_mla_beside_a_sliding_draft_falls_back_to_full_allocation():
    """DeepSeek-V2 (60 MLA layers, latent 512 + 64) at --block-size 64: page 64 x 576 x 2 = 73,728 B; a
    Mistral-style draft (8 KV heads x 128, sliding_window 4,096) 64 x 8 x 256 x 2 = 262,144 B, not a
    multiple of 73,728, and MLA cannot be padded (:400-405), so vLLM allocates the sliding layer as full
    attention and keeps one group (_try_get_full_allocation_fallback_groups, :819-850). Bytes per block =
    60 x 73,728 + 262,144 = 4,685,824; 10 GiB // that = 2,291 blocks; ceil(8,192 / 64) = 128 a request;
    2,291 / 128 = 17.8984375x; int(17.8984375 x 8,192) = 146,624 tokens."""
    mistral = {"model_type": "mistral", "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096, "sliding_window": 4096, "max_position_embeddings": 32768, "vocab_size": 32000}
    v = vllm_sizing(load_presets()["deepseek-v2"], VLLMSettings(10 * GIB, 8192, block_size=64,
                                                                draft=parse_config(mistral)))
    assert (len(v.groups), v.bytes_per_block, v.num_blocks, v.groups[0].blocks_per_request) == (1, 4_685_824, 2_291, 128)
    assert v.kv_cache_tokens == 146_624 and "treating sliding-window layers as full attention" in v.notes[0]


def test_an_mla_page_that_cannot_be_unified_is_refused():
    """kv_cache_planning.py:400-405: an MLA page that neither divides the largest nor may be padded raises;
    with no sliding layer to promote (the fallback needs MLA + plain sliding, :831-836) vLLM refuses."""
    layers = [LayerSpec(0, "mla", None, 73_728, "576 x 2 B", 64), LayerSpec(1, "chunked", 8192, 262_144, "8 x 256", 64)]
    with pytest.raises(CalcError, match="cannot unify these pages"):
        unify_pages(layers)
    with pytest.raises(CalcError, match="cannot unify"):
        group_layers(layers)


def test_block_stride_alignment_and_bytes_per_block():
    """kv_cache_interface.py:224-235 with v1/worker/utils.py:476-486: FlashMLA declares the fixed kernel
    block 64 (mla/flashmla.py:57-58), so MultipleOf(64); at --block-size 128, gcd(64, 128) = 64 != 128 and
    the alignment is a 64-token page, 64 x 576 x 2 = 73,728 B, which divides the 128-token page 147,456 B:
    the round-up (_get_layer_block_stride, kv_cache_planning.py:569-571) leaves it. At block 64 it is 1;
    FlashAttention's MultipleOf(16) and the CPU backend's MultipleOf(32) declare no fixed size: 1. A page
    that is not a multiple is rounded up: 100 B at alignment 64 -> 128 B a layer; the largest group's
    layers are summed (:578-584): max(128 + 128, 128) = 256."""
    mla_page = lambda tokens: tokens * 576 * 2  # noqa: E731
    assert stride_alignment(128, (64,), mla_page) == 73_728 and 147_456 % 73_728 == 0
    assert bytes_per_block([[mla_page(128)] * 3], stride_alignment(128, (64,), mla_page)) == 3 * 147_456
    assert stride_alignment(64, (64,), mla_page) == 1 and stride_alignment(16, (), mla_page) == 1
    assert bytes_per_block([[100, 100], [100]], 64) == 256
