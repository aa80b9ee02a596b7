"""The Chat page: a conversation whose KV cache lives across turns, and the paged pool under it.

Each turn prefills only what is new (the chat template's tokens for the new message plus the
assistant header) and decodes on the same cache; editing an earlier message keeps the cache up to
its first changed token; a timestamp at the start of the system prompt misses every turn. The
one-click scenario (kvviz/ui/pages/chat/chat_scenario.py) runs parallel samples, a hit and a miss on one pool.
"""
from __future__ import annotations

import inspect
from typing import Any, Iterator

import streamlit as st

from kvviz.charts import paged_charts as pc
from kvviz.engine.generation.valid_request import CacheSpec
from kvviz.engine.kvcache.paged_pool import config_groups, pool_blocks
from kvviz.engine.sessions.conversation import Conversation, InterruptedTurn, TurnInterrupted, with_chat_template
from kvviz.engine.loading.loader import LoadedModel
from kvviz.errors import KVVizError
from kvviz.ui.pages.chat import chat_scenario, chat_views
from kvviz.ui.common.figs import show
from kvviz.ui.common.busy_notes import busy_note
from kvviz.ui.common.measuring_page import page_model, where
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.settings import ENGINES
from kvviz.ui.common.stepper import close_iterator
from kvviz.ui.state import session

INTRO = (
    "Serving engines keep the KV cache **between requests**. A chat's second turn then computes only its new "
    "tokens: the conversation so far is already in the cache. Below, each turn reuses the longest common prefix "
    "of token ids between the new prompt and what the cache holds, prefills the rest, and decodes the answer on "
    "the same cache. The **paged** cache stores K/V in fixed-size blocks (vLLM style): a block table per "
    "sequence maps its logical blocks to physical ones, full blocks are found again by a hash of their prefix, "
    "and blocks are shared with ref counts and copied on write."
)
BLOCK_SIZES = (4, 8, 16, 32)


def page() -> None:
    got = page_model("Chat: a cache that lives across turns", INTRO)
    if got is None:
        return
    s, base = got
    model, fallback = with_chat_template(base)
    if fallback:
        st.info(f"{md_plain(base.name)} has no chat template: turns are laid out in ChatML so the cache "
                "mechanics show, but this model was never trained on chats, so its answers are noise. "
                "Pick SmolLM2 in the sidebar for real answers.")
    fast = s.engine == "fast"
    c1, c2, c3, c4 = st.columns(4)
    kind = c1.selectbox("Cache", ["paged", "static", "concat"], key="chat_cache",
                        help="paged: blocks + block table (vLLM); static: one preallocated buffer; concat: grows by cat")
    block = int(c2.selectbox("Block size (tokens)", BLOCK_SIZES, index=2, key="chat_block", disabled=kind != "paged"))
    groups = config_groups(model.config).count
    blocks = int(c3.number_input("Pool (blocks)", min_value=4, max_value=512, value=default_pool_blocks(groups), step=8,
                                 key="chat_blocks", disabled=kind != "paged",
                                 help="the pool's size; full blocks of ref count 0 stay cached until it runs out"
                                 + (f". This model's layers form {groups} groups (sliding and global), each with "
                                    "its own block table: every position takes one block per group, and a "
                                    "sliding group lets go of blocks that leave its window" if groups > 1 else "")))
    max_new = int(c4.number_input("Max new tokens", min_value=1, max_value=256, value=24, key="chat_max_new",
                                  help="short answers keep every turn quick on a small CPU"))
    stamp = st.toggle("Put the current time at the start of the system prompt", key="chat_timestamp",
                      help="what some deployments do: the prompt changes at its start, so every turn misses the cache")
    st.caption(f"{where(model)} · engine: {ENGINES[s.engine]} · sampling: "
               + ("greedy" if s.greedy else f"temperature {s.temperature}, seed {s.seed}")
               + " · max new tokens, sampling and the timestamp apply from the next turn; another model, "
               "engine or cache keeps the conversation and rebuilds the cache from it")
    busy_note(short=True)  # TTFTs are timed: say when other processes hold the cores
    cache_args = {"cache": CacheSpec(kind=kind, block_size=block, blocks=blocks), "backend": s.engine}
    turn_args = {"max_new_tokens": max_new, "timestamp": stamp, "sampling": s.sampling()}
    conv = _conversation(model, s.model_key, cache_args, turn_args)
    if conv is None:
        return
    tab_chat, tab_scenario = st.tabs(["Chat", "One-click scenario"])
    with tab_chat:
        _chat(conv)
    with tab_scenario:
        chat_scenario.section(model, fast, block, blocks)


def default_pool_blocks(groups: int) -> int:
    """The pool's default size: 64 blocks per layer group. A model with sliding and global layers
    (Gemma 3) keeps one block table per group and a block holds one group's layers, so each
    position takes a block in every group (engine/kvcache/paged_pool.py)."""
    return min(512, pool_blocks(groups, 64))


def _conversation(model: LoadedModel, model_key: tuple[str, ...], cache_args: dict[str, Any],
                  turn_args: dict[str, Any]) -> Conversation | None:
    """This session's conversation, never thrown away by a setting (issue 37). A setting of the
    next turn (max new tokens, sampling, timestamp) is applied to it; another model, engine or
    cache rebuilds its cache empty and keeps the transcript, which the next turn prefills again."""
    cache_key = (model_key, tuple(sorted(cache_args.items())))
    turn_key = tuple(sorted(turn_args.items(), key=lambda kv: kv[0]))
    conv: Conversation | None = session.get(session.CHAT_CONVERSATION)
    built = session.get(session.CHAT_CONVERSATION_KEY) if conv is not None else None
    try:
        if conv is None:
            conv = Conversation(model, **cache_args, **turn_args)
            conv.warm_up()  # turn 1's TTFT then times the model, not first-call costs
            session.put(session.CHAT_CONVERSATION, conv)
            session.put(session.CHAT_CHECKS, {})
        else:
            if not built or built[0] != cache_key:
                switched = not built or built[0][0] != model_key
                conv.rebuild(model, **cache_args,
                             reason="the model was switched" if switched else "the cache settings changed")
                conv.warm_up()
            if not built or built[1] != turn_key:
                conv.configure(**turn_args)
    except KVVizError as e:
        kept = f" The conversation ({len(conv.turns)} turns) is kept: it comes back when the settings allow a " \
               "cache again." if conv is not None and conv.turns else ""
        st.error(md_plain(f"{str(e).rstrip('.')}.{kept}" if kept else e))
        return None
    session.put(session.CHAT_CONVERSATION_KEY, (cache_key, turn_key))
    return conv


def _chat(conv: Conversation) -> None:
    # Read the message before drawing the conversation (into a container placed above the input): a
    # rerun that stops this run while it draws must not lose the message.
    view = st.container()
    text = st.chat_input("Say something", key="chat_input")
    sent = False
    try:
        with view:
            _conversation_view(conv)
        if text is not None:
            sent = True
            _send(conv, text)
    finally:
        if text is not None and not sent:
            conv.drop(text, "interrupted by a rerun")
    _controls(conv)


def _conversation_view(conv: Conversation) -> None:
    checks: dict[int, tuple[bool, float]] = session.setdefault(session.CHAT_CHECKS, {})
    # A turn still running belongs to an older script run that this rerun stopped (Streamlit's fast
    # reruns start a new thread at once): roll it back now, so what is drawn below is current.
    conv.interrupt("interrupted by a rerun")
    turns, cut, carried = conv.turns, conv.interrupted, conv.carried  # read once: another thread replaces them
    if turns and carried >= len(turns):
        st.info(md_plain(
            f"The conversation is kept ({len(turns)} turn{'' if len(turns) == 1 else 's'}), but it was computed on "
            f"another model or cache (the last turn on {turns[-1].made_on or 'earlier settings'}). It now runs on "
            f"{conv.label()}, "
            "whose cache starts empty: the next turn prefills the whole transcript again (nothing reused on that "
            "turn), and the turns after it reuse the cache as before."), icon="♻️")
    tok = conv.model.tokenizer
    controls = getattr(tok, "control_tokens", None) or {}
    for i, t in enumerate(turns):
        _interrupted(cut, i)
        with st.chat_message("user"):
            st.text(t.user)
            note = chat_views.typed_note(t.user, controls, conv.parse_special)
            if note:
                st.caption(md_plain(note))
        with st.chat_message("assistant"):
            st.text(t.text)
            got = checks.get(i)
            line = chat_views.turn_line(t, got[1] if got else None, got[0] if got else None)
            if i < carried:  # plain text: the label holds the model's name
                line += f" · computed on an earlier cache: {md_plain(t.made_on or 'earlier settings')}"
            st.caption(line)
    _interrupted(cut, len(turns))
    err = session.pop(session.CHAT_ERROR, None)
    if err:
        st.error(md_plain(err))


def _controls(conv: Conversation) -> None:
    checks: dict[int, tuple[bool, float]] = session.setdefault(session.CHAT_CHECKS, {})
    tok = conv.model.tokenizer
    b0, b1, b2, b3, b4 = st.columns([1.2, 2, 1.6, 1, 1])
    # Any earlier message: the cache is kept up to the first token that changes (in the chips).
    which = b0.selectbox("Message to edit", range(len(conv.turns)) or [0], key="chat_edit_turn",
                         disabled=not conv.turns, format_func=lambda i: f"your message {i + 1}")
    edit = b1.text_input("Edit it and answer again", key="chat_edit", disabled=not conv.turns,
                         placeholder="the message, changed")
    if b1.button("Replace the message", key="chat_edit_go", disabled=not conv.turns):
        _send(conv, edit, edit_turn=int(which))  # Conversation.edit names a turn that no longer exists
    if b2.button("Check against scratch", key="chat_check", disabled=not conv.turns,
                 help="generates every turn again on a fresh cache (same sampling), compares the tokens, and "
                      "times the TTFT of prefilling the whole conversation"):
        for i in range(conv.carried, len(conv.turns)):  # a carried turn's ids are an earlier model's
            checks[i] = (conv.matches_scratch(i), conv.recompute_ttft_ms(i))
        st.rerun()
    if b3.button("Regenerate", key="chat_regen", disabled=not conv.turns,
                 help="answer the last message again (the next seed when sampling): the cache keeps the prompt, "
                      "and a block the old answer filled is copied on write"):
        _send(conv, "", regenerate=True)
    if b4.button("New chat", key="chat_reset"):
        session.put(session.CHAT_CONVERSATION, None)
        st.rerun()
    if not conv.turns:
        return
    last, own = conv.turns[-1], conv.carried < len(conv.turns)
    st.subheader("The last turn's tokens")
    if own:
        chat_views.chips(tok, last)
    else:  # its ids are another tokenizer's, its pool another cache's
        st.caption("The last turn was computed on the earlier cache: its tokens show again after the next turn.")
    turns = [{**t.to_dict(), "recompute_ttft_ms": checks[i][1] if i in checks else None}
             for i, t in enumerate(conv.turns)]
    left, right = st.columns(2)
    show(left, pc.reuse_bars(turns), key=f"chat_reuse_{len(turns)}")
    show(right, pc.ttft_bars(turns), key=f"chat_ttft_{len(turns)}_{len(checks)}")
    right.caption(md_plain(chat_views.no_reuse_note(conv.turns, conv.label(), str(conv.model.device))))
    if own and last.snapshots:
        st.subheader("The paged pool during the last turn")
        chat_views.pool_views(last.snapshots, key=f"chat_pool_{len(turns)}", names=["conversation"])


LIVE_EVERY = 4  # redraw the live pool every this many steps (each draw is a new chart in the browser)


def _interrupted(cut: list[InterruptedTurn], after: int) -> None:
    """The turns interrupted after finished turn ``after``: the message and the partial answer,
    labelled; neither is part of the conversation (its cache rolled back to before them). Repeats
    of one message in a row (Regenerate clicked again and again) show once, with their count."""
    here = [c for c in cut if c.after == after]
    for i, c in enumerate(here):
        if i + 1 < len(here) and here[i + 1].user == c.user:
            continue  # the next one is the same message, tried again
        n = 1
        while i - n >= 0 and here[i - n].user == c.user:
            n += 1
        with st.chat_message("user"):
            st.text(c.user)
        with st.chat_message("assistant"):
            st.text(c.text or "(no answer yet)")
            line = chat_views.interrupted_line(c)
            if n > 1:
                line += f" The same message was interrupted {n} times in a row; this is the last."
            st.caption(md_plain(line))


def _send(conv: Conversation, text: str, edit_turn: int | None = None, regenerate: bool = False) -> None:
    """Run one turn, the pool redrawn live as it decodes (paged); a bad message is shown and
    nothing is lost. A turn is a transaction (engine/sessions/conversation.py): a Stop or a rerun raises
    here while drawing, and closing the iterator rolls the turn back on this thread; a click that
    starts a newer turn (a new message, Regenerate, an edit) on the next script thread waits for
    this turn's running step, then replaces it. Either way the conversation is as before the turn,
    and the page shows the interrupted turn, labelled."""
    it: Iterator[dict[str, Any]] | None = None
    try:
        if regenerate:
            it = conv.iter_regenerate(conv.params.seed + 1)
        elif edit_turn is not None:
            it = conv.iter_edit(edit_turn, text)
        else:
            it = conv.iter_send(text)
        live = st.empty()
        for i, snap in enumerate(it):
            if i % LIVE_EVERY == 0:
                with live.container():
                    st.caption(f"Answering on the same cache: step {i + 1}")
                    if snap:
                        show(st, pc.pool_grid(snap, ["conversation"]), key=f"chat_live_{len(conv.turns)}_{i}")
        live.caption("Timing the same prompt again without reuse (a fresh cache), for the comparison…")
        conv.time_without_reuse()  # one extra prefill: what this turn would have cost with nothing reused
        if edit_turn is not None or regenerate:
            session.put(session.CHAT_CHECKS, {})
    except TurnInterrupted:
        return  # a newer turn replaced this one: the script run that started it draws the page
    except KVVizError as e:
        session.put(session.CHAT_ERROR, str(e))
        if it is None and edit_turn is None and not regenerate and text.strip():
            conv.drop(text, f"not sent: {e}")  # refused before it began (too long for the context...): keep it
    finally:
        if it is not None and inspect.getgeneratorstate(it) == inspect.GEN_CREATED and edit_turn is None \
                and not regenerate:  # stopped before the turn began: keep the message, unanswered
            conv.drop(text, "interrupted by a rerun")
        close_iterator(it)  # interrupted while drawing: roll the turn back now, not when collected
    st.rerun()
