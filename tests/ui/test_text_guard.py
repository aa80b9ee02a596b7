"""Issue 37, class 4: the note beside a prompt that holds U+FFFD (kvviz/ui/common/text_guard.py).

The guard's script itself runs in the browser (tests/browser/test_hardening_browser.py)."""
from __future__ import annotations

from kvviz.ui.common.text_guard import JS, replacement_note


def test_the_note_says_where_the_replacement_character_stands() -> None:
    assert replacement_note("plain text") == ""
    note = replacement_note("a\ufffdc")
    assert note.startswith("The prompt holds U+FFFD (\ufffd), the replacement character, at character 2:")
    assert "(3 in all)" in replacement_note("\ufffd" * 3, "The message")
    assert replacement_note("\ufffd", "The message").startswith("The message holds")


def test_the_script_runs_before_react_and_keeps_the_length() -> None:
    """Capture phase on the document (React listens at its root, below it); the replacement is one
    UTF-16 unit for one, so the caret and every later character keep their places."""
    assert 'document.addEventListener("input", clean, true)' in JS
    assert 'text.replace(LONE, "\\uFFFD")' in JS
