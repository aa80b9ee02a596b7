"""Widget values that survive a page where the widget is not drawn.

Streamlit forgets a widget's value at the end of any run that does not render it (the sidebar
is not drawn on the calculator page). So each kept widget is initialised from a shadow copy
before it is created, and the shadow is refreshed after.

The widget's value comes from ``st.session_state``, but pass what ``keep`` returns as its
``value=`` too (a selectbox or radio: ``keep_index``'s, as its ``index=``). That argument is the
widget's default, which Streamlit falls back to where its state goes missing on either side (a
browser that mounts the widget without the value the server set, or a server that registers it
afresh), and a fallback to the widget's own default is wrong for most of ours: an empty prompt,
1 new token, chat off, the oldest run. It was seen: under load in CI, a session whose prompt box
nobody touched pressed Generate and got "the prompt is empty". A keyed widget's identity ignores
its default, so passing the current value each run changes nothing else
(``.streamlit/config.toml`` silences Streamlit's log line about a default given beside a
session-state value).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvviz.ui.state import session

SHADOW_KEY = session.KEPT_WIDGETS


def _shadow() -> dict[str, Any]:
    if not session.has(SHADOW_KEY):
        session.put(SHADOW_KEY, {})
    return session.read(SHADOW_KEY)


def keep(key: str, default: Any, options: Sequence[Any] | None = None,
         bounds: tuple[float | None, float | None] | None = None) -> Any:
    """Put back ``key``'s last value (or ``default``) before its widget is created; return it.

    ``options``: a value no longer offered (a model folder removed, CUDA gone) falls back to
    ``default``. ``bounds``: a number is clamped, e.g. when a smaller model shrinks the context.
    """
    ss = session.mapping()
    if key not in ss:
        ss[key] = _shadow().get(key, default)
    value = ss[key]
    if options is not None and value not in options:
        value = default if default in options else options[0]
    if bounds is not None and isinstance(value, (int, float)):
        lo, hi = bounds
        if lo is not None and value < lo:
            value = type(value)(lo)
        if hi is not None and value > hi:
            value = type(value)(hi)
    if value != ss[key]:
        ss[key] = value
    return value


def keep_index(key: str, default: Any, options: Sequence[Any]) -> int:
    """``keep`` for a widget that picks one of ``options`` (selectbox, radio): the kept value's
    position, for the widget's ``index=``."""
    return list(options).index(keep(key, default, options=options))


def last(key: str, default: Any = None) -> Any:
    """The widget's value now, or as it was when it was last drawn."""
    return session.get(key, _shadow().get(key, default))


def remember(*keys: str) -> None:
    """Copy the widgets' current values into the shadow (call after creating them)."""
    shadow = _shadow()
    for key in keys:
        if session.has(key):
            shadow[key] = session.read(key)


def now(key: str, kind: type | None = None) -> Any:
    """The value ``key`` holds now, for its widget's ``value=`` (a multiselect's ``default=``), cast to
    ``kind`` where given (a float box refuses an int). A widget whose state Streamlit registers afresh
    falls back to that argument, not to its own lowest value or first option (the docstring above)."""
    value = session.read(key)
    return kind(value) if kind is not None else value


def index_of(key: str, options: Sequence[Any]) -> int:
    """``index=`` for a selectbox or radio: where ``key``'s value sits in ``options`` (0 where it is not one)."""
    opts = list(options)
    value = session.get(key)
    return opts.index(value) if value in opts else 0
