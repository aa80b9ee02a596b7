"""Issue 29, one loader path: every GGUF file kvviz opens goes through ``gguf_checks.scan_header``
and ``gguf_lite.read_gguf``, once per load; the metadata is decoded once (the tokenizer is built
from what the model loader decoded); llama.cpp's ``gguf.GGUFReader`` is never constructed."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Callable

import pytest

import kvviz
from kvviz.engine.loading import gguf_checks, gguf_lite
from kvviz.engine.loading.gemma3_gguf import load_gemma3_gguf
from kvviz.engine.loading.gguf_llama import load_gguf, tokenizer_metadata
from kvviz.engine.tokenize import gguf_bpe
from kvviz.errors import KVVizError

from gguf_writers import LLAMA_SPM_TOKENS, write_gemma3_gguf, write_llama_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


def _tiny_llama(path: Path) -> Path:
    """A 2-layer Llama with a byte-level BPE tokenizer over its 96 pieces ("<t0>"...: GPT-2 alphabet)."""
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return write_llama_gguf(path, transformers.LlamaForCausalLM(cfg).eval(), eos=2, edit=lambda w, t: (
        w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default")))


def _tiny_llama_spm(path: Path) -> Path:
    """The same Llama with Llama 2's kind of SentencePiece vocabulary (tokenizer.ggml.model "llama")."""
    cfg = transformers.LlamaConfig(vocab_size=len(LLAMA_SPM_TOKENS), hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return write_llama_gguf(path, transformers.LlamaForCausalLM(cfg).eval(), eos=2, spm=True)


def _tiny_gemma3(path: Path) -> Path:
    from test_gemma3_gguf import hf_tiny  # the Gemma 3 model its tests hold to transformers

    return write_gemma3_gguf(path, hf_tiny())


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Spies: header walks (in every namespace that calls it), metadata decodes (a cursor over the
    key/value table), tokenizer-metadata reads from a path; GGUFReader fails the test."""
    seen: dict[str, list[str]] = {"scan": [], "decode": [], "tokenizer_from_path": []}
    real_scan, real_cursor = gguf_checks.scan_header, gguf_lite._Cursor.__init__

    def scan(path: Path) -> Any:
        seen["scan"].append(Path(path).name)
        return real_scan(path)

    def cursor(self: Any, buf: Any) -> None:
        seen["decode"].append("metadata")
        real_cursor(self, buf)

    def no_reader(*a: Any, **k: Any) -> None:
        raise AssertionError("gguf.GGUFReader was constructed: a second GGUF reader path")

    real_meta = gguf_bpe.read_tokenizer_metadata

    def tok_meta(source: Any, name: Any = None) -> Any:
        if isinstance(source, (str, Path)):
            seen["tokenizer_from_path"].append(str(source))
        return real_meta(source, name)

    monkeypatch.setattr(gguf_checks, "scan_header", scan)
    monkeypatch.setattr(gguf_lite, "scan_header", scan)
    monkeypatch.setattr(gguf_lite._Cursor, "__init__", cursor)
    monkeypatch.setattr(gguf.GGUFReader, "__init__", no_reader)
    monkeypatch.setattr(gguf_bpe, "read_tokenizer_metadata", tok_meta)
    return seen


@pytest.mark.parametrize("write", [_tiny_llama, _tiny_llama_spm, _tiny_gemma3], ids=["llama", "llama-spm", "gemma3"])
def test_one_load_checks_the_header_once_and_decodes_once(write: Callable[[Path], Path], tmp_path: Path,
                                                          counts: dict[str, list[str]]) -> None:
    path = write(tmp_path / "tiny.gguf")
    m = kvviz.load_model(str(path), device="cpu")
    assert m.has_tokenizer and m.tokenizer.vocab_size == m.config.vocab_size  # built from the file's metadata
    assert counts == {"scan": ["tiny.gguf"], "decode": ["metadata"], "tokenizer_from_path": []}


def _corrupt(tmp_path: Path) -> Path:
    """A real tiny GGUF whose header says version 9: only the header check names that."""
    data = bytearray(_tiny_llama(tmp_path / "good.gguf").read_bytes())
    struct.pack_into("<I", data, 4, 9)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    return bad


def test_every_entry_point_gets_the_header_checks(tmp_path: Path, counts: dict[str, list[str]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    bad = _corrupt(tmp_path)
    counts["scan"].clear()
    message = "bad.gguf is GGUF version 9; kvviz reads little-endian versions 2 and 3"
    entries: dict[str, Callable[[], Any]] = {
        "load_model": lambda: kvviz.load_model(str(bad), device="cpu"),
        "llama loader": lambda: load_gguf(bad),
        "gemma3 loader": lambda: load_gemma3_gguf(bad),
        "tokenizer": lambda: gguf_bpe.load_gguf_tokenizer(bad),
        "tokenizer metadata": lambda: tokenizer_metadata(bad),
        "reader": lambda: gguf_lite.read_gguf(bad),
        "model picker's family": lambda: gguf_checks.model_family(bad),
    }
    for what, entry in entries.items():
        with pytest.raises(KVVizError, match=message):
            entry()
    assert counts["scan"] == ["bad.gguf"] * len(entries)
    assert counts["decode"] == []  # nothing past the header was decoded

    # The app's picker label and the memory calculator's SmolLM2 config read files too.
    from kvviz.engine.loading import llama_loader
    from kvviz.ui.pages.calculator import calculator_measured
    from kvviz.ui.state import model_menu

    monkeypatch.setenv("KVVIZ_MODELS_DIR", str(tmp_path))
    assert model_menu.gguf_label("gguf:bad.gguf") == f"gguf:bad.gguf (unreadable: {message})"
    monkeypatch.setattr(llama_loader, "smollm2_path", lambda: bad)
    assert calculator_measured._smollm2_config.__wrapped__() is None  # unreadable: the page shows no SmolLM2 row
    assert counts["scan"] == ["bad.gguf"] * (len(entries) + 2)
