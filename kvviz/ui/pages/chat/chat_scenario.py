"""The Chat page's one-click scenario, on one paged pool:

1. 4 parallel samples from one prompt: the prompt is prefilled once and its blocks shared (ref 4);
   the shared partial block is copied on the first write of each sample (copy-on-write);
2. a chat turn with the same prompt: its full blocks, released by the samples, are found by hash;
3. a second turn: the whole conversation so far is reused;
4. the first message edited: the cache is kept up to the first changed token, the rest recomputed.

Generations are short (24 new tokens) so the whole scenario stays quick on a 2-core CPU.
"""
from __future__ import annotations

import time
from typing import Any

import streamlit as st

from kvviz.charts import paged_charts as pc
from kvviz.engine.generation.valid_request import CacheSpec
from kvviz.engine.tokenize.chat_template import chat_prompt
from kvviz.engine.sessions.conversation import Conversation
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.kvcache.paged_cache import PagedPool
from kvviz.engine.sessions.parallel_samples import ParallelSamples
from kvviz.errors import KVVizError
from kvviz.ui.pages.chat import chat_views
from kvviz.ui.common.figs import show
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.state import session

Q1 = "What is the capital of France?"
Q2 = "And of Italy?"
Q1_EDITED = "What is the capital of Germany?"  # Berlin; asked about Spain, SmolLM2 said "El Salvador"
SAMPLES, NEW_TOKENS = 4, 24
LIVE_EVERY = 4  # redraw the live pool every this many steps


def section(model: LoadedModel, fast: bool, block: int, blocks: int) -> None:
    st.markdown(
        f"One click runs four stages on **one pool** of {blocks} blocks of {block} tokens (the Pool and Block "
        f"size inputs above): **{SAMPLES} parallel samples** from "
        f"one prompt (shared prompt blocks, copy-on-write where they diverge), a **chat turn** with that prompt "
        f"(its blocks found again by hash), a **second turn** that reuses the whole conversation, and the **first "
        f"message edited**, which keeps the cache only up to the first changed token. Each generation stops "
        f"after {NEW_TOKENS} tokens.")
    if st.button("Run the scenario", key="chat_scn_run", type="primary"):
        live = st.empty()
        try:
            session.put(session.CHAT_SCENARIO, _run(model, fast, block, blocks, live))
        except KVVizError as e:
            st.error(md_plain(e))
        live.empty()
    stages: list[dict[str, Any]] | None = session.get(session.CHAT_SCENARIO)
    if not stages:
        return
    titles = [s["title"] for s in stages]
    pick = st.radio("Stage", titles, horizontal=True, key="chat_scn_stage", index=len(titles) - 1)
    stage = stages[titles.index(pick)] if pick in titles else stages[-1]
    for line in stage["lines"]:
        st.text(line)
    if stage.get("turn") is not None:
        chat_views.chips(model.tokenizer, stage["turn"])
    chat_views.pool_views(stage["snaps"], key=f"chat_scn_{titles.index(pick)}", names=stage["names"])
    with st.container(key="chat_scn_done"):
        st.caption(f"Scenario done in {stages[0]['total_s']:.1f} s (model load not counted).")


def _run(model: LoadedModel, fast: bool, block: int, blocks: int, live: Any) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    prompt = list(chat_prompt(model.tokenizer, [{"role": "user", "content": Q1}]).ids)  # as turn 1 renders it
    # The pool the Pool input sets (it said 64 while the scenario drew 72): too small a pool stops with
    # the engine's own "the KV pool is full" message, shown as an error.
    pool = PagedPool(model.config, blocks, block, model.device, model.dtype)
    conv = Conversation(model, cache=CacheSpec(kind="paged", block_size=block), max_new_tokens=NEW_TOKENS,
                        backend="fast" if fast else "readable", pool=pool)
    conv.warm_up()
    stages: list[dict[str, Any]] = []

    # 1. parallel samples
    ps = ParallelSamples(model, prompt, n=SAMPLES, max_new_tokens=NEW_TOKENS, temperature=0.8, seed=0,
                         kv_block_size=block, pool=pool, fast=fast)
    snaps = []
    for i, snap in enumerate(ps):
        snaps.append(snap)
        if i % LIVE_EVERY == 0:
            with live.container():
                st.caption(f"Stage 1: {SAMPLES} samples, step {i + 1} of {NEW_TOKENS}")
                show(st, pc.pool_grid(snap, [f"sample {r}" for r in range(SAMPLES)]), key=f"chat_scn_live_{i}")
    st_ = snaps[-1]["stats"]
    tok = model.tokenizer
    lines = [f"{len(prompt)} prompt tokens prefilled once and shared by {SAMPLES} samples "
             f"(reorder copied {ps.reorder_bytes} bytes); copy-on-write copies: {st_['cow_copies']}; "
             f"blocks shared at the end: {st_['blocks_shared']}, saving {st_['bytes_saved_by_sharing']:,} bytes."]
    if len(prompt) % block == 0:
        lines.append(f"The prompt fills whole blocks ({len(prompt)} tokens, blocks of {block}), so every sample "
                     "starts a new block: nothing to copy. Another block size shows copy-on-write.")
    eos = tok.eos_token_id
    for r, row in enumerate(ps.rows):  # the batch runs every row to the end; each answer ends at its EOS
        end = row.index(eos) if eos in row else len(row)
        lines.append(f"sample {r}: {tok.decode(row[:end])!r}" + (" (then EOS)" if end < len(row) else ""))
    stages.append(dict(title="1 · 4 samples", lines=lines, snaps=snaps, names=[f"sample {r}" for r in range(SAMPLES)]))
    assert ps.cache is not None
    ps.cache.reset()  # the samples end: full blocks stay cached for a prefix hit, partial ones are freed

    # 2-4. the chat
    for title, action in (("2 · chat turn 1", lambda: conv.send(Q1)), ("3 · turn 2", lambda: conv.send(Q2)),
                          ("4 · first message edited", lambda: conv.edit(0, Q1_EDITED))):
        with live.container():
            st.caption(f"Stage {title}…")
        t = action()
        lines = [f"{t.user!r} → {t.text!r}", chat_views.turn_line(t)]
        stages.append(dict(title=title, lines=lines, snaps=list(t.snapshots), names=["conversation"], turn=t))
    stages[0]["total_s"] = time.perf_counter() - t0
    return stages
