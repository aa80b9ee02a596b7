"""Text boxes whose contents the browser could not send: a lone surrogate replaced before it is.

A JavaScript string may hold a lone UTF-16 surrogate ("a\\ud800c", from a broken paste or a
script); Streamlit's front end encodes it as invalid UTF-8, the server refuses the whole message
and drops the connection, and every rerun after that carries it again: the page kept acting on the
text it had before (a 3,000-token prompt's errors under a box showing 3 characters). This element
listens, in the capture phase and before React reads the box, to every ``input`` event of the page
and replaces each lone surrogate with U+FFFD, the replacement character, so the box and the server
hold the same text; the Generate sidebar then says where a U+FFFD stands (``replacement_note``). The
pattern is ``engine/tokenize/surrogates.py``'s, the rule every tokenizer repairs text by.

The element draws nothing (its container is hidden) and carries no user text: only its script.
"""
from __future__ import annotations

import streamlit as st

from kvviz.engine.tokenize.surrogates import LONE_SURROGATE, REPLACEMENT

KEY = "text_guard"
JS = r"""
const LONE = /@LONE@/g;
const SETTERS = new Map([
  [HTMLTextAreaElement, Object.getOwnPropertyDescriptor(HTMLTextAreaElement.prototype, "value").set],
  [HTMLInputElement, Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, "value").set],
]);
function clean(event) {
  const box = event.target;
  for (const [kind, set] of SETTERS) {
    if (!(box instanceof kind)) continue;
    const text = box.value;
    if (typeof text !== "string" || text.search(LONE) < 0) return;
    const start = box.selectionStart, end = box.selectionEnd;
    set.call(box, text.replace(LONE, "\uFFFD"));  // same length: the caret stays where it was
    try { box.setSelectionRange(start, end); } catch (e) { /* an input type without a selection */ }
    return;
  }
}
export default function () {
  if (window.__kvvizTextGuard) return;  // one listener per page, however often the element is drawn
  window.__kvvizTextGuard = true;
  document.addEventListener("input", clean, true);  // capture: before React's own listener reads the box
}
""".replace("@LONE@", LONE_SURROGATE)  # the pattern tokenizers repair by (surrogates.py)
CSS = f".st-key-{KEY} {{ display: none; }}"  # no space taken, no gap in the page's column

_component = st.components.v2.component("kvviz_text_guard", js=JS, css=CSS, isolate_styles=False)


def install() -> None:
    """Draw the guard (once per script run, on every page)."""
    _component(key=KEY, data=None)


def replacement_note(text: str, what: str = "The prompt") -> str:
    """'' unless ``text`` holds U+FFFD; then where, and what it usually stands for."""
    at = text.find(REPLACEMENT)
    if at < 0:
        return ""
    n = text.count(REPLACEMENT)
    more = f" ({n:,} in all)" if n > 1 else ""
    return (f"{what} holds U+FFFD (\N{REPLACEMENT CHARACTER}), the replacement character, at character {at + 1:,}{more}: "
            "it stands where the text held something that is not valid Unicode (such as a lone surrogate from "
            "a broken paste), which the browser cannot send as typed. What runs is the text as shown.")
