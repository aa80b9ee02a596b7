"""Tokenizers: a byte-level one (the shipped model) and tokenizer.json through `tokenizers`.

Both expose ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``token_bytes(id)`` and
``token_display(id)``. Display text is for token chips: a token whose bytes are not valid UTF-8
on their own (half of an emoji, say) shows as ``<0xE2>`` while ``decode`` of the whole sequence
stays exact.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Protocol

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


class ByteTokenizer:
    """Token i is byte i (0..255). Any Unicode string encodes (as UTF-8); no unknown tokens."""

    name = "bytes"

    def __init__(self, vocab_size: int = 256, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        # surrogatepass: lone surrogates (possible from pasted text) still encode, never crash.
        return list(text.encode("utf-8", errors="surrogatepass"))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def decode(self, ids: list[int]) -> str:
        # Ids beyond 255 exist only in random models with a bigger vocabulary; drop them.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_display(self, token_id: int) -> str:
        if not 0 <= token_id < 256:
            return f"<|{token_id}|>"
        return _BYTE_DISPLAY[token_id]


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

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates (pasted broken text) cannot cross into Rust: make them U+FFFD, as
            # the byte tokenizer's decode would show them, instead of raising TypeError.
            text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        return self._tok.encode(text, add_special_tokens=False).ids

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
