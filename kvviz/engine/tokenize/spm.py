"""A SentencePiece-style tokenizer read from a GGUF file (``tokenizer.ggml.model`` "llama"):
Gemma 3, and the Llama family's SentencePiece vocabularies (Llama 2, Mistral, TinyLlama).

The file stores pieces (``▁`` for a space), their scores and types; no merges. Encoding, as
llama.cpp does it:

1. whole-token matches first, leftmost-longest over the raw text: the CONTROL and UNKNOWN pieces
   (``<bos>``, ``<start_of_turn>``, ``<s>``, ``[INST]``, ``<unk>``...; skipped with
   ``parse_special=False``) and the USER_DEFINED ones that are pieces as spelled (runs of
   newlines or tabs, ``<table>``...);
2. each stretch of text between them: every space becomes ``▁``, and if the file's
   ``add_space_prefix`` says so (Llama's do, Gemma's do not) one more ``▁`` goes in front of a
   stretch that starts the text or follows a whole token (llama.cpp's "prefix with space if the
   previous is special", as Llama 2's own tokenizer.json does with its Prepend normalizer);
   each character is a symbol, a character with no piece becomes its UTF-8 bytes' ``<0xNN>``
   pieces (byte fallback), or ``<unk>`` if the vocabulary lacks one of them (a run of such
   characters is one ``<unk>``, as SentencePiece fuses them; llama.cpp throws there, and
   transformers drops them, but real vocabularies have all 256 byte pieces);
3. llama.cpp's SentencePiece loop: repeatedly merge the adjacent pair whose concatenation is a
   piece and ranks best, then the longer left part, leftmost first among equals. The rank is the
   merged piece's score (higher is better) for a Llama vocabulary, as llama.cpp and transformers
   rank it. For Gemma it is the piece's position in the vocabulary (earlier is better): Gemma's
   scores do not follow its merge order (transformers says so and sorts by position; the two
   disagree on one pair of 262,144), so the position decides there.

Gemma's GGUF stores its runs of two or more spaces as real spaces; they are respelled with ``▁``
so that merges reach them, as transformers does (Llama vocabularies spell every space ``▁``).

The tests hold this to transformers' GGUF tokenizer: Gemma's ids equal on every text tried. For a
Llama vocabulary transformers 5.23 uses a ``Metaspace`` pre-tokenizer ("first" scheme) that
adds the prefix only to the very first stretch and only if it does not already begin with a
space; llama.cpp (and Llama 2's own tokenizer.json, the model's training tokenization) add it
before " hi" (``▁▁hi``) and after a control token too. kvviz follows llama.cpp; the tests check
transformers' GGUF ids where the two agree and its vocabulary under Llama 2's normalizer on all.
"""
from __future__ import annotations

import heapq
import re
from collections.abc import Mapping
from typing import Any

from kvviz.engine.tokenize.surrogates import encodable
from kvviz.engine.tokenize.tokenizer import PieceVocab
from kvviz.errors import KVVizError

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6  # llama.cpp's token types
_UNK_SYMBOL = "\x00unk"  # a character the vocabulary cannot spell, bytes included: never a piece
SPACE = "\u2581"  # ▁, SentencePiece's visible space
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")


def _respell(piece: str) -> str:
    """A run of real spaces as ``▁``s (how Gemma's GGUF stores them, and how merges reach them)."""
    return SPACE * len(piece) if " " in piece and not piece.strip() else piece


class SPMTokenizer(PieceVocab):
    """kvviz's Tokenizer protocol over a GGUF's SentencePiece vocabulary (see the module docstring);
    decode, token_display and is_special come from ``PieceVocab``."""

    def __init__(self, name: str, tokens: list[str], types: list[int], *, bos_token_id: int | None,
                 eos_token_id: int | None, unk_token_id: int | None, pad_token_id: int | None,
                 add_bos: bool, add_space_prefix: bool, scores: list[float] | None = None,
                 respell_spaces: bool = True, chat_template: str | None = None) -> None:
        """``scores``: rank merges by them (a Llama vocabulary); None ranks by position (Gemma).
        ``respell_spaces``: pieces of real spaces become ``▁`` runs (Gemma's GGUF spelling)."""
        if len(types) != len(tokens):
            raise KVVizError(f"{name}: {len(types)} token types for {len(tokens)} tokens")
        if scores is not None and len(scores) != len(tokens):
            raise KVVizError(f"{name}: {len(scores)} token scores for {len(tokens)} tokens")
        self.name = name
        self.vocab_size = len(tokens)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.unk_token_id, self.pad_token_id = unk_token_id, pad_token_id
        self.add_bos, self.add_space_prefix = add_bos, add_space_prefix
        self.chat_template = chat_template  # None for a base model (Gemma 3 270M's file has none)
        self._pieces = [_respell(t) for t in tokens] if respell_spaces else list(tokens)
        self._ids = {p: i for i, p in enumerate(self._pieces)}  # a repeated piece: its last id, as transformers
        # A merge's rank, lower first: minus its piece's score, or its position.
        self._rank = [-float(x) for x in scores] if scores is not None else list(range(len(tokens)))
        self._types = types
        # llama.cpp matches UNKNOWN (<unk>) whole like CONTROL, and only with parse_special.
        self._special = frozenset(i for i, k in enumerate(types) if k in (_CONTROL, _UNKNOWN))
        self.control_tokens = {tokens[i]: i for i in sorted(self._special)}
        user = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == _USER_DEFINED and t in self._ids}
        self._whole = {**user, **self.control_tokens}  # text matched whole -> its id
        self._match_all = _matcher(self._whole)
        self._match_user = _matcher(user)
        self.special_tokens = {key: tokens[i] for key, i in (
            ("bos_token", bos_token_id), ("eos_token", eos_token_id),
            ("unk_token", unk_token_id), ("pad_token", pad_token_id)) if i is not None}
        self._display: dict[int, str] = {}

    # -- encoding -------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Ids for ``text``; BOS first if ``add_bos`` (default: what the file says).
        ``parse_special=False`` reads control-token text as plain text."""
        text = encodable(text)  # surrogates have no UTF-8 bytes: pairs joined, a lone one U+FFFD
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        matcher = self._match_all if parse_special else self._match_user
        at = 0
        for m in (matcher.finditer(text) if matcher is not None else ()):
            if m.start() > at:  # a stretch that starts the text or follows a whole token
                ids += self._encode_plain(text[at:m.start()])
            ids.append(self._whole[m.group()])
            at = m.end()
        if at < len(text):
            ids += self._encode_plain(text[at:])
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        """SentencePiece's bigram merges over one stretch of text with no whole-token matches."""
        text = text.replace(" ", SPACE)
        if self.add_space_prefix:
            text = SPACE + text
        # Symbols as a doubly linked list of pieces; a character with no piece becomes its bytes.
        sym: list[str] = []
        for ch in text:
            if ch in self._ids:
                sym.append(ch)
                continue
            pieces = [f"<0x{b:02X}>" for b in ch.encode("utf-8")]
            if all(p in self._ids for p in pieces):
                sym += pieces
            elif not sym or sym[-1] != _UNK_SYMBOL:  # a run of them is one <unk>
                sym.append(_UNK_SYMBOL)
        n = len(sym)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1:] = [-1] if n else []
        heap: list[tuple[int, int, int, int, int]] = []

        def push(i: int) -> None:
            j = nxt[i]
            if j < 0:
                return
            merged = self._ids.get(sym[i] + sym[j])
            if merged is not None:
                # Best rank first, then the longer left part, then leftmost (the merged id only
                # orders equal scores as transformers' stable sort of its merges does).
                heapq.heappush(heap, (self._rank[merged], -len(sym[i]), -len(sym[j]), merged, i, j))

        for i in range(n - 1):
            push(i)
        while heap:
            _, _, _, merged, i, j = heapq.heappop(heap)
            if not sym[i] or nxt[i] != j or self._ids.get(sym[i] + sym[j]) != merged:
                continue  # stale: one side has been merged since
            sym[i] += sym[j]
            sym[j] = ""
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prev[nxt[j]] = i
            if prev[i] >= 0:
                push(prev[i])
            push(i)
        out: list[int] = []
        for piece in sym:
            if piece:
                pid = self._ids.get(piece)
                out.append(pid if pid is not None else (self.unk_token_id or 0))
        return out

    # -- the same pipeline in the `tokenizers` library (what `kvviz export` writes) ----------
    def backend(self) -> Any:
        """This tokenizer as a `tokenizers` pipeline that encodes exactly as ``encode`` does, for a
        tokenizer.json (transformers, vLLM). SentencePiece stores no merges; they are derived: every
        split of a piece into two pieces is a merge, ordered as ``_encode_plain``'s heap orders them
        (the merged piece's rank, then the longer left part, the longer right part, the merged id),
        and `tokenizers`' BPE then picks the lowest merge, leftmost among equals, as the heap does.
        Whole tokens are added tokens (matched before the normalizer, which then runs per stretch:
        spaces as ``▁`` and the prefix before each stretch); byte fallback and fused ``<unk>`` as here."""
        from tokenizers import AddedToken, Tokenizer, decoders, normalizers
        from tokenizers.models import BPE

        ids = self._ids
        ranked = []
        for piece, pid in ids.items():
            for k in range(1, len(piece)):
                left, right = piece[:k], piece[k:]
                if left in ids and right in ids:
                    ranked.append((self._rank[pid], -len(left), -len(right), pid, left, right))
        ranked.sort()
        unk = self._pieces[self.unk_token_id] if self.unk_token_id is not None else self._pieces[0]
        backend = Tokenizer(BPE(vocab=dict(ids), merges=[(a, b) for *_, a, b in ranked], unk_token=unk,
                                fuse_unk=True, byte_fallback=True, dropout=None))
        steps = [normalizers.Prepend(SPACE)] if self.add_space_prefix else []
        backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
        backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                            + ([decoders.Strip(" ", 1, 0)] if self.add_space_prefix else []))
        user = {t for t, i in self._whole.items() if i not in self._special}
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.control_tokens])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in sorted(user)])
        return backend

    # -- decoding -------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: ``▁the`` -> b' the', ``<0xE2>`` -> b'\\xe2'; a control
        token -> its text."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        piece = self._pieces[token_id]
        if self._types[token_id] == _BYTE:
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        return piece.replace(SPACE, " ").encode("utf-8")



def _matcher(tokens: dict[str, int]) -> "re.Pattern[str] | None":
    """Leftmost-longest matching of whole tokens: a regex alternation, longest first."""
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def load_spm_tokenizer(metadata: Mapping[str, Any], name: str = "model.gguf", *, gemma: bool = True) -> SPMTokenizer:
    """The SentencePiece tokenizer of a GGUF file, from its metadata already read
    (``gguf_lite.read_gguf``: arrays of numbers as numpy arrays, of strings as lists).
    ``gemma``: Gemma's conventions (merges ranked by position, real-space pieces respelled);
    False for a Llama-family file (llama, Mistral): merges ranked by the file's scores."""
    def get(key: str, default: Any = None) -> Any:
        v = metadata.get(key, default)
        return v.tolist() if hasattr(v, "tolist") else v

    model = get("tokenizer.ggml.model")
    if model != "llama":
        raise KVVizError(f"{name}: tokenizer.ggml.model is {model!r}, not a SentencePiece ('llama') vocabulary")
    tokens = get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise KVVizError(f"{name} has no vocabulary (tokenizer.ggml.tokens is missing or empty)")
    types = get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    scores = None if gemma else get("tokenizer.ggml.scores")  # none in the file: by position
    template = get("tokenizer.chat_template")  # Mistral Instruct's [INST] turns, TinyLlama's...

    def token_id(key: str) -> int | None:
        v = get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < len(tokens):
            raise KVVizError(f"{name}: {key} = {v!r} is outside the {len(tokens)}-token vocabulary")
        return v

    return SPMTokenizer(
        name, list(tokens), [int(t) for t in types], bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=token_id("tokenizer.ggml.eos_token_id"), unk_token_id=token_id("tokenizer.ggml.unknown_token_id"),
        pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos=bool(get("tokenizer.ggml.add_bos_token", True)),
        add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", True)),
        scores=[float(x) for x in scores] if scores is not None else None, respell_spaces=gemma,
        chat_template=template if isinstance(template, str) else None,
    )

