"""A byte-level BPE tokenizer rebuilt from a GGUF file's metadata (SmolLM2 and friends).

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the merges, each token's type
and the special ids as metadata keys (``tokenizer.ggml.*``). We read those keys, and only those:
the tensors stay untouched in the memory map. Then we assemble the same pipeline the model was
trained with, in the `tokenizers` library:

    pre-tokenizer   named by ``tokenizer.ggml.pre``: for ``smollm``, every digit is its own piece,
                    then GPT-2's regex splits words, punctuation and whitespace runs
    model           BPE over GPT-2's byte alphabet (``Ġ`` is a space, ``Ċ`` a newline)
    added tokens    the CONTROL tokens (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``...) are
                    special: matched whole in the text, never cut by BPE
    decoder         byte-level, so decode(encode(text)) == text

    tok = load_gguf_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.encode("Hi there")            # [26843, 665]
    tok.token_display(665)            # " there"
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from kvviz.engine.tokenize.surrogates import encodable
from kvviz.engine.tokenize.tokenizer import PieceVocab, _gpt2_byte_decoder, literal_backend, special_added_tokens
from kvviz.errors import KVVizError

# llama.cpp's token types (llama_token_type / gguf.TokenType).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# GPT-2's split, used alone by the plain BPE vocabularies.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's split (cl100k-like): digits in groups of up to three, newlines kept apart.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's (Qwen2.5 and Qwen3 GGUFs name it too): Llama 3's, but every digit its own piece.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# ``tokenizer.ggml.pre`` -> the splits llama.cpp applies before BPE (llama-vocab.cpp), in order.
# smollm shares starcoder's entry there: `\p{N}` first (one digit per piece), then GPT-2's regex.
# A name not listed is refused: a wrong split gives plausible but wrong ids, the worst failure.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2_SPLIT,) for name in ("default", "gpt2", "gpt-2", "mpt", "olmo")},
    **{name: (r"\p{N}", _GPT2_SPLIT) for name in ("smollm", "starcoder", "refact", "command-r",
                                                 "codeshell")},
    **{name: (_LLAMA3_SPLIT,) for name in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe",
                                           "falcon3")},
    "qwen2": (_QWEN2_SPLIT,),
}


@dataclass(frozen=True)
class GGUFTokenizerMeta:
    """The tokenizer keys of one GGUF file, as plain Python values."""

    name: str                      # shown in the UI and in errors: the file name
    model: str                     # tokenizer.ggml.model: "gpt2" is byte-level BPE
    pre: str                       # tokenizer.ggml.pre: which split runs before BPE
    tokens: tuple[str, ...]        # id -> piece, spelled in GPT-2's byte alphabet
    token_types: tuple[int, ...]   # id -> llama.cpp token type (1 normal, 3 control, ...)
    merges: tuple[str, ...]        # "Ġ t" = merge "Ġ" and "t", best first
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos: bool                  # llama.cpp prepends BOS to every encode when true
    add_prefix_space: bool         # tokenizer.ggml.add_space_prefix
    chat_template: str | None      # tokenizer.chat_template (jinja2), None when absent


def read_tokenizer_metadata(source: str | Path | Mapping[str, Any], name: str | None = None) -> GGUFTokenizerMeta:
    """The tokenizer keys of a GGUF file: a path (opened with its header checked, by
    ``gguf_lite.read_gguf``), or the metadata the model loader already decoded (decoding SmolLM2's
    49k-token vocabulary twice would cost twice). ``name``: the file's name, for messages."""
    if isinstance(source, (str, Path)):
        from kvviz.engine.loading.gguf_lite import read_gguf  # imported here: only GGUF users pay for it

        name = name or Path(source).name
        source = read_gguf(source).metadata
    name = name or "model.gguf"
    metadata = source

    def get(key: str, default: Any = None) -> Any:
        v = metadata.get(key, default)
        return v.tolist() if hasattr(v, "tolist") else v  # numeric arrays arrive as numpy arrays

    model = get("tokenizer.ggml.model")
    if model is None:
        raise KVVizError(f"{name} has no tokenizer in its metadata (tokenizer.ggml.model is missing)")
    tokens = get("tokenizer.ggml.tokens")
    if not tokens:
        raise KVVizError(f"{name} has no vocabulary (tokenizer.ggml.tokens is missing or empty)")
    types = get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise KVVizError(f"{name}: {len(types)} token types for {len(tokens)} tokens")

    def token_id(key: str) -> int | None:
        value = get(key)
        if value is None:
            return None
        if not 0 <= int(value) < len(tokens):
            raise KVVizError(f"{name}: {key} = {value} is outside the {len(tokens)}-token vocabulary")
        return int(value)

    return GGUFTokenizerMeta(
        name=name, model=str(model), pre=str(get("tokenizer.ggml.pre", "default")),
        tokens=tuple(tokens), token_types=tuple(int(t) for t in types),
        merges=tuple(get("tokenizer.ggml.merges") or ()),
        bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
        unk_token_id=token_id("tokenizer.ggml.unknown_token_id"),
        pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
        add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
        add_prefix_space=bool(get("tokenizer.ggml.add_space_prefix", False)),
        chat_template=get("tokenizer.chat_template"),
    )


def build_backend(meta: GGUFTokenizerMeta) -> _Backend:
    """The `tokenizers` pipeline these keys describe (see the module docstring)."""
    if meta.model != "gpt2":
        raise KVVizError(f"{meta.name}: tokenizer model {meta.model!r} is not byte-level BPE ('gpt2'), the "
                         "only kind this reader takes (a sentencepiece ('llama') one: engine/tokenize/spm.py)")
    splits = _PRE_SPLITS.get(meta.pre)
    if splits is None:
        raise KVVizError(f"{meta.name}: pre-tokenizer {meta.pre!r} is not supported yet "
                         f"(known: {', '.join(sorted(_PRE_SPLITS))})")
    alphabet = _gpt2_byte_decoder()
    # Real BPE pieces are spelled in the byte alphabet; respell any other token the same way
    # (as transformers does) so BPE can still reach it.
    vocab = {t if all(ch in alphabet for ch in t) else _respell(t): i for i, t in enumerate(meta.tokens)}
    pairs = [tuple(m.split(" ")) for m in meta.merges]
    if any(len(p) != 2 for p in pairs):
        raise KVVizError(f"{meta.name}: a merge is not two pieces separated by one space")
    backend = _Backend(BPE(
        vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
        fuse_unk=False, byte_fallback=False,
        # llama.cpp takes a word that is already in a Llama 3 vocabulary whole, merges or not.
        ignore_merges=splits[0] == _LLAMA3_SPLIT,
    ))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        # The regex already ran above: ByteLevel only maps bytes to the alphabet here.
        + [pre_tokenizers.ByteLevel(add_prefix_space=meta.add_prefix_space, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # CONTROL tokens are special: matched whole wherever they appear in the text, so the chat
    # template's "<|im_start|>" is one token, not eight. A control token spelled outside the byte
    # alphabet is a llama.cpp mislabel (transformers skips it too). USER_DEFINED ones (e.g.
    # "<think>") are matched whole as well, but are ordinary text.
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(meta.tokens, meta.token_types)
               if k == _CONTROL and all(ch in alphabet for ch in t)]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(meta.tokens, meta.token_types)
            if k == _USER_DEFINED and all(ch in alphabet for ch in t)]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend


def _respell(text: str) -> str:
    to_char = {b: ch for ch, b in _gpt2_byte_decoder().items()}
    return "".join(to_char[b] for b in text.encode("utf-8"))


class GGUFTokenizer(PieceVocab):
    """kvviz's Tokenizer protocol over a GGUF's byte-level BPE (see the module docstring); decode,
    token_display and is_special come from ``PieceVocab``."""

    def __init__(self, meta: GGUFTokenizerMeta) -> None:
        self._tok = build_backend(meta)
        self._pieces = meta.tokens
        self._special = frozenset(i for i, k in enumerate(meta.token_types) if k == _CONTROL)
        self.name = meta.name
        # The model's embedding has one row per GGUF token: that is the vocabulary size.
        self.vocab_size = len(meta.tokens)
        self.eos_token_id = meta.eos_token_id
        self.bos_token_id = meta.bos_token_id
        self.unk_token_id = meta.unk_token_id
        self.pad_token_id = meta.pad_token_id
        self.add_bos = meta.add_bos
        self.chat_template = meta.chat_template
        # The special tokens' text, under the names chat templates use ({{ bos_token }}...).
        self.special_tokens = {key: meta.tokens[i] for key, i in (
            ("bos_token", meta.bos_token_id), ("eos_token", meta.eos_token_id),
            ("unk_token", meta.unk_token_id), ("pad_token", meta.pad_token_id)) if i is not None}
        self._display: dict[int, str] = {}  # token_display runs for several tokens every step
        # {text: id} of the control tokens encode matches whole (chat_template.py keeps typed ones literal).
        self.control_tokens = special_added_tokens(self._tok)
        self._literal: Any = None  # built on first use (a copy of the pipeline: ~0.1 s, a few MB)

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Ids for ``text``; BOS first only if ``add_bos`` (default: what the file says).

        ``parse_special=False`` reads control-token text as plain text ("<|im_end|>" typed by a
        user is five ordinary tokens, as transformers' ``split_special_tokens=True``)."""
        text = encodable(text)  # surrogates cannot cross into Rust: pairs joined, a lone one U+FFFD
        backend = self._tok
        if not parse_special:
            backend = self._literal = self._literal or literal_backend(self._tok)
        ids = backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for: 'Ġthe' -> b' the'; a special token -> its text."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        piece = self._pieces[token_id]
        if token_id in self._special:
            return piece.encode("utf-8")
        dec = _gpt2_byte_decoder()
        if all(ch in dec for ch in piece):
            return bytes(dec[ch] for ch in piece)
        return piece.encode("utf-8")  # respelled in build_backend: the text is the bytes


def load_gguf_tokenizer(source: str | Path | Mapping[str, Any], name: str | None = None) -> GGUFTokenizer:
    """The tokenizer of a GGUF file (a path, or its metadata already decoded: see read_tokenizer_metadata)."""
    return GGUFTokenizer(read_tokenizer_metadata(source, name))
