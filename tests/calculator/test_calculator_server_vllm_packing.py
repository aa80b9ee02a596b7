"""Issue 41: vLLM's block-outermost packing (VLLM_KV_CACHE_LAYOUT=BLHNC / BLNHC / BHLNC), hand-worked from the
vLLM 0.33.0 sdist: _get_packed_kv_cache_groups (vllm/v1/core/kv_cache_planning.py:914-1041), called before the
pages are unified (:1159-1164), the block-outer bytes per block (:586-605) and validate_kv_cache_layout
(:608-639); the layouts of vllm/v1/kv_cache_layout.py:23-58. With a block-outer layout nothing is unified: each
block holds every layer's own page side by side, so a block is as wide as the widest group's pages.

gpt-oss-20b (the preset: 24 layers alternating sliding 128 / full, 8 KV heads of 64) has a page of 16 x 8 x
(64 + 64) x 2 B = 32,768 B; a one-layer Llama draft of 2 KV heads x 128 (hidden 4,096 / 32 heads) has
16 x 2 x 256 x 2 = 16,384 B. 10 GiB = 10,737,418,240 B, max_model_len 8,192, 4,096 tokens in flight (2 x the
default 2,048 under async scheduling): a sliding group holds ceil(min(127 + 4,096, 8,192) / 16) + 1 = 265 blocks
a request, a full one 512 (kv_cache_interface.py:640-646, 937-944).
"""
from __future__ import annotations

import json

import pytest

from kvviz.calculator import CalcError, load_presets, parse_config
from kvviz.calculator.server_vllm import VLLMSettings, vllm_sizing
from kvviz.calculator.server_vllm_groups import LayerSpec, approximate_gcd, block_outermost, pack_layers
from kvviz.cli.main import main
from kvviz.units import GIB

DRAFT = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 2,
         "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 2048, "vocab_size": 128256}
GEMMA3_270M = {  # https://huggingface.co/google/gemma-3-270m/blob/main/config.json (5 sliding : 1 full)
    "model_type": "gemma3_text", "hidden_size": 640, "head_dim": 256, "num_attention_heads": 4,
    "num_hidden_layers": 18, "num_key_value_heads": 1, "max_position_embeddings": 32768, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3}


@pytest.fixture(scope="module")
def gpt_oss():
    return load_presets()["gpt-oss-20b"]


def size(spec, layout: str | None, draft: dict = DRAFT, **kw):
    return vllm_sizing(spec, VLLMSettings(10 * GIB, 8192, draft=parse_config(draft), kv_cache_layout=layout, **kw))


def test_block_outer_packs_the_draft_beside_the_full_layers(gpt_oss):
    """BLHNC: buckets by uniform type (:934-942): 12 sliding (one page size, balanced), 12 full at 32,768 + the
    draft at 16,384 (unbalanced, 12 : 1). No balanced bucket mixes pages, so no repeat count (:960-979) and
    every bucket is one group, but the sliding bucket is a state bucket (:995-1000): the widest block is the
    full bucket's 12 x 32,768 + 16,384 = 409,600 B, which holds 409,600 // 32,768 = 12 sliding pages, so the 12
    sliding layers stay one group (:1018-1024). Bytes per block = max(12 x 32,768, 409,600) = 409,600 (:586-605);
    10 GiB // 409,600 = 26,214 blocks; 265 + 512 = 777 blocks a request; 26,214 / 777 = 33.7375x;
    int(33.73745... x 8,192) = 276,377 tokens. The default layer-outer layout unifies the draft's page to 32
    tokens instead: 25 groups of one layer, 280,204 tokens (test_calculator_server_vllm_groups)."""
    v = size(gpt_oss, "BLHNC")
    assert [len(g.layers) for g in v.groups] == [12, 13] and v.groups[1].layers[-1] == 24
    assert {g.block_size for g in v.groups} == {16} and v.groups[1].page_bytes == 32_768
    assert (v.bytes_per_block, v.num_blocks, v.kv_cache_tokens, round(v.max_concurrency, 4)) == (
        409_600, 26_214, 276_377, 33.7375)
    assert v.lines[-1] == "GPU KV cache size: 276,377 tokens, Maximum concurrency for 8,192 tokens per request: 33.74x"
    assert "block-outermost" in v.notes[-1] and "padding layer" not in " ".join(v.notes)
    assert v.to_dict()["kv_cache_layout"] == "BLHNC"
    for layer_outer in (None, "LBNHC", "NHD", "HND", "LBHNC"):  # the default and its aliases: unchanged
        d = size(gpt_oss, layer_outer)
        assert (len(d.groups), d.bytes_per_block, d.kv_cache_tokens) == (25, 32_768, 280_204)


def test_a_state_bucket_is_split_to_the_widest_block():
    """Gemma 3 270M (1 KV head x 256: 16 x 1 x (256 + 256) x 2 B = 16,384 B a page; 15 sliding 512, 3 full) with a
    one-layer draft of 2 KV heads x 64 (hidden 1,024 / 16 heads; 16 x 2 x 128 x 2 = 8,192 B), BLNHC. Full bucket:
    layers 5, 11, 17 and the draft's 18, 3 x 16,384 + 8,192 = 57,344 B; the sliding bucket is a state bucket
    holding 57,344 // 16,384 = 3 pages a block, so it splits into ceil(15 / 3) = 5 groups, pattern repeats i::5
    of its layers 0-4, 6-10, 12-16 (:1018-1039): group 0 = layers 0, 6, 12. Bytes per block 57,344; 1 GiB //
    57,344 = 18,724 blocks. max_model_len 4,096: a sliding group ceil(min(511 + 4,096, 4,096) / 16) + 1 = 257,
    the full one 256: 5 x 257 + 256 = 1,541 a request; 18,724 / 1,541 = 12.15055...x; int(x 4,096) = 49,768."""
    draft = {**DRAFT, "num_attention_heads": 16, "hidden_size": 1024}
    v = vllm_sizing(parse_config(GEMMA3_270M), VLLMSettings(GIB, 4096, draft=parse_config(draft),
                                                            kv_cache_layout="BLNHC"))
    assert [g.layers for g in v.groups][:2] == [(0, 6, 12), (1, 7, 13)]
    assert [len(g.layers) for g in v.groups] == [3] * 5 + [4] and v.groups[-1].layers == (5, 11, 17, 18)
    assert (v.bytes_per_block, v.num_blocks, sum(g.blocks_per_request for g in v.groups)) == (57_344, 18_724, 1_541)
    assert v.kv_cache_tokens == 49_768


def page_layers(kind: str, span: int | None, pages: list[int], first: int) -> list[LayerSpec]:
    return [LayerSpec(first + i, kind, span, p, f"{p} B", 16) for i, p in enumerate(pages)]


def test_balanced_buckets_split_by_the_approximate_gcd():
    """A sliding bucket of 4 layers at 2,048 B and 4 at 1,024 B (balanced, 4 : 4, mixing pages) and a full bucket
    of 12 at 2,048 B (balanced, one size). The mixing bucket sets the floor, 4 repeats a group (:960-967);
    _approximate_gcd([4, 12], lower bound 4) pads 0 at d = 4 and more at every d up to 12 (d = 6: 2 + 0), so 4
    (:968-979). Sliding: ceil(4 / 4) = 1 group of its 8 layers; full: ceil(12 / 4) = 3 groups, repeats i::3,
    of 4 layers each (:981-984, 1029-1039). Bytes per block = max(4 x 2,048 + 4 x 1,024, 4 x 2,048) = 12,288."""
    sliding = page_layers("sliding", 128, [2048, 1024] * 4, 0)
    full = page_layers("full", None, [2048] * 12, 8)
    g = pack_layers(sliding + full)
    assert g is not None and [len(x) for x in g.groups] == [8, 4, 4, 4]
    assert [ly.index for ly in g.groups[1]] == [8, 11, 14, 17]
    assert max(sum(ly.page for ly in x) for x in g.groups) == 12_288
    assert pack_layers(full) is None  # one page size: the usual grouping (:930-932)


def test_approximate_gcd_by_hand():
    """_approximate_gcd (kv_cache_planning.py:879-911): the least total padding, ties to the larger d."""
    assert approximate_gcd([4, 12], 4) == 4  # pad 0
    assert approximate_gcd([4, 6], 4) == 6  # d=4: 0 + 2, d=5: 1 + 4, d=6: 2 + 0: the tie goes to 6
    assert approximate_gcd([3], 5) == 5  # lower bound above the max
    assert approximate_gcd([6, 9]) == 3  # d=1 and d=3 pad 0, every other d up to 9 pads more: the larger, 3
    assert [block_outermost(x) for x in ("BLHNC", "BHLNC", "LBNHC", "HND", None)] == [True, True, False, False, False]


def test_layouts_vllm_refuses(gpt_oss):
    """validate_kv_cache_layout (:608-639): BHLNC is block-outer but not block-compact (L and B are not its two
    outer dimensions), so mixed pages cannot be packed: vLLM's error. The CPU backend supports LBHNC only
    (cpu_attn.py:82-84), and an explicit layout outside the supported set is refused (backends/utils.py:362-368);
    an unknown name is refused by config/cache.py:33-41."""
    with pytest.raises(CalcError, match=r"KV cache layout BHLNC cannot express this model's mixed page sizes "
                                        r"\(\[16384, 32768\]\)"):
        size(gpt_oss, "BHLNC")
    with pytest.raises(CalcError, match=r"valid layouts: \['LBHNC'\]"):
        vllm_sizing(gpt_oss, VLLMSettings(10 * GIB, 8192, device="cpu", block_size=128, kv_cache_layout="BLHNC"))
    with pytest.raises(CalcError, match="Unknown KV cache layout 'XYZ'"):
        size(gpt_oss, "XYZ")
    one_page = vllm_sizing(gpt_oss, VLLMSettings(10 * GIB, 8192, kv_cache_layout="BHLNC"))  # one page size: fine
    assert one_page.kv_cache_tokens == vllm_sizing(gpt_oss, VLLMSettings(10 * GIB, 8192)).kv_cache_tokens


def test_cli_kv_cache_layout(capsys, tmp_path):
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps(DRAFT))
    assert main(["memory", "--preset", "gpt-oss-20b", "--engine", "vllm", "--kv-memory-gib", "10", "--max-model-len",
                 "8192", "--draft-config", str(draft), "--kv-cache-layout", "BLHNC", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)["engine"]
    assert (e["kv_cache_layout"], e["bytes_per_block"], e["kv_cache_tokens"]) == ("BLHNC", 409_600, 276_377)
    with pytest.raises(SystemExit):
        main(["memory", "--preset", "gpt-oss-20b", "--engine", "vllm", "--kv-memory-gib", "10", "--device", "cpu", "--max-model-len", "8192",
              "--kv-cache-layout", "BLHNC"])
    assert "valid layouts: ['LBHNC']" in capsys.readouterr().err
