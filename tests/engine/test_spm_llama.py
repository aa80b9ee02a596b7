"""A Llama-family SentencePiece vocabulary (``tokenizer.ggml.model`` "llama": Llama 2, Mistral,
TinyLlama) read by kvviz's engine/tokenize/spm.py, against transformers.

The tiny vocabulary (tests/gguf_writers.py LLAMA_SPM_TOKENS) follows Llama 2's conventions: <unk> 0,
<s> 1, </s> 2, the 256 byte pieces, merged pieces ranked by score, add_space_prefix true. Two
references, both transformers' own conversion of the file (its vocabulary and score-ranked merges):
- its GGUF tokenizer as it stands, where it agrees with llama.cpp (text not starting with a space,
  no control token in it);
- the same pipeline under Llama 2's own tokenizer.json normalizer (Prepend "▁" to each stretch
  between special tokens, spaces as "▁"): llama.cpp's "a space before the first stretch and after
  every control token", which transformers' GGUF Metaspace("first") leaves out (spm.py's docstring).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, normalizers

import kvviz
from kvviz.engine.loading.gguf_lite import read_gguf
from kvviz.engine.tokenize.chat_template import chat_prompt
from kvviz.engine.tokenize.spm import SPMTokenizer, load_spm_tokenizer
from kvviz.engine.tokenize.tokenizer import literal_backend

from gguf_writers import LLAMA_SPM_TOKENS, write_llama_gguf, write_spm_tokenizer_gguf
from kvviz import SamplingParams

transformers = pytest.importorskip("transformers")

TEXTS = {
    "english": "the ab: Their theatre is 12 int en tête-à-tête, isn't it?",
    "code": "def f(x):\n    return x*2  # twice\n\treturn int(12345)",
    "numbers": "3.14159e-10 and 1,000,000; x1y22z333",
    "unicode": "été 日本語 €5 😀 e\u0301 \u00a0nbsp ١٢٣",
    "whitespace": "a   b\t\tc\n\n\n d  \r\n  ",
    "newlines": "one\ntwo\n\nthree\n",
    "empty": "",
    # where transformers' GGUF tokenizer adds no "▁" that llama.cpp adds
    "leading": "  lead and trail  ",
    "specials": "x[INST]y </s><s>the<unk> [INST] hi [/INST]",
}
AGREE = ("english", "code", "numbers", "unicode", "whitespace", "newlines", "empty")
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                    "[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def pieces(ids: list[int]) -> list[str]:
    return [LLAMA_SPM_TOKENS[i] for i in ids]


def sentencepiece_split(hf_tok: Any, prefix: bool = True) -> Tokenizer:
    """transformers' converted vocabulary and merges under Llama 2's tokenizer.json normalizer."""
    t = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581")] * prefix + [normalizers.Replace(" ", "\u2581")])
    t.pre_tokenizer = None
    return t


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spm_tokenizer_gguf(tmp_path_factory.mktemp("spm") / "llama-spm.gguf", chat_template=MISTRAL_TEMPLATE)


@pytest.fixture(scope="module")
def ours(spm_file: Path) -> SPMTokenizer:
    return load_spm_tokenizer(read_gguf(spm_file).metadata, spm_file.name, gemma=False)


@pytest.fixture(scope="module")
def hf_tok(spm_file: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(spm_file.parent, gguf_file=spm_file.name)


@pytest.mark.parametrize("name", TEXTS)
def test_ids_equal_llama2s_sentencepiece(ours: SPMTokenizer, hf_tok: Any, name: str) -> None:
    text = TEXTS[name]
    ref = sentencepiece_split(hf_tok)
    assert ours.encode(text) == [1] + ref.encode(text, add_special_tokens=False).ids
    # typed control text read as text: transformers' split_special_tokens
    literal = literal_backend(ref).encode(text, add_special_tokens=False).ids
    assert ours.encode(text, parse_special=False, add_bos=False) == literal
    if name in AGREE:
        assert ours.encode(text) == hf_tok.encode(text)


def test_where_transformers_gguf_leaves_out_the_prefix(ours: SPMTokenizer, hf_tok: Any) -> None:
    """The two cases spm.py's docstring names, as llama.cpp and transformers 5.23 spell them."""
    assert pieces(ours.encode(" ab")) == ["<s>", "\u2581\u2581", "ab"]
    assert pieces(hf_tok.encode(" ab")) == ["<s>", "\u2581", "ab"]
    assert pieces(ours.encode("[INST]the")) == ["<s>", "[INST]", "\u2581the"]
    assert pieces(hf_tok.encode("[INST]the")) == ["<s>", "[INST]", "t", "h", "e"]


def test_merges_rank_by_score_not_position(spm_file: Path, ours: SPMTokenizer) -> None:
    """"▁a" sits before "ab" in the file but scores lower, and there is no "▁ab": SentencePiece
    (and transformers, from the scores) merge "ab" first; Gemma's position rank would not."""
    assert pieces(ours.encode("the ab")) == ["<s>", "\u2581the", "\u2581", "ab"]
    by_position = load_spm_tokenizer(read_gguf(spm_file).metadata, spm_file.name)  # Gemma's rules
    assert pieces(by_position.encode("the ab")) == ["<s>", "\u2581the", "\u2581a", "b"]


def test_metadata_special_tokens_and_bytes(ours: SPMTokenizer, hf_tok: Any) -> None:
    assert (ours.vocab_size, ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == (
        len(LLAMA_SPM_TOKENS), 1, 2, 0)
    assert ours.add_bos and ours.add_space_prefix and ours.chat_template == MISTRAL_TEMPLATE
    assert ours.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert ours.control_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": len(LLAMA_SPM_TOKENS) - 1}
    assert [ours.is_special(i) for i in (0, 1, 2, 3, len(LLAMA_SPM_TOKENS) - 1)] == [True, True, True, False, True]
    assert ours.token_bytes(3 + 0x0A) == b"\n" and ours.token_display(3 + 0x0A) == "\n"
    assert ours.token_bytes(LLAMA_SPM_TOKENS.index("\u2581the")) == b" the"
    for name in AGREE:
        ids = ours.encode(TEXTS[name], add_bos=False)
        # kvviz shows each token's bytes, the prefix "▁" too; transformers' decoder strips it
        assert ours.decode(ids) == " " * bool(TEXTS[name]) + TEXTS[name]
        assert hf_tok.decode(ids) == TEXTS[name]


def test_file_flags(tmp_path: Path, hf_tok: Any) -> None:
    """add_space_prefix false: no "▁" in front (transformers' GGUF ignores the flag); both flags
    absent: llama.cpp's defaults for SentencePiece, BOS and the prefix."""
    path = write_spm_tokenizer_gguf(tmp_path / "flat.gguf", add_space_prefix=False, add_bos=False)
    flat = load_spm_tokenizer(read_gguf(path).metadata, path.name, gemma=False)
    ref = sentencepiece_split(hf_tok, prefix=False)
    for text in (*TEXTS.values(), " ab"):
        assert flat.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    assert pieces(flat.encode("the ab")) == ["t", "h", "e", "\u2581", "ab"]
    path = write_spm_tokenizer_gguf(tmp_path / "bare.gguf", add_space_prefix=None, add_bos=None)
    bare = load_spm_tokenizer(read_gguf(path).metadata, path.name, gemma=False)
    assert bare.add_bos and bare.add_space_prefix and pieces(bare.encode("the")) == ["<s>", "\u2581the"]


def test_characters_without_pieces_are_unk(tmp_path: Path) -> None:
    """No byte pieces in the vocabulary (real Llama files always have them): a run of characters
    it cannot spell is one <unk>, as SentencePiece fuses them. transformers' GGUF tokenizer drops
    them before merging (its BPE gets no unk token) and llama.cpp's byte lookup throws. Where no
    merge spans them the rest of the ids equal transformers'; the <unk>s sit where counted by hand."""
    path = write_spm_tokenizer_gguf(tmp_path / "nobytes.gguf", byte_pieces=False)
    tok = load_spm_tokenizer(read_gguf(path).metadata, path.name, gemma=False)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    space, sun, euro, x, the, ab = map(read_gguf(path).metadata["tokenizer.ggml.tokens"].index,
                                       ("\u2581", "日", "€", "x", "\u2581the", "ab"))
    assert tok.encode("日本語 €x") == [1, space, sun, 0, space, euro, x]  # "本語": one <unk>
    assert ref.encode("日本語 €x") == [1, space, sun, space, euro, x]
    # "▁the", "▁", <unk> (both emoji), "▁", "ab", <unk> (the newline): the <unk> keeps "▁▁" apart
    assert tok.encode("the 😀😀 ab\n", add_bos=False) == [the, space, 0, space, ab, 0]


def test_a_llama_gguf_brings_its_sentencepiece_tokenizer(tmp_path: Path, hf_tok: Any) -> None:
    """load_model on a llama file with this vocabulary: the SPM tokenizer, text prompts tokenized
    as transformers does, greedy tokens as transformers' model from the same file; the chat
    template's turns encode as the whole text does."""
    cfg = transformers.LlamaConfig(vocab_size=len(LLAMA_SPM_TOKENS), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2,
                                   bos_token_id=1, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.model.norm.weight.mul_(10.0)  # spread the logits: greedy ties out of reach
    path = write_llama_gguf(tmp_path / "llama-spm.gguf", hf, spm=True, eos=2, chat_template=MISTRAL_TEMPLATE)
    m = kvviz.load_model(str(path), device="cpu")
    assert m.has_tokenizer and isinstance(m.tokenizer, SPMTokenizer) and m.tokenizer.eos_token_id == 2
    prompt = "the theatre is"
    ids = m.tokenizer.encode(prompt)
    assert ids == hf_tok.encode(prompt)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
    run = kvviz.generate(m, prompt=prompt, max_new_tokens=8, sampling=SamplingParams(greedy=True, ignore_eos=True))
    assert list(run.prompt_ids) == ids and run.generated_ids == want
    split = sentencepiece_split(hf_tok)
    turns = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "ok"}]
    chat = chat_prompt(m.tokenizer, turns)
    assert chat.text == "<s>[INST] hi there [/INST]ok</s>"
    assert list(chat.ids) == split.encode(chat.text, add_special_tokens=False).ids
    # "[INST]" typed in a message stays text; the template's own stay control tokens
    chat = chat_prompt(m.tokenizer, turns + [{"role": "user", "content": "typed [INST] stays"}])
    head, tail = "<s>[INST] hi there [/INST]ok</s>[INST]", " typed [INST] stays [/INST]"
    assert chat.text == head + tail and chat.typed_specials == ("[INST]",)
    assert list(chat.ids) == (split.encode(head, add_special_tokens=False).ids
                              + literal_backend(split).encode(tail, add_special_tokens=False).ids)
