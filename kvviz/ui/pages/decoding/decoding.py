"""Decoding strategies that move the cache: beam search (rows reordered every step) and speculative
decoding (positions written, then rolled back). One page, a tab each."""
from __future__ import annotations

import itertools
import time
from typing import Any

import pandas as pd
import streamlit as st

from kvviz import LoadedModel
from kvviz.charts import decoding_charts as dc
from kvviz.engine.generation.events import Run
from kvviz.engine.api import iter_generate
from kvviz.engine.generation.valid_request import Beam
from kvviz.errors import KVVizError
from kvviz.measure.spec_bench import PROMPTS, compare_runs
from kvviz.ui.common.figs import show
from kvviz.measure.sizing import pick_tokens
from kvviz.ui.common.busy_notes import acquire_or_warn, busy_note
from kvviz.ui.common.measuring_page import page_model, results_key, where
from kvviz.ui.common.session_probes import estimator
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.settings import Settings
from kvviz.units import fmt_bytes
from kvviz.ui.state import session

INTRO = (
    "Plain decoding only ever appends to the KV cache. Two strategies move it. **Beam search** keeps k "
    "candidate texts at once, one cache row each; every step it picks the k best continuations, and the rows "
    "are copied to follow their parents (a *reorder*). **Speculative decoding** guesses several tokens ahead, "
    "checks them all in one forward pass, keeps the ones the model agrees with, and cuts the cache back to "
    "forget the rest (a *rollback*)."
)
REDRAW_S = 0.3  # the live tree redraws at most about three times a second
_draws = itertools.count()  # every live chart gets a fresh key
# The first is the default. The tab is about the rollback, so it opens on a prompt where prompt lookup
# wins and still guesses wrong: SmolLM2 copying code drafts right where it copies and wrong where it
# writes its own words (tests/ui/test_spec_default_smollm2.py). Copying the paragraph accepts every draft
# and rolls back nothing.
SPEC_PROMPTS = {
    "code_edit": "repeat pasted code with one edit (speculation wins, and rolls back the wrong guesses)",
    "copy_text": "copy a pasted paragraph (the answer repeats the prompt: every draft accepted)",
    "sidebar": "the sidebar's prompt",
    "counting": "count from 1 to 40 (drafts the next numbers)",
    "free_text": "explain why the sky is blue (free text: it should not win)",
}

SPEC_DEFAULTS = {"k": 10, "ngram": 2, "new": 48}  # draft tokens, n-gram, new tokens


def page() -> None:
    got = page_model("Decoding strategies", INTRO)
    if got is None:
        return
    s, model = got
    beam_tab, spec_tab = st.tabs(["Beam search: the cache reordered", "Speculative decoding: the cache rolled back"])
    with beam_tab:
        _beam(s, model)
    with spec_tab:
        _spec(s, model)


def _common(s: Settings) -> dict[str, Any]:
    """The sidebar's prompt, cache and backend; the sampling is the strategy's own (greedy)."""
    kw = s.generate_kwargs()
    return {k: kw[k] for k in ("prompt", "cache", "backend", "chat")}


# --- beam search --------------------------------------------------------------------------------

def _beam(s: Settings, model: LoadedModel) -> None:
    st.caption("Beam search here is transformers' `generate(num_beams=k, do_sample=False)`: the same beams and "
               "scores (tested). It is deterministic, whatever the sidebar's sampling says; the prompt, cache and "
               f"engine come from the sidebar. {where(model)}")
    with st.container(horizontal=True, vertical_alignment="bottom"):
        k = int(st.number_input("Beams k", 2, 8, 3, key="beam_k", width=120))
        lp = float(st.number_input("Length penalty", -3.0, 3.0, 1.0, 0.5, key="beam_lp", width=140,
                                   help="A finished beam scores sum(log p) / length ** penalty: > 0 favours "
                                        "longer beams, < 0 shorter ones"))
        es = st.selectbox("Early stopping", ["false", "true", "never"], key="beam_es", width=140,
                          help="true: stop once k beams have finished. false: stop when the best running beam, "
                               "at its current length, cannot beat the worst finished one. never: as false, but "
                               "assume it could reach the maximum length")
        nrs = int(st.number_input("Beams returned", 1, 8, min(3, k), key="beam_nrs", width=140))
        n = int(st.number_input("New tokens", 1, 48, 12, key="beam_new", width=120))
        run_it = st.button("Run beam search", key="beam_run", type="primary")
    store_key = results_key("beam_result", model)
    if run_it:
        _run_beams(s, model, dict(strategy=Beam(k, length_penalty=lp, early_stopping=es,
                                                num_return_sequences=min(nrs, k)), max_new_tokens=n), store_key)
    run: Run | None = session.get(store_key)
    if run is None or run.beams is None:
        st.info("Press **Run beam search** to grow the beam tree from the sidebar's prompt.")
        return
    _beam_results(run, model.config.vocab_size)


def _run_beams(s: Settings, model: LoadedModel, opts: dict[str, Any], store_key: str) -> None:
    try:
        stream = iter_generate(model, **_common(s), **opts)  # greedy: the default sampling
    except KVVizError as e:
        st.error(md_plain(e))
        return
    slot = st.empty()
    last = 0.0
    for _ in stream:
        now = time.monotonic()
        if now - last >= REDRAW_S:
            show(slot, dc.beam_tree(stream.steps, "The beam tree, growing", model.config.vocab_size),
                 key=f"beam_live_{next(_draws)}")
            last = now
    slot.empty()
    session.put(store_key, stream.run)


def _beam_results(run: Run, vocab: int) -> None:
    b = run.beams
    assert b is not None
    cols = st.columns(4)
    cols[0].metric("Beams k", b.num_beams)
    cols[1].metric("Steps", len(b.steps))
    cols[2].metric("Bytes moved by reorders", fmt_bytes(b.bytes_moved))
    last = run.events[-1] if len(run.events) else None
    cols[3].metric("KV cache at the end (k rows)", fmt_bytes(last.cache_bytes_used) if last else "n/a")
    st.dataframe(pd.DataFrame({"beam": range(len(b.texts)), "score": [round(x, 4) for x in b.scores],
                               "tokens": [len(q) for q in b.sequences], "text": list(b.texts)}),
                 hide_index=True, key="beam_table")
    show(st, dc.beam_tree(b.steps, vocab=vocab), key="beam_tree")
    st.subheader("The reorder: which row was copied where")
    step = st.slider("Step", 0, max(0, len(b.steps) - 1), 0, key="beam_step",
                     help="Step 0 fans the prompt's one cache row out to k rows") if len(b.steps) > 1 else 0
    left, right = st.columns(2)
    show(left, dc.reorder_figure(b.steps[step], b.num_beams), key=f"beam_reorder_{step}")
    show(right, dc.bytes_moved_chart(b.steps), key="beam_bytes")


# --- speculative decoding ------------------------------------------------------------------------

def _spec(s: Settings, model: LoadedModel) -> None:
    st.caption("Drafts come from the context itself (prompt lookup: the tokens that followed an earlier match of "
               "the last n tokens). One forward checks them all through the cache; the model keeps the agreeing "
               "prefix plus its own next token, and the cache is truncated back. Greedy, so the text is the same "
               "as plain greedy decoding (tested). Timed with EOS ignored so every run generates its N tokens. "
               f"{where(model)}")
    with st.container(horizontal=True, vertical_alignment="bottom"):
        which = st.selectbox("Prompt", list(SPEC_PROMPTS), format_func=SPEC_PROMPTS.get, key="spec_prompt",
                             width=380)
        k = int(st.number_input("Draft tokens", 1, 32, SPEC_DEFAULTS["k"], key="spec_k", width=130))
        ngram = int(st.number_input("n-gram", 1, 8, SPEC_DEFAULTS["ngram"], key="spec_ngram", width=110))
        n = int(st.number_input("New tokens", 2, 256, _spec_tokens(s, model, which), key="spec_new", width=120,
                                help="The default is what finishes in about a minute here (at most 48)"))
        repeats = int(st.number_input("Timed runs", 1, 9, 1, key="spec_repeats", width=120,
                                      help="Each of plain and speculative runs this many times after a warm-up; "
                                           "the speedup compares medians"))
        run_it = st.button("Run and time both", key="spec_run", type="primary")
    busy_note(short=True)
    store_key = results_key("spec_result", model)
    if run_it:
        _run_spec(s, model, which, k, ngram, n, repeats, store_key)
    got = session.get(store_key)
    if got is None:
        st.info("Press **Run and time both**: plain greedy and speculative decoding on the same prompt, "
                "then the notebook of what each verify forward wrote and rolled back.")
        return
    _spec_results(*got)


def _spec_tokens(s: Settings, model: LoadedModel, which: str) -> int:
    """The default new tokens: SPEC_DEFAULTS' when the comparison (a warm-up and a timed run of each)
    finishes in about a minute here at the load now, else the most that do (at least 16)."""
    est = estimator(model, s.engine == "fast")
    prompt = s.prompt if which == "sidebar" else PROMPTS[which]
    n_prompt = len(model.tokenizer.encode(prompt)) if model.has_tokenizer else 0
    if est is None or not n_prompt:
        return SPEC_DEFAULTS["new"]
    return pick_tokens(lambda n: est.spec_s(n_prompt, n, 1), SPEC_DEFAULTS["new"])


def _run_spec(s: Settings, model: LoadedModel, which: str, k: int, ngram: int, n: int, repeats: int,
              store_key: str) -> None:
    prompt = s.prompt if which == "sidebar" else PROMPTS[which]
    chat = s.chat if which == "sidebar" else bool(getattr(model.tokenizer, "chat_template", None))
    est = estimator(model, s.engine == "fast")  # before the lock: calibrating (once) takes it itself
    n_prompt = len(model.tokenizer.encode(prompt)) if model.has_tokenizer else 0
    cost = f" ({est.here(est.spec_s(n_prompt, n, repeats))})" if est is not None and n_prompt else ""
    lock = acquire_or_warn()
    if lock is None:
        return
    try:
        with st.spinner(f"Timing plain and speculative greedy, {repeats + 1} runs each{cost}…"):
            # Timing: EOS ignored, so both generate all n tokens and tokens/s compare like with like.
            cmp, plain, spec = compare_runs(model, prompt, n, repeats, k, ngram, chat, ignore_eos=True)
    except KVVizError as e:
        st.error(md_plain(e))
        return
    finally:
        lock.release()
    session.put(store_key, (cmp, plain, spec))


def _spec_results(cmp: Any, plain: Run, spec: Run) -> None:
    sp = spec.speculation
    assert sp is not None
    cols = st.columns(5)
    rate = "n/a" if sp.acceptance_rate is None else f"{sp.acceptance_rate:.0%}"
    cols[0].metric("Acceptance", rate, help=f"{sp.accepted} of {sp.drafted} drafted tokens")
    cols[1].metric("Forward passes", sp.forwards,
                   help=f"for {sp.tokens} tokens: the prefill and one verify forward per step; plain decoding "
                        "needs one per token")
    cols[2].metric("Forwards saved", sp.forwards_saved)
    cols[3].metric("Speedup (wall clock)", f"x{cmp.speedup:.2f}",
                   help=f"median of {len(cmp.plain_s)}: plain {cmp.tokens / _median(cmp.plain_s):.1f} tok/s, "
                        f"speculative {cmp.tokens / _median(cmp.spec_s):.1f} tok/s")
    cols[4].metric("Positions rolled back", sum(len(x.rolled_back) for x in sp.steps))
    if cmp.same_tokens:
        st.success(f"Identical output: plain greedy and speculative decoding produced the same {cmp.tokens} tokens.")
    else:
        st.warning("The outputs differ: a near-tie that a batched forward rounded differently from a one-row one.")
    if cmp.speedup < 1.0:
        st.caption(f"Speculation lost here: {rate} of drafts accepted, and each verify forward fed "
                   f"{sum(len(x.drafted) + 1 for x in sp.steps[1:]) / max(1, sp.forwards - 1):.1f} tokens on "
                   "average for the tokens it produced. Wrong drafts cost compute and give nothing back.")
    left, right = st.columns([3, 2])
    show(left, dc.spec_notebook(sp.steps, len(spec.prompt_ids)), key="spec_notebook")
    show(right, dc.acceptance_chart(sp.steps), key="spec_accept")
    st.code(spec.text, language=None, wrap_lines=True)


def _median(xs: Any) -> float:
    from statistics import median

    return float(median(xs))
