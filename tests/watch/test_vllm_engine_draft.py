"""Issue 41's rules 2, 4, 5 and 8 against a real vLLM (0.32's CPU build, `make vllm`, dummy weights): a
hybrid target (Gemma 3 270M's layout, 15 sliding + 3 full layers) with a speculative draft model whose
page is half the target's, so vLLM gives the draft's layer 256-token blocks (kv_cache_planning.py's
unify_kv_cache_spec_page_size) and a group of its own, or a page that does not divide it, padded. kvviz's line must equal the engine's, and its
groups' block sizes the engine's "kv cache group sizes" line. Marked ``vllm``: skipped, saying why, where
.venv-vllm is missing (one start of vLLM: minutes of CPU)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvviz.calculator.server_vllm import VLLMSettings, vllm_sizing
from kvviz.calculator.hf_config import parse_config
from kvviz.watch.vllm_harness import missing_reason, vllm_server

from vllm_layouts import LAYOUTS

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]
LINE = re.compile(r"CPU KV cache size: [\d,]+ tokens, Maximum concurrency for [\d,]+ tokens per request: [\d.]+x")
GROUPS = re.compile(r"kv cache group sizes \(([\d, ]+)\)")
# A one-layer Llama draft: 1 KV head x 128 (half Gemma 3 270M's 1 x 256 page), the target's vocabulary.
DRAFT = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 640, "intermediate_size": 1024,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
         "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
         "vocab_size": 262144, "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 2, "eos_token_id": 1}


@pytest.mark.parametrize("head_dim, line, blocks", [
    (128, "CPU KV cache size: 78,581 tokens, Maximum concurrency for 4,096 tokens per request: 19.19x", 256),
    (96, "CPU KV cache size: 75,743 tokens, Maximum concurrency for 4,096 tokens per request: 18.49x", 128)])
def test_a_draft_of_another_page_is_rescaled_or_padded(tmp_path: Path, head_dim: int, line: str, blocks: int) -> None:
    """Measured here (vLLM 0.32.0 CPU, 1 GiB, --max-model-len 4096, 2 draft tokens), the lines in the parameters,
    groups (128 x 18, then the draft's ``blocks``). By hand: the target's page 128 x 1 x 512 x 2 B = 131,072 B.
    A draft of head_dim 128 has a page of 65,536 B, which divides it: 256-token blocks; three buckets (15, 3,
    1), group size 1, 19 groups; 1 GiB // 131,072 = 8,192 blocks; a request: 15 x (ceil((511 + 2,048) / 128)
    + 1 = 21) + 3 x 32 + ceil(4,096 / 256) = 427 blocks (the CPU server's 2,048 batched tokens, one batch in
    flight); 8,192 / 427 = 19.19x; int(19.185 x 4,096) = 78,581. Head_dim 96: 49,152 B, which does not
    divide 131,072, so the page is padded to it at 128 tokens: 15 x 21 + 3 x 32 + 32 = 443 blocks; 8,192 /
    443 = 18.49x; int(18.492 x 4,096) = 75,743."""
    target, draft = tmp_path / "gemma3", tmp_path / "draft"
    config_draft = {**DRAFT, "head_dim": head_dim}
    for folder, config in ((target, LAYOUTS["gemma3-270m"]), (draft, config_draft)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    log = tmp_path / "vllm.log"
    with vllm_server(target, log, kv_cache_gib=1, max_model_len=4096, load_format="dummy",
                     extra_args=["--skip-tokenizer-init", "--speculative-config", spec]):
        pass
    text = log.read_text(errors="replace")
    theirs, groups = LINE.search(text), GROUPS.search(text)
    assert theirs is not None and groups is not None, text[-3000:]
    v = vllm_sizing(parse_config(LAYOUTS["gemma3-270m"]), VLLMSettings(
        kv_memory_bytes=1 << 30, max_model_len=4096, block_size=128, device="cpu", draft=parse_config(config_draft)))
    assert v.lines[-1] == theirs.group(0) == line, (theirs.group(0), v.formula)
    assert [g.block_size for g in v.groups] == [int(b) for b in groups.group(1).split(",")] == [128] * 18 + [blocks]
