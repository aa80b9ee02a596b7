"""Gemma 3 270M (the Q4_K_M GGUF from its chunk packages) against transformers loading the same
file in fp32 with its GGUF tokenizer.

transformers' side is computed by ``tests/data/gemma3_reference.py`` (transformers 5.x, fp32) and
kept in ``tests/data/gemma3_hf_reference.json``: loading transformers' copy of the model, its
tokenizer and running its greedy searches costs minutes on a 2-core box, every run; the kvviz
side below is computed live, from the session's one model (the `gemma3` fixture, tests/conftest.py).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import kvviz
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.loading.gemma3_package import SHA256
from kvviz.engine.models.gemma3 import Gemma3
from kvviz import CacheSpec, SamplingParams

pytestmark = pytest.mark.gemma3
REFERENCE = Path(__file__).resolve().parents[1] / "data" / "gemma3_hf_reference.json"
LILY = " girl named Lily"  # transformers' greedy continuation, as the issue quotes it


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    data = json.loads(REFERENCE.read_text(encoding="utf-8"))
    assert data["gguf_sha256"] == SHA256  # made from the file kvviz loads
    return data


def test_config_and_weights_equal_transformers(gemma3: LoadedModel, ref: dict[str, Any]) -> None:
    c = gemma3.config
    assert isinstance(gemma3.model, Gemma3)
    assert (c.n_layer, c.n_embd, c.n_head, c.kv_heads, c.head_dim, c.intermediate_size) == (18, 640, 4, 1, 256, 2048)
    assert (c.sliding_window, c.vocab_size, c.context_length, c.eos_token_id) == (512, 262144, 32768, 1)
    assert [i for i, k in enumerate(c.layer_types) if k == "full"] == [5, 11, 17]
    assert gemma3.info["tensor_types"] == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    mine = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in gemma3.model.state_dict().items()}
    # The same dequantization and the same 1 subtracted from every norm: equal to the bit.
    assert mine == ref["params"]


def test_tokenizer_equals_transformers(gemma3: LoadedModel, ref: dict[str, Any]) -> None:
    tok = gemma3.tokenizer
    for case in ref["tokenizer"]:
        text = case["text"]
        assert tok.encode(text) == case["ids"], text[:40]
        assert tok.encode(text, parse_special=False) == case["ids_literal"], text[:40]
        assert tok.decode(case["ids"]) == case["decoded"], text[:40]


def test_greedy_equals_transformers_cached_and_uncached(gemma3: LoadedModel, ref: dict[str, Any]) -> None:
    n = ref["n_new"]
    for i, case in enumerate(ref["greedy"][:2]):
        prompt = case["prompt_ids"]
        assert gemma3.tokenizer.encode(case["prompt"]) == prompt
        cached = kvviz.generate(gemma3, prompt=prompt, max_new_tokens=n, sampling=SamplingParams(ignore_eos=True))
        assert cached.generated_ids == case["generated"], case["prompt"]
        if i == 0:  # the uncached loop itself, 40 full forwards
            uncached = kvviz.generate(gemma3, prompt=prompt, max_new_tokens=n,
                                      sampling=SamplingParams(ignore_eos=True), cache=CacheSpec(use_cache=False))
            assert uncached.generated_ids == case["generated"], case["prompt"]
        else:  # the same logits in one forward over prompt + continuation (cheaper)
            with torch.inference_mode():
                logits = gemma3.model(torch.tensor([prompt + case["generated"]]))[0, len(prompt) - 1:-1]
            assert logits.argmax(-1).tolist() == case["generated"], case["prompt"]
    assert gemma3.tokenizer.decode(ref["greedy"][0]["generated"]).startswith(LILY)


def test_past_the_window_equals_transformers(gemma3: LoadedModel, ref: dict[str, Any]) -> None:
    case = ref["greedy"][2]
    prompt, want = case["prompt_ids"], case["generated"]
    assert len(prompt) > 512  # the sliding layers' window is in force from the prompt on
    run = kvviz.generate(gemma3, prompt=prompt, max_new_tokens=ref["n_new"], sampling=SamplingParams(ignore_eos=True))
    assert run.generated_ids == want
    # The paged cache (block 16): its sliding groups let go of the blocks out of the window, and the
    # tokens stay transformers'; per layer, blocks held x a layer's share of a block, by hand.
    paged = kvviz.generate(gemma3, prompt=prompt, max_new_tokens=ref["n_new"],
                           sampling=SamplingParams(ignore_eos=True), cache=CacheSpec(kind="paged"))
    assert paged.generated_ids == want
    p, share = paged.events[-1].position, 16 * 2 * 256 * gemma3.dtype.itemsize  # 16 slots, K and V, 1 head
    full, sliding = -(-p // 16), -(-p // 16) - (p - 512 + 1) // 16
    assert list(paged.events[-1].cache_layer_bytes) == [full * share if i in (5, 11, 17) else sliding * share
                                                        for i in range(18)]
    assert sliding <= 33 < full  # at most ceil(511 / 16) + 1 blocks: the window's
    # At every step, each layer's live bytes equal the calculator's preset figure for that layer:
    # 15 sliding layers level off at 512 positions, the 3 global ones hold every position.
    from kvviz.calculator.formulas import layer_token_bytes, tokens_held
    from kvviz.calculator.presets import load_presets
    from kvviz.calculator.spec import MemoryRequest

    spec = load_presets()["gemma-3-270m"]
    fmt = MemoryRequest(seq_len=1, kv_dtype=gemma3.dtype_name).kv_format
    for ev in run.events:
        assert list(ev.cache_layer_bytes) == [layer_token_bytes(spec, fmt) * tokens_held(spec.layer(i), ev.position)
                                              for i in range(18)], ev.step
    # Uncached: one forward over prompt + continuation (what each uncached step would take the last
    # row of). The LM head runs on the positions checked only: 680 x 262,144 logits are 0.7 GB.
    ids = ref["logits"]["ids"]
    net = gemma3.model
    hidden: list[torch.Tensor] = []
    hook = net.model.layers[-1].register_forward_hook(lambda mod, args, out: hidden.append(out))
    try:
        with torch.inference_mode():
            net(torch.tensor([ids]), last_only=True)
            h = net.model.norm(hidden[0][0])  # (S, C): the final norm of every position
            n = len(prompt)
            assert net.lm_head(h[n - 1:-1]).argmax(-1).tolist() == want
            for pos, top in ref["logits"]["positions"].items():
                logits = net.lm_head(h[int(pos)])  # (V,)
                torch.testing.assert_close(logits[top["ids"]], torch.tensor(top["values"]), atol=2e-3, rtol=1e-4,
                                           msg=f"position {pos}")
                assert logits.topk(5).indices.tolist() == top["ids"][:5], pos
    finally:
        hook.remove()



def test_a_step_streams_the_files_own_bytes_as_llama_cpp_reads_them(gemma3: LoadedModel) -> None:
    # Issue 42: every quantized matrix is read as the file stores it, the Q4_K and Q6_K super-blocks
    # included (their scales inside them), so a decode step streams exactly the file's bytes for
    # them, as llama.cpp does: the reference is the GGUF's own tensor data, read apart from the
    # loader. 234.95 MiB; 244.0 while the K types' scales were fp32 per sub-block.
    from kvviz.engine.loading.gemma3_package import gemma3_path
    from kvviz.engine.loading.gguf_lite import read_gguf

    quantized = [t for t in read_gguf(gemma3_path()).tensors if t.tensor_type.name != "F32"]
    assert len(quantized) == 18 * 7 + 1 and all(len(t.shape) == 2 for t in quantized)  # 7 a layer + the embedding
    plan = gemma3.fast.plan()  # type: ignore[union-attr]
    assert plan.fp32_bytes == 0  # every matmul on codes; the tied head reads the embedding's once
    assert plan.coded_bytes == sum(t.data.nbytes for t in quantized) == gemma3.info["codes_bytes"]
    assert round(plan.coded_bytes / 2**20, 2) == 234.95
