"""Surrogates in a str, one rule per kind of caller (engine/tokenize/surrogates.py), through every
public entry: each tokenizer family's encode repairs (a lone one is one U+FFFD, a pair its
character), the API refuses and says where, the app's text guard runs the same pattern in the browser.

The expected texts are written out by hand from Unicode's definitions, not computed by the code."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvviz
from kvviz.engine.loading.gguf_lite import read_gguf
from kvviz.engine.tokenize.gguf_bpe import load_gguf_tokenizer
from kvviz.engine.tokenize.spm import load_spm_tokenizer
from kvviz.engine.tokenize.surrogates import LONE_SURROGATE, encodable, first_surrogate, replace_lone, utf8_bytes
from kvviz.engine.tokenize.tokenizer import ByteTokenizer, HFTokenizer

from gguf_writers import write_bpe_tokenizer_gguf, write_spm_tokenizer_gguf

# (typed, what a tokenizer encodes): the cases a broken paste, a clipboard or argv produce.
REPAIRS = {
    "lone high": ("a\ud800b", "a\ufffdb"),
    "lone low": ("a\udc00b", "a\ufffdb"),
    "pair": ("x\ud83e\udd99y", "x\U0001F999y"),  # the llama emoji as UTF-16 halves
    "pair reversed": ("\udd99\ud83e", "\ufffd\ufffd"),  # low then high: two lone ones
    "high at the end": ("end\ud83d", "end\ufffd"),
    "two highs then a low": ("\ud83d\ud83d\ude42", "\ufffd\U0001F642"),  # the second high pairs
    "after a real emoji": ("\U0001F642\udc00", "\U0001F642\ufffd"),  # a code point, not a half
    "U+FFFD itself": ("a\ufffdb", "a\ufffdb"),
    "NUL": ("a\x00\ud800\x00", "a\x00\ufffd\x00"),
    "argv byte 0xFF": ("\udcff", "\ufffd"),  # surrogateescape of a byte that is not UTF-8
    "family emoji": ("\U0001F468\u200D\U0001F469", "\U0001F468\u200D\U0001F469"),
}


@pytest.mark.parametrize("name", list(REPAIRS))
def test_encodable_is_what_each_case_means(name: str) -> None:
    typed, meant = REPAIRS[name]
    assert encodable(typed) == meant
    assert utf8_bytes(typed) == meant.encode("utf-8")


def test_valid_text_is_returned_as_is() -> None:
    text = "plain \U0001F642 \ufffd \x00"
    assert encodable(text) is text and utf8_bytes(text) == text.encode("utf-8")


_HALVES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83e", "\udd99", "\ufffd", "\x00", "a",
                           "\U0001F642"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_HALVES | st.characters(), max_size=12).map("".join))
def test_the_rule_equals_a_utf16_round_trip(text: str) -> None:
    """The tokenizers' old rule (gguf_bpe, spm): UTF-16 with surrogatepass, decoded with "replace". The
    new one is written as the browser's regex then a join; the two agree on any mix of halves."""
    assert encodable(text) == text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    assert len(replace_lone(text)) == len(text)  # the guard keeps the caret where it was


@pytest.mark.parametrize("name", list(REPAIRS))
def test_byte_tokenizer_encodes_the_repaired_text(name: str) -> None:
    typed, meant = REPAIRS[name]
    tok = ByteTokenizer()
    assert tok.encode(typed) == list(meant.encode("utf-8"))
    assert tok.decode(tok.encode(typed)) == meant


@pytest.mark.parametrize("name", list(REPAIRS))
def test_tokenizer_json_encodes_the_repaired_text(bpe_tokenizer_json: Path, name: str) -> None:
    typed, meant = REPAIRS[name]
    tok = HFTokenizer(bpe_tokenizer_json)
    assert tok.encode(typed) == tok.encode(meant)
    assert tok.decode(tok.encode(typed)) == meant


@pytest.fixture(scope="module")
def gguf_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("surrogates")
    bpe = write_bpe_tokenizer_gguf(folder / "bpe.gguf")
    spm = write_spm_tokenizer_gguf(folder / "spm.gguf")
    return {"gguf bpe": load_gguf_tokenizer(bpe),
            "spm (llama)": load_spm_tokenizer(read_gguf(spm).metadata, spm.name, gemma=False),
            "spm (gemma)": load_spm_tokenizer(read_gguf(spm).metadata, spm.name)}


@pytest.mark.parametrize("family", ["gguf bpe", "spm (llama)", "spm (gemma)"])
@pytest.mark.parametrize("name", list(REPAIRS))
def test_gguf_tokenizers_encode_the_repaired_text(gguf_tokenizers: dict[str, Any], family: str, name: str) -> None:
    typed, meant = REPAIRS[name]
    tok = gguf_tokenizers[family]
    assert tok.encode(typed) == tok.encode(meant)
    assert tok.encode(typed, parse_special=False) == tok.encode(meant, parse_special=False)
    if family == "gguf bpe":  # byte-level: decode gives the text back exactly
        assert tok.decode(tok.encode(typed)) == meant


def test_first_surrogate_finds_paired_and_lone_ones() -> None:
    assert first_surrogate("plain \U0001F642 \ufffd") is None
    assert first_surrogate("ab\ud83e\udd99") == 2  # a pair in a str is two surrogate code points
    assert first_surrogate("abc\udfff") == 3


@pytest.mark.parametrize("prompt, where", [("x\ud83e\udd99", "(U+D83E) at character 2"),
                                           ("\U0001F642\udc00", "(U+DC00) at character 2"),
                                           ("\ufffd\ud800", "(U+D800) at character 2")])
def test_the_api_refuses_any_surrogate_and_says_where(random_models: dict[str, Any], prompt: str, where: str) -> None:
    """The API asks for valid text rather than guessing (issue 37), a pair's halves included: a str
    holding them is not Unicode, however a tokenizer would repair it. U+FFFD itself is valid."""
    with pytest.raises(kvviz.KVVizError, match=r"prompt holds a lone surrogate " + where.replace("(", r"\(")
                       .replace(")", r"\)").replace("+", r"\+")):
        kvviz.generate(random_models["tiny"], prompt=prompt, max_new_tokens=1)
    run = kvviz.generate(random_models["tiny"], prompt="a\ufffd\x00b", max_new_tokens=1)
    assert list(run.prompt_ids) == list("a\ufffd\x00b".encode("utf-8"))


def test_the_text_guard_runs_the_same_pattern() -> None:
    """The browser's script holds the very pattern encodable uses (a JavaScript string is UTF-16
    units, a Python str code points: the pattern reads alike in both)."""
    from kvviz.ui.common import text_guard

    assert f"/{LONE_SURROGATE}/g" in text_guard.JS
    typed, meant = REPAIRS["pair"]
    assert text_guard.replacement_note(replace_lone(typed)) == ""  # a pair is a character: nothing to say
    note = text_guard.replacement_note(replace_lone(REPAIRS["NUL"][0]))
    assert "at character 3" in note
