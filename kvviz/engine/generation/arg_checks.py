"""The API's arguments checked for type and range before anything else, with the CLI's words.

The CLI's parser refuses a bad value before a model loads (kvviz/cli/argtypes.py); a Python caller
has no parser, so ``kvviz.generate(model, prompt=b"hello")`` met a raw AttributeError deep in the
tokenizer and a prompt of ids ``[1.5]`` ran as token 1. Here every value of a request
(engine/generation/request.py hands them over under the CLI's names) is checked the same way whether
or not the run uses it (a paged block size without a paged cache is still a block size), each
failure one KVVizError naming the argument, what it takes and what it got.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Mapping, Sequence

from kvviz.engine.tokenize.surrogates import first_surrogate
from kvviz.errors import KVVizError
from kvviz.limits import MAX_BEAMS, MAX_DRAFT, MAX_HEAD_DIM, MAX_KV_BLOCK_SIZE, MAX_KV_BLOCKS, MAX_NGRAM, MAX_SINKS, \
    MAX_TOKENS

# (argument, lowest, highest, None allowed): the same bounds as the CLI's options (kvviz/limits.py)
# max_new_tokens and batch_size have their own checks (request.py), as a paged cache's block size and
# pool (check_pool): those two are checked here only when no paged cache will check them.
_PAGED = (("kv_block_size", 1, MAX_KV_BLOCK_SIZE, False), ("kv_blocks", 1, MAX_KV_BLOCKS, True))
_INTS = (("num_beams", 1, MAX_BEAMS, False), ("num_return_sequences", 1, MAX_BEAMS, False),
         ("draft_tokens", 1, MAX_DRAFT, False), ("ngram", 1, MAX_NGRAM, False), ("window", 1, MAX_TOKENS, True),
         ("sinks", 0, MAX_SINKS, False), ("kv_group_size", 1, MAX_HEAD_DIM, True))
_FLAGS = ("use_cache", "chat", "parse_special", "kv_zero_point", "track_kv_error")


def _kind(v: object) -> str:
    name = type(v).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _shown(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def is_int(v: object) -> bool:
    """An integer (Python's, numpy's or a 0-d integer tensor), never a bool or a float."""
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def check_text(what: str, text: object) -> None:
    """``text`` is a str of valid Unicode: no bytes, no lone surrogate (which no tokenizer can encode)."""
    if isinstance(text, (bytes, bytearray)):
        raise KVVizError(f"{what} must be text (a str), got bytes: decode it first, e.g. {what}=data.decode('utf-8')")
    if not isinstance(text, str):
        raise KVVizError(f"{what} must be text (a str), got {_kind(text)}: {_shown(text)}")
    at = first_surrogate(text)  # any surrogate, a pair's halves too: a str holding one is not Unicode
    if at is not None:
        raise KVVizError(f"{what} holds a lone surrogate (U+{ord(text[at]):04X}) at character {at + 1:,}: "
                         "that is not valid Unicode text, so it cannot be tokenized; remove it")


def check_prompt_ids(ids: object) -> list[list[int]]:
    """One row of token ids, or equal-length rows: ints (not floats, not bools, not a string's characters)."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence) and not hasattr(ids, "__iter__"):
        raise KVVizError(f"the prompt must be text, token ids or chat messages, got {_kind(ids)}: {_shown(ids)}")
    seq = list(ids)  # type: ignore[call-overload]
    nested = bool(seq) and all(isinstance(r, (list, tuple)) for r in seq)
    rows = [list(r) for r in seq] if nested else [seq]
    for r, row in enumerate(rows):
        for i, v in enumerate(row):
            if not is_int(v):
                where = f"row {r}, position {i}" if nested else f"position {i}"
                raise KVVizError(f"prompt ids must be integers (token ids); {where} holds {_shown(v)} ({_kind(v)})")
    return [[operator.index(v) for v in row] for row in rows]


def check_arguments(args: Mapping[str, Any]) -> None:
    """Every argument given's type and range, before the prompt is read (KVVizError on the first bad one)."""
    if args.get("prompt") is not None:
        check_text("prompt", args["prompt"])
    for m in args.get("messages") or ():
        if isinstance(m, Mapping) and "content" in m:
            check_text("a message's content", m["content"])
    stop = args.get("stop")
    if stop is not None:
        if isinstance(stop, str) or not isinstance(stop, Sequence):
            raise KVVizError(f"stop must be a list of strings, got {_kind(stop)}: write stop=[{_shown(stop)}]")
        for s in stop:
            check_text("each stop string", s)
    for name in _FLAGS:
        if name in args and not isinstance(args[name], bool):
            raise KVVizError(f"{name} must be True or False (got {_shown(args[name])})")
    for name, lo, hi, optional in _INTS + (_PAGED if args.get("cache_kind") != "paged" else ()):
        if name not in args:  # a strategy's values come only with that strategy
            continue
        v = args[name]
        if v is None and optional:
            continue
        if not is_int(v) or not lo <= operator.index(v) <= hi:  # type: ignore[arg-type]
            raise KVVizError(f"{name} must be an integer from {lo:,} to {hi:,} (got {_shown(v)})")
    if "length_penalty" not in args:
        return
    v = args["length_penalty"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise KVVizError(f"length_penalty must be a finite number (got {_shown(v)})")
