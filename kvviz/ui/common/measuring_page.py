"""A measuring page's start (race, prefill/decode, batching, decoding, compression, chat, serving):
its title and introduction, the sidebar's settings and model, the prompt as Generate feeds it, and the
names every measurement is shown and kept under."""
from __future__ import annotations

import streamlit as st

from kvviz import KVVizError, LoadedModel
from kvviz.engine.generation.request import resolve_chat
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.settings import Settings
from kvviz.ui.state import session
from kvviz.ui.state.model_cache import get_model


def settings() -> Settings:
    s = session.settings()
    return s if isinstance(s, Settings) else Settings()


def prompt_ids(s: Settings, model: LoadedModel) -> tuple[tuple[int, ...], str]:
    """The sidebar's prompt as the Generate page feeds it, and its text: with Chat on, the question laid out
    by the model's chat template (an instruct model fed the bare question answers with its end token
    at once, and a race of one token shows nothing). () when there is no prompt or no tokenizer."""
    if not s.prompt or not model.has_tokenizer:
        return (), s.prompt
    if s.chat:
        try:
            rows, text = resolve_chat(model, s.prompt, None, None)
            return tuple(rows[0]), text
        except KVVizError:
            pass  # no template or too long: the plain prompt, which the request's own checks then judge
    return tuple(model.tokenizer.encode(s.prompt)), s.prompt


def page_model(title: str, intro: str) -> tuple[Settings, LoadedModel] | None:
    """A measuring page's start: its title and introduction, then the sidebar's settings and model;
    None (with an error shown under the introduction) when the model will not load."""
    st.title(title)
    st.markdown(intro)
    s = settings()
    try:
        return s, get_model(s.model, s.device, s.dtype)
    except KVVizError as e:
        st.error("This model cannot be loaded: " + md_plain(e))
        return None


def where(model: LoadedModel) -> str:
    """Named on every measurement: which model, on which device, in which dtype."""
    return f"{md_plain(model.name)} · {model.device} · {model.dtype_name}"  # a folder name is plain text


def results_key(prefix: str, model: LoadedModel) -> str:
    """Session key for one page's results of one (model, device, dtype)."""
    return f"{prefix}::{model.name}::{model.device}::{model.dtype_name}"
