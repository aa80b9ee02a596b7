"""``python -m kvviz export --format hf``: the folder transformers (and so vLLM) loads gives
exactly kvviz's logits, for every family kvviz loads; the tokenizer files encode as kvviz does."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvviz.engine.loaded import load_model
from kvviz.engine.loading.save import export_hf
from kvviz.errors import KVVizError

from gguf_writers import GEMMA3_TOKENS, hf_tiny_gemma3, write_gemma3_gguf, write_llama_gguf

transformers = pytest.importorskip("transformers")

IDS = [3, 14, 15, 92, 65, 35, 8]
BASE: dict[str, Any] = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                            rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
                            pad_token_id=None)
FAMILIES = {  # family: (config class, model class, extra config, GGUF arch)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=32, tie_word_embeddings=False), "llama"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), "qwen2"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=128, tie_word_embeddings=True), "qwen3"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=32, sliding_window=4,
                                                              tie_word_embeddings=True), "llama"),
}


def _hf(family: str) -> Any:
    cfg_cls, model_cls, extra, _ = FAMILIES[family]
    torch.manual_seed(7)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**BASE, **extra})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.normal_(0.0, 0.5)  # zero biases and unit norms would test nothing
    return hf


def _logits(net: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return net(torch.tensor([ids]), torch.arange(len(ids)))[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_family_folder_reloads_in_transformers_with_kvvizs_logits(family: str, tmp_path: Path) -> None:
    hf = _hf(family)
    arch = FAMILIES[family][3]
    path = write_llama_gguf(tmp_path / f"{family}.gguf", hf, arch,
                            window=hf.config.sliding_window if family == "mistral" else None)
    model = load_model(str(path), device="cpu", dtype="fp32")
    out = tmp_path / "hf"
    files = export_hf(model, out)
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(files)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [FAMILIES[family][1]]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back).__name__ == FAMILIES[family][1]
    with torch.no_grad():
        theirs = back(torch.tensor([IDS])).logits[0]
        original = hf(torch.tensor([IDS])).logits[0]
    # Same weights bit for bit and the same fp32 graph: equal to rounding in the attention kernels.
    torch.testing.assert_close(theirs, _logits(model.model, IDS), rtol=0, atol=1e-5)
    torch.testing.assert_close(theirs, original, rtol=0, atol=1e-5)
    # A window past the prompt (Mistral's 4 < 7 tokens) is in the config, or the logits would differ.
    if family == "mistral":
        assert cfg["sliding_window"] == 4


def test_gemma3_folder_reloads_in_transformers_with_kvvizs_logits(tmp_path: Path) -> None:
    hf = hf_tiny_gemma3(3)
    path = write_gemma3_gguf(tmp_path / "gemma3.gguf", hf, types={})
    model = load_model(str(path), device="cpu", dtype="fp32")
    export_hf(model, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ("".join(GEMMA3_TOKENS[5:12]), " ".join(GEMMA3_TOKENS[20:26])):
        assert tok.encode(text) == model.tokenizer.encode(text), text  # BOS first as the file says
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = [i % len(GEMMA3_TOKENS) for i in range(3, 3 + 12)]  # 12 > the window of 8: sliding layers slide
    with torch.no_grad():
        theirs = back(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(theirs, _logits(model.model, ids), rtol=0, atol=1e-4)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["layer_types"][5] == "full_attention"


def test_byte_model_exports_as_gpt2_with_a_byte_tokenizer(tmp_path: Path) -> None:
    model = load_model("shakespeare", device="cpu", dtype="fp32")
    export_hf(model, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "ROMEO:\nWhat, ho! Ünïcödé — 日本\t"
    assert tok.encode(text, add_special_tokens=False) == model.tokenizer.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    ids = model.tokenizer.encode("ROMEO:\nWhat")
    with torch.no_grad():
        theirs = back(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(theirs, _logits(model.model, ids), rtol=0, atol=1e-5)


SPM_TEXTS = ["the ab: Their theatre is 12 int en tête-à-tête, isn't it?", "def f(x):\n    return x*2  # twice",
             "été 日本語 €5 😀 e\u0301 \u00a0nbsp", "a   b\t\tc\n\n\n d  \r\n  ", "", "  lead and trail  ",
             "x[INST]y </s><s>the<unk> [INST] hi [/INST]", "returnreturn ▁▁the ▁x"]


def test_a_sentencepiece_vocabulary_exports_with_the_same_ids(tmp_path: Path) -> None:
    """The Llama SentencePiece vocabulary (score ranks, the prefix, byte fallback, [INST] whole): the
    derived merges give kvviz's ids on every text, and decode back to it."""
    from tokenizers import Tokenizer

    from kvviz.engine.loading.gguf_lite import read_gguf
    from kvviz.engine.tokenize.spm import load_spm_tokenizer

    from gguf_writers import write_spm_tokenizer_gguf

    path = write_spm_tokenizer_gguf(tmp_path / "spm.gguf", chat_template="{{ bos_token }}{{ messages[0]['content'] }}")
    ours = load_spm_tokenizer(read_gguf(path).metadata, path.name, gemma=False)
    theirs = Tokenizer.from_str(ours.backend().to_str())  # through the JSON, as a reader of the folder gets it
    for text in SPM_TEXTS:
        ids = ours.encode(text, add_bos=False)
        assert theirs.encode(text, add_special_tokens=False).ids == ids, text
        if ids:  # the decoder strips the one prefix space the encoder added
            assert theirs.decode(ids, skip_special_tokens=False) == ours.decode(ids)[1:]


def test_gemma3s_sentencepiece_exports_with_the_same_ids(gemma3: Any) -> None:
    """Gemma 3's 262,144 pieces ranked by position: the stored transformers cases (tests/data) and the
    SPM texts encode to kvviz's ids through the exported pipeline."""
    from tokenizers import Tokenizer

    theirs = Tokenizer.from_str(gemma3.tokenizer.backend().to_str())
    cases = json.loads((Path(__file__).resolve().parents[1] / "data" / "gemma3_hf_reference.json").read_text())
    for text in [c["text"] for c in cases["tokenizer"]] + SPM_TEXTS:
        assert theirs.encode(text, add_special_tokens=False).ids == gemma3.tokenizer.encode(text, add_bos=False), text


def test_smollm2_folder_tokenizes_templates_and_computes_as_kvviz(smollm2: Any, tmp_path: Path) -> None:
    from kvviz.engine.tokenize.chat_template import chat_prompt

    export_hf(smollm2, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ["What is the capital of France?", "  two  spaces, 12345 digits\n\nnew\tlines", "ünïcödé 日本語 🙂",
                 "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text, add_special_tokens=True) == smollm2.tokenizer.encode(text), text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    theirs = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert theirs == list(chat_prompt(smollm2.tokenizer, msgs).ids)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = back(torch.tensor([theirs])).logits[0, -1]
    torch.testing.assert_close(logits, _logits(smollm2.model, theirs)[-1], rtol=0, atol=1e-4)
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"] == \
        smollm2.tokenizer.chat_template
