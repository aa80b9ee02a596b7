"""Tokenizers: the byte-level one takes any Unicode; tokenizer.json goes through `tokenizers`."""
from __future__ import annotations

from pathlib import Path

import pytest

import kvviz
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.tokenize.tokenizer import ByteTokenizer, HFTokenizer, display_bytes

ODD = {
    "ascii": "Hello, world!",
    "emoji": "I \U0001F642 caches \U0001F468\u200D\U0001F469\u200D\U0001F467",  # incl. a ZWJ family
    "rtl": "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",  # Hebrew, Arabic
    "combining": "e\u0301 a\u0308\u0304 Z\u0351\u0352",
    "nul": "a\x00b\x00",
    "cjk": "\u6f22\u5b57\u304b\u306a",
    "controls": "\t\r\n\x1b[31m\x7f",
    "bom": "\ufeffstart",
}


@pytest.mark.parametrize("name", list(ODD))
def test_byte_tokenizer_round_trips_any_unicode(name: str) -> None:
    tok = ByteTokenizer()
    text = ODD[name]
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_lone_surrogate_encodes_without_crashing() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("a\ud800b")
    # U+FFFD's bytes, as every tokenizer repairs a lone surrogate (tests/engine/test_surrogates.py);
    # it was the surrogate's own 3 bytes (ED A0 80), which no UTF-8 text holds, shown as 3 U+FFFD.
    assert ids == [0x61, 0xEF, 0xBF, 0xBD, 0x62]
    assert tok.decode(ids) == "a\ufffdb"


def test_partial_utf8_bytes_display_as_hex_while_decode_is_exact() -> None:
    tok = ByteTokenizer()
    arrow = "\u2192"  # E2 86 92
    ids = tok.encode(arrow)
    assert ids == [0xE2, 0x86, 0x92]
    assert [tok.token_display(i) for i in ids] == ["<0xE2>", "<0x86>", "<0x92>"]
    assert tok.decode(ids) == arrow
    assert tok.token_display(ord("a")) == "a" and tok.token_display(0) == "\x00"
    assert tok.token_display(300) == "<|300|>" and tok.token_bytes(300) == b""
    assert tok.decode([104, 300, 105]) == "hi"  # ids past 255 (big random vocabularies) are dropped
    assert display_bytes(b"\xf0\x9f") == "<0xF0><0x9F>"


@pytest.mark.parametrize("name", list(ODD))
def test_generate_accepts_odd_prompts(random_models: dict[str, LoadedModel], name: str) -> None:
    prompt = ODD[name]
    run = kvviz.generate(random_models["tiny"], prompt=prompt, max_new_tokens=3)
    assert list(run.prompt_ids) == list(prompt.encode("utf-8", "surrogatepass"))
    assert len(run.generated_ids) == 3 and isinstance(run.text, str)
    assert all(e.token_text == random_models["tiny"].tokenizer.token_display(e.token_id) for e in run.events)


def test_generate_refuses_a_lone_surrogate_by_name(random_models: dict[str, LoadedModel]) -> None:
    """A lone surrogate is not Unicode text: the API says where it is (issue 37) rather than
    tokenizing a guess; the app's text boxes turn one into U+FFFD and say so before it gets here."""
    with pytest.raises(kvviz.KVVizError, match=r"lone surrogate \(U\+D800\) at character 2"):
        kvviz.generate(random_models["tiny"], prompt="x\ud800y", max_new_tokens=3)


# ----------------------------------------------------------------------------- tokenizer.json
@pytest.mark.parametrize("name", list(ODD))
def test_hf_tokenizer_round_trips(bpe_tokenizer_json: Path, name: str) -> None:
    tok = HFTokenizer(bpe_tokenizer_json)
    text = ODD[name]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # token_bytes undoes GPT-2's byte-to-unicode map: the pieces concatenate to the UTF-8 bytes.
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_hf_tokenizer_merges_and_displays(bpe_tokenizer_json: Path) -> None:
    tok = HFTokenizer(bpe_tokenizer_json)
    assert tok.vocab_size == 300
    ids = tok.encode("To be, or not to be")
    assert len(ids) < len("To be, or not to be")  # BPE merged something
    assert "".join(tok.token_display(i) for i in ids) == "To be, or not to be"
    emoji = tok.encode("\U0001F642")  # never seen in training: four single-byte tokens
    assert [tok.token_display(i) for i in emoji] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert tok.decode(emoji) == "\U0001F642"
    assert tok.token_display(0) == "<|endoftext|>"


def test_hf_tokenizer_lone_surrogate_is_not_a_crash(bpe_tokenizer_json: Path) -> None:
    tok = HFTokenizer(bpe_tokenizer_json)
    ids = tok.encode("a\ud800b")
    assert tok.decode(ids).startswith("a") and tok.decode(ids).endswith("b")


def test_hf_tokenizer_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(kvviz.KVVizError, match="not a valid tokenizer.json"):
        HFTokenizer(bad)
