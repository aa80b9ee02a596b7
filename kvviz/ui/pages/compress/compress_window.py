"""The compression lab's window tabs: a sliding window with StreamingLLM sinks, run live, and
perplexity by position (a shipped measurement, or a short one on demand)."""
from __future__ import annotations

import json
from typing import Any

import pandas as pd
import streamlit as st

from kvviz import LoadedModel
from kvviz.charts import compress_charts as cc
from kvviz.charts.tokens import plotly_text
from kvviz.engine.api import iter_generate
from kvviz.engine.generation.valid_request import CacheSpec
from kvviz.engine.generation.kv_spec import position_rules, rotates_keys
from kvviz.engine.loading.loader import ASSETS
from kvviz.errors import KVVizError
from kvviz.measure.kv_curves import measure
from kvviz.safeio import read_bounded
from kvviz.ui.common.figs import show
from kvviz.ui.common.busy_notes import acquire_or_warn
from kvviz.ui.common.measuring_page import results_key, where
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.settings import Settings
from kvviz.units import fmt_bytes
from kvviz.ui.state import session

CURVES_FILE = ASSETS / "kv_curves_smollm2.json"
POSITIONS_HELP = (
    "RoPE scores depend only on the distance between a query and a key. **Within the cache** (StreamingLLM): "
    "the held rows are renumbered 0..S+W-1, so the sinks sit just before the window; the window's distances are "
    "unchanged and only the sink keys are rotated forward by the number of evicted positions. **Original**: "
    "every key keeps its position, so the sinks drift ever further behind the query.")
GPT2_NOTE = (
    "This is a GPT-2-family model: it adds a learned position embedding to each token at the input, so every "
    "cached K/V row already carries its position, mixed into its values by the layers. The cache cannot "
    "renumber positions the way StreamingLLM does with RoPE (where a position is a rotation applied to K "
    "afterwards), so the window here keeps the original positions. Choose a Llama model (SmolLM2) or "
    "Gemma 3 for StreamingLLM's positions.")


STORY = "Once upon a time, there was a little"
PROMPTS = {"story": f"a story: \u201c{STORY}\u201d", "sidebar": "the sidebar's prompt"}


def prompt_choice(key: str) -> str:
    """Which prompt a comparison runs: a story (long greedy text, where caches part ways) or the sidebar's."""
    return str(st.selectbox("Prompt", list(PROMPTS), format_func=PROMPTS.get, key=key, width=360))


def prompt_kwargs(s: Settings, which: str) -> dict[str, Any]:
    return {"prompt": STORY, "chat": False} if which == "story" else {"prompt": s.prompt, "chat": s.chat}


def window_tab(s: Settings, model: LoadedModel) -> None:
    family = getattr(model.config, "model_type", "gpt2")
    rope = rotates_keys(family)
    st.caption("A ring buffer of the last W positions, plus S sink positions kept forever (StreamingLLM: the first "
               "tokens soak up attention that has nowhere else to go; evict them and the model falls apart). "
               f"The same prompt with the full cache beside it. {where(model)}")
    if not rope:
        st.info(GPT2_NOTE)
    kinds = getattr(model.config, "layer_types", None)
    if kinds:  # Gemma 3: the window cache's rows on every layer, its own window on the sliding ones
        st.caption(f"{sum(k == 'sliding' for k in kinds)} of this model's {len(kinds)} layers slide their own "
                   f"window of {model.config.sliding_window} positions: there the held rows further back than "
                   "that (by the positions chosen below) stay masked; the others see all S + W.")
    block = model.config.block_size
    with st.container(horizontal=True, vertical_alignment="bottom"):
        w = int(st.number_input("Window W", 2, block, min(32, block), key="kvw_window", width=130))
        sk = int(st.number_input("Sinks S", 0, 64, 4, key="kvw_sinks", width=110))
        pos = st.selectbox("Positions", position_rules(family), key="kvw_pos", width=150,
                           format_func=lambda p: {"cache": "within the cache", "original": "original"}[p],
                           help=POSITIONS_HELP)
        n = int(st.number_input("New tokens", 4, 512, 64, key="kvw_new", width=120))
        which = prompt_choice("kvw_prompt")
        run_it = st.button("Generate through the window", key="kvw_run", type="primary")
    key = results_key("kvw_result", model)
    if run_it:
        _run_window(s, model, w, sk, pos, n, key, which)
    got = session.get(key)
    if got is None:
        st.info("Press **Generate through the window**: the prompt runs past the window and the notebook shows "
                "which positions are sinks, kept and evicted at every step.")
        return
    _window_results(got)


def _run_window(s: Settings, model: LoadedModel, w: int, sk: int, pos: str, n: int, key: str, which: str) -> None:
    lock = acquire_or_warn()
    if lock is None:
        return
    runs = []
    try:
        with st.spinner("Generating with the full cache and through the window…"):
            for cache in (CacheSpec(), CacheSpec(window=w, sinks=sk, positions=pos)):
                stream = iter_generate(model, max_new_tokens=n, backend=s.engine, cache=cache,
                                       **prompt_kwargs(s, which))
                for _ in stream:
                    pass
                runs.append(stream.run)
    except KVVizError as e:
        st.error(md_plain(e))
        return
    finally:
        lock.release()
    session.put(key, (runs[0], runs[1], w, sk))


def _window_results(got: tuple[Any, Any, int, int]) -> None:
    full, win, w, sk = got
    n_prompt = len(win.prompt_ids)
    d = cc.first_divergence(full.generated_ids, win.generated_ids)
    last = win.events[-1]
    cols = st.columns(4)
    cols[0].metric("Positions held", last.cache_len, help=f"at most S + W = {sk + w}")
    cols[1].metric("Cache bytes", fmt_bytes(last.cache_bytes_used))
    cols[2].metric("Full cache bytes", fmt_bytes(full.events[-1].cache_bytes_used))
    cols[3].metric("Same text as the full cache", "all of it" if d is None else f"{d} tokens")
    if n_prompt + len(win.events) <= sk + w:
        st.caption("The whole sequence fits in the window: nothing was evicted, and the text is the full cache's "
                   "exactly. Generate more tokens, or shrink the window, to see evictions.")
    show(st, cc.token_comparison([("full cache", full.generated_ids, [e.token_text for e in full.events]),
                                  (win.cache_kind, win.generated_ids, [e.token_text for e in win.events])],
                                 "Where the window leaves the full cache", "the full cache"), key="kvw_tokens")
    left, right = st.columns(2)
    left.code(full.text, language=None, wrap_lines=True)
    right.code(win.text, language=None, wrap_lines=True)
    show(st, cc.window_notebook(sk, w, n_prompt, len(win.events)), key="kvw_notebook")
    step = st.slider("Ring after step", 0, len(win.events) - 1, len(win.events) - 1, key="kvw_step")
    show(st, cc.ring_slots(sk, w, n_prompt + step), key=f"kvw_ring_{step}")


def _shipped() -> dict[str, Any] | None:
    if not CURVES_FILE.is_file():
        return None
    try:
        return json.loads(read_bounded(CURVES_FILE, 5_000_000, "the shipped curves").decode("utf-8"))
    except (KVVizError, ValueError):
        return None


def curves_tab(model: LoadedModel) -> None:
    st.caption("Teacher forcing over held-out text (the tail of Tiny Shakespeare): every position's prediction "
               "reads the cache as it stands, one token at a time once the window is full. StreamingLLM found "
               "that a plain window's perplexity shoots up once the first tokens are evicted, and that keeping "
               "4 sink tokens avoids it.")
    shipped = _shipped()
    if shipped is not None:
        _curves(shipped, "kvc_shipped", f"Measured with `python -m kvviz kv-curves` on {shipped['model']}")
    with st.container(horizontal=True, vertical_alignment="bottom"):
        tokens = int(st.number_input("Tokens", 32, min(1024, model.config.block_size),
                                     min(256, model.config.block_size), key="kvc_tokens", width=120))
        w = int(st.number_input("Window", 4, 512, 32, key="kvc_window", width=120))
        sk = int(st.number_input("Sinks", 0, 16, 4, key="kvc_sinks", width=110))
        run_it = st.button("Measure on this model", key="kvc_run",
                           help="One token per forward once the window is full: minutes on SmolLM2 for 1,000 tokens")
    key = results_key("kvc_result", model)
    if run_it:
        lock = acquire_or_warn()
        if lock is not None:
            try:
                with st.spinner(f"Teacher-forcing {tokens} tokens through each cache…"):
                    session.put(key, measure(model, tokens, w, sk, bins=8, dtypes=("int8", "int4")))
            except KVVizError as e:
                st.error(md_plain(e))
            finally:
                lock.release()
    got = session.get(key)
    if got is not None:
        _curves(got, "kvc_live", f"Measured now on {model.name}")


def _curves(res: dict[str, Any], key: str, label: str) -> None:
    sub = (f"{res['tokens']} tokens of {res['text']} · window {res['window']}, {res['sinks']} sinks · "
           "perplexity per bin of positions")
    # a Plotly title, not Markdown: escaped for Plotly's HTML-like labels (a folder name is plain text)
    show(st, cc.perplexity_curves(res["by_position"], f"Perplexity by position: {plotly_text(res['model'])}", sub,
                                  res["window"], res["sinks"]), key=f"{key}_fig")
    st.caption(f"{label}. Perplexity over every position: {md_plain(cc.curves_finding(res['perplexity']))}. "
               "The two sink curves differ only in how positions are numbered once rows are evicted: within its "
               "trained context SmolLM2 reads the original (larger) distances to the sinks about as well as "
               "StreamingLLM's renumbered ones; renumbering is what lets a model run past its trained context.")
    ppl = pd.DataFrame([{"cache": k, "perplexity (all positions)": round(v, 3)} for k, v in res["perplexity"].items()])
    # one above the other: side by side, each table's last columns were cut off
    st.dataframe(ppl, hide_index=True, key=f"{key}_ppl")
    st.caption("Each KV dtype, teacher-forced through the cache beside full precision on the same tokens")
    st.dataframe(pd.DataFrame(cc.dtype_table(res["kv_dtypes"])), hide_index=True, key=f"{key}_dtypes")
