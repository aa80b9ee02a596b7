"""Tokenizers: a byte-level one (the shipped model) and tokenizer.json through `tokenizers`.

Both expose ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``token_bytes(id)`` and
``token_display(id)``, and ``control_tokens`` ({text: id} of the special tokens ``encode`` matches
whole in text; ``literal_backend`` makes the encoder that does not, for typed chat text). Display
text is for token chips: a token whose bytes are not valid UTF-8 on their own (half of an emoji,
say) shows as ``<0xE2>`` while ``decode`` of the whole sequence stays exact.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from kvviz.engine.tokenize.surrogates import encodable, utf8_bytes
from kvviz.errors import KVVizError


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None
    name: str

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def token_display(self, token_id: int) -> str: ...


def display_bytes(b: bytes) -> str:
    """Text for a token's bytes: the characters if valid UTF-8, else ``<0xNN>`` per byte."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(f"<0x{x:02X}>" for x in b)


# Every byte's chip text, computed once: token_display runs for six tokens on every step.
_BYTE_DISPLAY = tuple(display_bytes(bytes([i])) for i in range(256))


def literal_backend(backend: Any) -> Any:
    """A copy of a `tokenizers` pipeline that reads special-token text as plain text: typed
    "<|im_end|>" becomes the pieces "<|", "im", "_end", "|>", never the control token (the
    library's ``encode_special_tokens``, which transformers sets for ``split_special_tokens=True``).
    A copy, not the flag flipped on the shared one: Streamlit encodes from several threads."""
    copy = type(backend).from_str(backend.to_str())
    copy.encode_special_tokens = True
    return copy


def special_added_tokens(backend: Any) -> dict[str, int]:
    """{text: id} of a `tokenizers` pipeline's special added tokens (what encode matches whole)."""
    return {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}


class ByteTokenizer:
    """Token i is byte i (0..255). Any Unicode string encodes (as UTF-8); no unknown tokens."""

    name = "bytes"
    control_tokens: dict[str, int] = {}  # no text is ever a control token here

    def __init__(self, vocab_size: int = 256, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        # No token is special here, so parse_special changes nothing. Surrogates (pasted broken
        # text) are repaired as every tokenizer repairs them (surrogates.py), never a crash.
        return list(utf8_bytes(text))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def decode(self, ids: list[int]) -> str:
        # Ids beyond 255 exist only in random models with a bigger vocabulary; drop them.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_display(self, token_id: int) -> str:
        if not 0 <= token_id < 256:
            return f"<|{token_id}|>"
        return _BYTE_DISPLAY[token_id]


class PieceVocab:
    """What the GGUF tokenizers share (byte-level BPE in gguf_bpe.py, SentencePiece in spm.py): a
    vocabulary of pieces, each standing for bytes (``token_bytes``, the subclass's), and a set of
    control-token ids. decode, chip text and "is it special" all follow from those two.

    decode joins the tokens' bytes, then reads them as UTF-8 (a broken sequence as U+FFFD): for
    SmolLM2's vocabulary this equals the `tokenizers` byte-level decoder on every one of its
    49,152 ids and on random id sequences (checked when the two were merged)."""

    vocab_size: int
    _special: frozenset[int]  # control-token ids (<|im_end|>, <bos>, ...)
    _display: dict[int, str]  # token_display runs for several tokens every step: cached

    def token_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        # An id past the vocabulary (typed as --prompt-ids) has no bytes: dropped.
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_display(self, token_id: int) -> str:
        """Chip text: the token's characters, or ``<0xNN>`` per byte for part of a character."""
        text = self._display.get(token_id)
        if text is None:
            if not 0 <= token_id < self.vocab_size:
                return f"<|{token_id}|>"
            text = self._display[token_id] = display_bytes(self.token_bytes(token_id))
        return text

    def is_special(self, token_id: int) -> bool:
        """Whether the id is a control token (``<|im_end|>``, ``<bos>``...): chips style it apart."""
        return token_id in self._special


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode map (printable stand-ins for the 256 bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class HFTokenizer:
    """A tokenizer.json loaded with the `tokenizers` library (GPT-2 BPE and friends)."""

    def __init__(self, path: Path, eos_token_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises plain Exception subclasses for bad JSON
            raise KVVizError(f"{path.name} is not a valid tokenizer.json: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = eos_token_id
        self.name = path.name
        self._display: dict[int, str] = {}  # token_display runs for six tokens on every step
        self.control_tokens = special_added_tokens(self._tok)
        self._literal: Any = None

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Ids for ``text``; with ``parse_special=False`` special-token text is read as plain text."""
        text = encodable(text)  # surrogates cannot cross into Rust (TypeError): repaired first
        backend = self._tok
        if not parse_special:
            backend = self._literal = self._literal or literal_backend(self._tok)
        return backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        dec = _gpt2_byte_decoder()
        if all(ch in dec for ch in piece):
            return bytes(dec[ch] for ch in piece)
        return piece.encode("utf-8")

    def token_display(self, token_id: int) -> str:
        text = self._display.get(token_id)
        if text is None:
            text = self.decode([token_id])
            if "\ufffd" in text:  # a partial UTF-8 sequence: show its bytes instead
                text = display_bytes(self.token_bytes(token_id))
            self._display[token_id] = text
        return text
