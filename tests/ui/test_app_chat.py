"""AppTest over the Chat page on random:tiny (ChatML fallback template): turns, reuse numbers,
the pool views, an edit, the from-scratch check, bad input, and the one-click scenario."""
from __future__ import annotations

from streamlit.testing.v1 import AppTest

from apptest_pages import ok as _ok, tiny_default, titles as _titles  # noqa: F401 (tiny_default: autouse)

from kvviz.ui.common.plain_text import unescape


def _chat() -> None:
    import streamlit as st

    from kvviz.ui.pages.chat import chat_page
    from kvviz.ui.sidebar import render_sidebar

    st.session_state["settings"] = render_sidebar()
    chat_page.page()


def test_chat_turns_reuse_and_show_the_pool() -> None:
    at = AppTest.from_function(_chat, default_timeout=120)
    at.run()
    _ok(at)
    assert at.title[0].value == "Chat: a cache that lives across turns"
    assert any("no chat template" in i.value for i in at.info)  # random:tiny gets ChatML, and says so
    at.number_input(key="chat_max_new").set_value(6).run()
    at.chat_input(key="chat_input").set_value("hello").run()
    _ok(at)
    at.chat_input(key="chat_input").set_value("and more").run()
    _ok(at)
    conv = at.session_state["chat_conv"]
    t1, t2 = conv.turns
    assert t2.reused_tokens + t2.prefilled_tokens == t2.prompt_tokens and t2.reused_tokens > t1.prompt_tokens
    captions = [c.value for c in at.caption]
    assert any(f"{t2.reused_tokens} reused, {t2.prefilled_tokens} prefilled" in c for c in captions)
    assert any("copy-on-write copies" in c for c in captions)  # the pool's accounting line
    assert {"Tokens per turn", "Time to first token", "Physical pool", "Block tables"} <= set(_titles(at))
    assert [t.value for t in at.text][:2] == ["hello", t1.text]  # user and model text as plain text
    # Check against scratch, then edit the second message: turn 1 is kept whole, turn 2 reuses it all.
    at.button(key="chat_check").click().run()
    _ok(at)
    assert sum("equals a from-scratch generation ✓" in c.value for c in at.caption) == 2
    at.selectbox(key="chat_edit_turn").set_value(1)
    at.text_input(key="chat_edit").set_value("and less")
    at.button(key="chat_edit_go").click().run()
    _ok(at)
    conv = at.session_state["chat_conv"]
    assert [t.user for t in conv.turns] == ["hello", "and less"] and conv.turns[0] is t1
    assert conv.turns[1].reused_tokens >= t2.reused_tokens  # up to the edit: turn 1 and past "and "
    # Then the first message: one turn left, reused up to the edit.
    at.selectbox(key="chat_edit_turn").set_value(0)
    at.text_input(key="chat_edit").set_value("hellO")
    at.button(key="chat_edit_go").click().run()
    _ok(at)
    conv = at.session_state["chat_conv"]
    assert len(conv.turns) == 1 and conv.turns[0].user == "hellO" and 0 < conv.turns[0].reused_tokens
    at.button(key="chat_regen").click().run()
    _ok(at)
    assert len(at.session_state["chat_conv"].turns) == 1
    # Bad input: an empty message says so, and the conversation stays.
    at.chat_input(key="chat_input").set_value("   ").run()
    assert any("empty" in unescape(e.value) for e in at.error)
    assert len(at.session_state["chat_conv"].turns) == 1


def test_chat_one_click_scenario() -> None:
    at = AppTest.from_function(_chat, default_timeout=180)
    at.run()
    # The ChatML prompt is 80 byte tokens: 2.5 blocks of 32, so the samples share a partial block.
    at.selectbox(key="chat_block").set_value(32).run()
    at.button(key="chat_scn_run").click().run()
    _ok(at)
    stages = at.session_state["chat_scn"]
    assert [s["title"] for s in stages] == ["1 · 4 samples", "2 · chat turn 1", "3 · turn 2",
                                            "4 · first message edited"]
    samples = stages[0]["snaps"][-1]["stats"]
    # The scenario runs on the pool the Pool input says (64 blocks; it drew 72 of its own before).
    assert at.number_input(key="chat_blocks").value == 64
    assert {snap["num_blocks"] for st_ in stages for snap in st_["snaps"]} == {64}
    assert any("one pool** of 64 blocks of 32 tokens" in m.value for m in at.markdown)
    assert samples["blocks_shared"] == 2 and samples["cow_copies"] == 3  # 3 samples copy, the 4th writes in place
    last = stages[1]["snaps"][-1]["stats"]
    assert last["prefix_hits"] >= 1  # turn 1 found the samples' prompt blocks by hash
    assert any("reused" in t.value and "prefilled" in t.value for t in at.text)  # stage 4 is shown
    at.radio(key="chat_scn_stage").set_value("2 · chat turn 1").run()
    _ok(at)
    assert any("found by prefix hash" in t.value for t in at.text)
    assert {"Physical pool", "Block tables"} <= set(_titles(at))


def test_chat_shows_an_interrupted_turn_and_goes_on() -> None:
    """A turn cut short (here: its iterator closed after two steps, as a rerun or Stop does) is shown
    labelled with its partial text; the next message continues from the conversation before it."""
    at = AppTest.from_function(_chat, default_timeout=120)
    at.run()
    at.number_input(key="chat_max_new").set_value(6).run()
    at.chat_input(key="chat_input").set_value("hello").run()
    _ok(at)
    conv = at.session_state["chat_conv"]
    it = conv.iter_send("cut me short")
    next(it)
    next(it)
    it.close()
    (cut,) = conv.interrupted
    assert cut.generated_tokens == 2 and len(conv.turns) == 1 and not conv.running
    at.run()
    _ok(at)
    texts = [t.value for t in at.text]
    assert texts[2] == "cut me short" and texts[3].strip() == (cut.text or "(no answer yet)").strip()  # after turn 1
    assert any("Interrupted after 2 generated tokens (stopped before it ended)" in unescape(c.value)
               for c in at.caption)
    at.chat_input(key="chat_input").set_value("and more").run()
    _ok(at)
    conv = at.session_state["chat_conv"]
    assert [t.user for t in conv.turns] == ["hello", "and more"]
    assert [m["content"] for m in conv.messages][::2] == ["hello", "and more"]
    assert conv.turns[1].reused_tokens > conv.turns[0].prompt_tokens  # turn 1 kept whole in the cache
    at.button(key="chat_check").click().run()
    _ok(at)
    assert sum("equals a from-scratch generation ✓" in c.value for c in at.caption) == 2
    assert "cut me short" in [t.value for t in at.text]  # still shown, between the two turns
    # Regenerate clicked twice while answering: the same message interrupted twice shows once.
    first = conv.iter_regenerate()
    next(first)
    second = conv.iter_regenerate()
    next(second)
    second.close()
    assert [i.user for i in conv.interrupted] == ["cut me short", "and more", "and more"]
    at.run()
    _ok(at)
    labels = [unescape(c.value) for c in at.caption if "Interrupted after" in c.value]
    assert len(labels) == 2 and "interrupted 2 times in a row" in labels[1]
    assert [t.value for t in at.text].count("and more") == 2  # the finished turn and the grouped cut


def test_the_default_pool_grows_with_a_hybrid_models_layer_groups() -> None:
    """Gemma 3 270M: the 3 global layers form one group and the 15 sliding layers five groups of
    three, so 6 block tables; a one-kind model has one. 64 blocks per group, at most the widget's 512."""
    from kvviz.engine.kvcache.paged_pool import config_groups
    from kvviz.engine.loading.loader import RANDOM_SHAPES
    from kvviz.engine.models.gemma3 import Gemma3Config
    from kvviz.ui.pages.chat.chat_page import default_pool_blocks

    gemma, tiny = config_groups(Gemma3Config()).count, config_groups(RANDOM_SHAPES["tiny"]).count
    assert (gemma, tiny) == (6, 1)
    assert (default_pool_blocks(gemma), default_pool_blocks(tiny), default_pool_blocks(20)) == (384, 64, 512)


def test_a_setting_never_throws_the_conversation_away() -> None:
    """Issue 37: Max new tokens changed after a turn keeps the turn and its cache (the next turn
    reuses it); another model keeps the transcript, says the cache is rebuilt from it, and the
    rebuild turn reuses nothing; switching back still shows every turn."""
    at = AppTest.from_function(_chat, default_timeout=120)
    at.run()
    at.number_input(key="chat_max_new").set_value(6).run()
    at.chat_input(key="chat_input").set_value("Tell me about the sea.").run()
    _ok(at)
    conv = at.session_state["chat_conv"]
    (t1,) = conv.turns
    assert t1.no_reuse_ttft_ms is not None and t1.no_reuse_ttft_ms > 0  # timed without reuse, on the turn
    assert any(f"(without reuse: {t1.no_reuse_ttft_ms:.0f} ms, measured after it)" in c.value for c in at.caption)
    at.number_input(key="chat_max_new").set_value(7).run()
    _ok(at)
    assert at.session_state["chat_conv"] is conv and conv.turns == [t1] and conv.max_new_tokens == 7
    assert "Tell me about the sea." in [t.value for t in at.text]
    at.chat_input(key="chat_input").set_value("And the sky?").run()
    _ok(at)
    t1, t2 = conv.turns
    assert t2.reused_tokens > t1.prompt_tokens and t2.max_new_tokens == 7  # the cache was kept
    # Another model: the transcript stays, the page says the cache is rebuilt from it.
    at.selectbox(key="model").set_value("random:tiny-gqa").run()
    _ok(at)
    assert at.session_state["chat_conv"] is conv and conv.turns == [t1, t2] and conv.carried == 2
    assert any("The conversation is kept (2 turns)" in unescape(i.value) for i in at.info)
    assert [t.value.strip() for t in at.text][:4] == [x.strip() for x in ("Tell me about the sea.", t1.text,
                                                                          "And the sky?", t2.text)]
    assert sum("computed on an earlier cache" in unescape(c.value) for c in at.caption) == 2
    at.chat_input(key="chat_input").set_value("Now the stars.").run()
    _ok(at)
    t3 = conv.turns[2]
    assert (t3.reused_tokens, t3.prefilled_tokens) == (0, t3.prompt_tokens)  # the rebuild turn, honestly
    assert any(f"{t3.prompt_tokens} prompt tokens: 0 reused, {t3.prompt_tokens} prefilled" in c.value
               for c in at.caption)
    assert not any("The conversation is kept" in unescape(i.value) for i in at.info)
    # Back to the first model: every turn is still there.
    at.selectbox(key="model").set_value("random:tiny").run()
    _ok(at)
    assert [t.user for t in at.session_state["chat_conv"].turns] == ["Tell me about the sea.", "And the sky?",
                                                                      "Now the stars."]
    at.button(key="chat_check").click().run()  # checks the turns this cache computed, none carried
    _ok(at)


def test_a_message_refused_before_its_turn_is_kept_as_typed() -> None:
    """A message the conversation cannot take (here: past the context with the tokens asked for)
    says why, and stays on the page as typed; the conversation goes on."""
    at = AppTest.from_function(_chat, default_timeout=120)
    at.run()
    at.number_input(key="chat_max_new").set_value(6).run()
    at.chat_input(key="chat_input").set_value("hello").run()
    _ok(at)
    long = "x" * 1100  # random:tiny: 1,024 byte tokens of context
    at.chat_input(key="chat_input").set_value(long).run()
    assert any("passes the model's context" in unescape(e.value) for e in at.error)
    assert long in [t.value for t in at.text]
    assert any("Not answered, refused before its turn began" in unescape(c.value) for c in at.caption)
    at.chat_input(key="chat_input").set_value("and more").run()
    _ok(at)
    assert [t.user for t in at.session_state["chat_conv"].turns] == ["hello", "and more"]
    assert long in [t.value for t in at.text]  # still shown, after turn 1
