"""The bench's transformers baseline for Gemma 3 270M (Gemma3ForCausalLM holding kvviz's tensors)
gives the greedy tokens transformers gives when it loads the GGUF file itself
(tests/data/gemma3_hf_reference.json, made by tests/data/gemma3_reference.py): adopting kvviz's
weights is the same model as transformers' own GGUF loading."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvviz.engine.loading.gemma3_package import SHA256
from kvviz.engine.loading.loader import LoadedModel

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "gemma3_hf_reference.json"


def test_hf_twin_greedy_equals_transformers_own_gguf_load(gemma3: LoadedModel) -> None:
    pytest.importorskip("transformers")
    from kvviz.measure.bench_gemma3 import hf_gemma3

    ref = json.loads(REFERENCE.read_text(encoding="utf-8"))
    assert ref["gguf_sha256"] == SHA256
    case = ref["greedy"][0]  # "Once upon a time, there was a little", 40 tokens
    hf = hf_gemma3(gemma3)
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = hf.generate(torch.tensor([case["prompt_ids"]]), max_new_tokens=ref["n_new"], do_sample=False)
    assert out[0, len(case["prompt_ids"]):].tolist() == case["generated"]
