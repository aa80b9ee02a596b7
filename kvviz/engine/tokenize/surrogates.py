"""Surrogate code points in a str, the one place each rule about them is written.

A Python str may hold surrogate code points (U+D800..U+DFFF): from a broken paste, from argv bytes
that are not UTF-8 (surrogateescape), from a JavaScript string cut between the two halves of an
emoji. They are not Unicode text: UTF-8 has no bytes for them and the Rust tokenizers refuse them.
Two rules, for two kinds of caller:

- **Refuse** (the API, ``engine/generation/arg_checks.py``): ``first_surrogate`` finds the first one,
  paired or not, so the message can say where it is; the caller is asked to fix the text.
- **Repair** (every tokenizer's ``encode``, and the app's text guard in the browser): each *lone*
  surrogate becomes one U+FFFD, the replacement character, and a high surrogate followed by a low
  one becomes the character the pair stands for (a clipboard's "\\ud83e\\udd99" is the llama emoji).
  ``LONE_SURROGATE`` is the pattern, written so that Python's ``re`` and JavaScript's ``RegExp``
  (without the ``u`` flag, where a string is UTF-16 units) read it alike:
  ``ui/common/text_guard.py`` puts this very string in its script, so what the browser sends and what
  ``encodable`` makes of the same text are one rule.
"""
from __future__ import annotations

import re

REPLACEMENT = "\ufffd"
# A high surrogate not followed by a low one, or a low one not preceded by a high one.
LONE_SURROGATE = r"[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]"
_LONE = re.compile(LONE_SURROGATE)
_ANY = re.compile("[\ud800-\udfff]")


def first_surrogate(text: str) -> int | None:
    """The index of the first surrogate code point in ``text`` (paired or lone), or None."""
    found = _ANY.search(text)
    return None if found is None else found.start()


def replace_lone(text: str) -> str:
    """Each lone surrogate made U+FFFD, pairs left as they are: what the text guard does in the browser
    (one character for one, so a caret stays where it was)."""
    return _LONE.sub(REPLACEMENT, text)


def encodable(text: str) -> str:
    """``text`` as Unicode a tokenizer can encode: each lone surrogate one U+FFFD, each pair the
    character it stands for; valid text comes back unchanged (the same object)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    # After replace_lone every surrogate left is half of a pair: the UTF-16 round trip joins them.
    return replace_lone(text).encode("utf-16-le", "surrogatepass").decode("utf-16-le")


def utf8_bytes(text: str) -> bytes:
    """The UTF-8 bytes of ``encodable(text)`` (the byte-level tokenizer's ids)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return encodable(text).encode("utf-8")
