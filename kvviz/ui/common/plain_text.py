"""User and config text shown inside Streamlit's Markdown elements as exactly the characters typed.

st.warning, st.error, st.caption, st.info and st.markdown all render GitHub-flavoured Markdown,
so a link setting such as ``![](http://evil.example/x.png)`` would make the browser fetch an
image and ``[Session expired](https://evil.example)`` would render a live link. ``md_plain``
neutralises both layers Streamlit applies:
- Markdown syntax: every ASCII punctuation character is backslash-escaped (CommonMark allows
  that for all of them), which also stops HTML, LaTeX ``$...$`` and ``:color[...]`` directives;
- GFM's autolink literals (``https://...``, ``www.x``, ``a@b.c``), which remark finds in the
  text *after* escapes are decoded: a WORD JOINER (U+2060, invisible) breaks each trigger.
Line breaks and other control characters become visible escapes, so one value stays one line.
"""
from __future__ import annotations

import re

WORD_JOINER = "\u2060"
_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_AUTOLINK_TRIGGERS = ((re.compile(r"(?<=:)(?=//)"), WORD_JOINER),  # https://  ->  https:<WJ>//
                      (re.compile(r"(?i)(?<=www)(?=\.)"), WORD_JOINER),  # www.x -> www<WJ>.x
                      (re.compile(r"(?<=@)"), WORD_JOINER))  # a@b.c -> a@<WJ>b.c


def md_plain(text: object, limit: int | None = None) -> str:
    """``text`` as Markdown source that renders as the same characters and nothing else.

    ``limit`` cuts long values (with an ellipsis) before escaping, so a link setting cannot fill
    the page either.
    """
    s = str(text)
    if limit is not None and len(s) > limit:
        s = s[: max(limit - 1, 0)] + "…"
    s = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else " ", s)
    for pattern, joiner in _AUTOLINK_TRIGGERS:
        s = pattern.sub(joiner, s)
    return "".join("\\" + ch if ch in _PUNCT else ch for ch in s)


def unescape(markdown: str) -> str:
    """What ``md_plain`` produced, back to the original characters (control characters stay escaped)."""
    return re.sub(r"\\(.)", r"\1", markdown).replace(WORD_JOINER, "")
