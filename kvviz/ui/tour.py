"""The guided tour: eight steps on the Generate page (nine on a model with sliding and global layers),
each a short text and the live view it points at.

For someone who has never heard of a KV cache. The picture it builds: the model is a typewriter
that types one token at a time, and before each keystroke it must look back over everything
typed so far. The KV cache is its notebook: for every token typed it writes down two short notes
(a key and a value) once, and looks back at the notes instead of re-reading the page. Every term
is defined where it first appears (token, Q/K/V, causal, prefill, TTFT, decode, TPOT, vector
length, attention head, GQA, roofline, compute-bound, memory-bound).

The step lives in session state (``STEP_KEY``; 0 = off) and in the URL (``?tour=N``), so a link
opens the tour at a step. A step may offer one action, which the page performs as if its own
button had been pressed (``"generate"``, ``"step"``), or a settings change (``"no_cache"``,
``"cache"``). The view a step points at is outlined (the keyed containers of ``view.layout``).
"""
from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from kvviz import LoadedModel
from kvviz.units import dtype_bytes, fmt_bytes, kv_bytes_per_token
from kvviz.ui.state import session

STEP_KEY = session.TOUR_STEP
PARAM = "tour"
BIG_MODEL = "llama-2-70b"  # step 7's comparison: a preset of the calculator
BIG_CONTEXT = 4096
LAST_PAGE_KEY = session.TOUR_LAST_PAGE  # the page of the previous script run
# The calculator's settings for step 7's example (its widget keys, kvviz/ui/pages/calculator/calculator_links.py).
CALC_EXAMPLE = {"mem_source": "preset", "mem_preset": BIG_MODEL, "mem_seq_len": BIG_CONTEXT, "mem_dtype": "fp16"}


@dataclass(frozen=True)
class TourStep:
    title: str
    text: str  # Markdown, numbers only (no user text)
    points_at: tuple[str, ...]  # keys of the containers to outline
    action: str | None = None  # "generate" | "step" | "no_cache" | "cache"
    action_label: str = ""
    link: str | None = None  # "race" | "calculator": a page to open next
    scroll_to: str | None = None  # the container a step calls "the chart below": scrolled into view


def _big_model_line() -> str:
    """The calculator's answer for a 70B model at a long context (pure Python, kvviz.calculator)."""
    try:
        from kvviz.calculator import MemoryRequest, calculate, find_preset, load_presets

        spec = find_preset(BIG_MODEL, load_presets())
        res = calculate(spec, MemoryRequest(seq_len=BIG_CONTEXT, kv_dtype="fp16"))
    except Exception:  # noqa: BLE001 - a missing presets file must not break the tour
        return ""
    weights = f", beside {fmt_bytes(res.weights_bytes)} of weights" if res.weights_bytes else ""
    return (f" The calculator's answer for **{spec.name}** ({spec.n_layers} layers, {spec.n_kv_heads} K/V heads of "
            f"{spec.head_dim} numbers, fp16): **{fmt_bytes(res.kv_bytes_per_token)} per token**, so "
            f"**{fmt_bytes(res.kv_bytes)}** for one {BIG_CONTEXT:,}-token conversation{weights}. Thirty-two such "
            f"conversations at once need {fmt_bytes(32 * res.kv_bytes)} of cache: on a GPU, memory, not arithmetic, "
            "limits how many users it serves at once.")


MAX_STEPS = 9  # eight for every model, and a ninth on a model with sliding and global layers


def hybrid_step(model: LoadedModel | None, dtype: str = "fp32") -> TourStep | None:
    """Step 9 on a model that mixes sliding-window and global layers (Gemma 3), with its own
    numbers: what each kind keeps, and the cache at its full context against all-global layers."""
    c = model.config if model is not None else None
    kinds = tuple(getattr(c, "layer_types", ()) or ())
    window = getattr(c, "sliding_window", None)
    if c is None or len(set(kinds)) < 2 or not window:
        return None
    sliding = [i for i, k in enumerate(kinds) if k == "sliding"]
    full = [i for i, k in enumerate(kinds) if k != "sliding"]
    per_layer = kv_bytes_per_token(1, c.kv_heads, c.head_dim, dtype_bytes(dtype))  # one layer, one token
    ctx = int(getattr(c, "context_length", None) or c.block_size)
    hybrid = per_layer * (len(full) * ctx + len(sliding) * min(window, ctx))
    every = per_layer * len(kinds) * ctx
    where = ", ".join(str(i) for i in full)
    return TourStep(
        "Hybrid attention: sliding and global layers",
        f"This model mixes two kinds of layer. **{len(sliding)} of its {len(kinds)} layers are sliding**: a token "
        f"there attends only to the last **{window:,}** tokens (itself included), so their cache stops growing at "
        f"{window:,} tokens: it is a ring, and each new token's K and V overwrite the oldest. The other "
        f"**{len(full)} (layers {where}) are global**: they attend to every token and keep them all. The strip "
        "under the numbers shows the bytes each layer holds: once the text passes the window the sliding bars "
        f"level off while the global ones keep growing. At its full context of {ctx:,} tokens this cache takes "
        f"**{fmt_bytes(hybrid)}**; if every layer were global it would take **{fmt_bytes(every)}** "
        f"({every / hybrid:.1f}× more). It has **{c.kv_heads} K/V head{'s' if c.kv_heads != 1 else ''}** for "
        f"{c.n_head} query heads" + (" (MQA: every query head reads the same K and V)." if c.kv_heads == 1 else
                                    " (GQA)."),
        ("view_metrics",), "generate", "Generate")


def steps(model: LoadedModel | None, dtype: str = "fp32") -> list[TourStep]:
    """The eight steps (nine on a hybrid-attention model), with this model's own numbers where a
    step quotes them."""
    hybrid = hybrid_step(model, dtype)
    return _base_steps(model, dtype) + ([hybrid] if hybrid else [])


def _base_steps(model: LoadedModel | None, dtype: str = "fp32") -> list[TourStep]:
    c = model.config if model is not None else None
    layers, heads = (c.n_layer, c.n_head) if c else (4, 4)
    kv_heads, head_dim = (c.kv_heads, c.head_dim) if c else (4, 64)
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes(dtype))
    byte_level = model is not None and getattr(model.tokenizer, "vocab_size", 0) <= 260
    what_tokens = ("This model's tokens are single bytes: a letter, a space, a comma." if byte_level else
                   "This model's tokens are pieces of words from a vocabulary of tens of thousands.")
    gqa_here = (f" This model uses GQA: its {heads} query heads share {kv_heads} K/V heads, so its cache holds "
                f"{kv_heads} heads per layer, not {heads}." if c and kv_heads < heads else
                f" This model has one K/V head per query head ({heads} of each).")
    return [
        TourStep(
            "What a token is",
            "A language model does not read letters or words: it reads **tokens**, numbered pieces of text from a "
            f"fixed vocabulary. {what_tokens} Each chip is one token: blue ones are your prompt, orange ones the "
            "model typed. Like a typewriter, it types **one token per step**, each time choosing the next token "
            "from everything typed so far. Press **Generate** to watch it.",
            ("output",), "generate", "Generate"),
        TourStep(
            "Q, K and V, and why they never change",
            "In every layer, each token's vector becomes three: a **query** Q (what am I looking for?), a **key** K "
            "(what do I hold? a label others can match) and a **value** V (what I pass on if chosen). The newest "
            "token compares its Q with the K of every earlier token and mixes their Vs by how well they match: that "
            "is **attention**. It is **causal**: a token only looks back, never ahead, so a token's K and V depend "
            "on the tokens before it alone. Once written they **never change**. That is the whole reason a cache "
            "works: the model writes each token's K and V in a notebook, the **KV cache**, once, and reads them "
            "back at every later step instead of recomputing them. The chart below is that notebook: one column "
            "per token, K on top, V below, one row per layer; the colour is each vector's **length** (its L2 norm: "
            "the square root of the sum of its squared numbers), just to show that something is written there.",
            ("view_notebook",), scroll_to="view_notebook"),
        TourStep(
            "Prefill: the whole prompt at once",
            "Press **Step** once (or the S key). The first step is the **prefill**: the whole prompt goes through "
            "the model in one forward pass, and every prompt token's K and V are written at once: all the prompt's "
            "columns appear together, outlined in red. Its time is the **TTFT**, *time to first token*: what a user "
            "waits before anything appears. It grows with the prompt's length.",
            ("view_notebook", "view_metrics"), "step", "Step once"),
        TourStep(
            "Decode: one column per step",
            "Press **Step** five more times. Each **decode** step feeds only the newest token: the model computes "
            "its Q, K and V, writes **one new column**, and reads all the old ones untouched. The time of one "
            "decode step is the **TPOT**, *time per output token*; tokens per second is 1000 / TPOT in ms. With "
            "a cache it barely grows as the text gets longer.",
            ("view_notebook", "view_metrics"), "step", "Step"),
        TourStep(
            "The same without a cache",
            "Switch to **no cache** (the button does it), then Step a few times. Now every step re-runs the model "
            "over the whole text: every column is recomputed (all outlined in red) and none is kept. The text is "
            "identical (the same K and V come out every time) but each step's work grows with the text: the FLOPs "
            "tile counts it.",
            ("view_notebook", "view_metrics"), "no_cache", "Switch to no cache and step"),
        TourStep(
            "Attention over the cache",
            "The heatmap shows where the newest token looks: one column per token in the cache, darker = more "
            "weight, each row adding up to 1. Each layer has several **attention heads**, each with its own Q, K "
            "and V, each looking for something different, so there is a row per layer and head; the bars show one "
            "head. Every decode step reads every cached K and V like this, so the cache is read in full at every "
            "step. **GQA** (grouped-query attention, used by Llama-family models such as SmolLM2) lets several query "
            "heads share one K/V head, so the cache stores fewer K/V heads: fewer bytes to keep and to read." + gqa_here,
            ("view_attention",), "cache", "Static cache again, and generate", scroll_to="view_attention"),
        TourStep(
            "Memory: what the notebook costs",
            "Under the numbers, the formula with this run's values: **2 (K and V) × layers × K/V heads × numbers "
            f"per head × bytes per number × tokens**. For this model that is {layers} × {kv_heads} × {head_dim} × "
            f"2 × {dtype_bytes(dtype)} B = **{fmt_bytes(per_token)} per token**." + _big_model_line()
            + " The calculator sizes any model.",
            ("view_metrics",), link="calculator"),
        TourStep(
            "Speed: the race",
            "The race generates the same text three times (static cache, growing cache, no cache) and times every "
            "step: with a cache a step costs about the same at token 500 as at token 5; without one it grows with "
            "the text. Why the measured speedup is smaller than the FLOP ratio is the **roofline**: a chart of the "
            "most arithmetic this machine can do per second against how many operations each byte read from "
            "memory feeds. A phase is **compute-bound** when arithmetic is its limit (the prefill: every weight "
            "read serves the whole prompt) and **memory-bound** when reading bytes is (a decode step: all the "
            "weights and the cache read again for one token). The Prefill vs decode page measures both on this "
            "machine. Here, the numbers give this run's TTFT and TPOT, and the time-per-step chart (under the "
            "attention map) every step's.",
            ("view_metrics", "view_latency"), link="race"),
    ]


# --- state -----------------------------------------------------------------------------------------

def current() -> int:
    """The tour's step (1-based), or 0 when off; ``?tour=N`` in the URL starts it at step N."""
    raw = st.query_params.get(PARAM)
    if raw is not None and not session.has(session.TOUR_URL_READ):
        session.put(session.TOUR_URL_READ, True)
        try:
            session.put(STEP_KEY, min(max(int(raw), 1), MAX_STEPS))
        except ValueError:
            pass
    return int(session.get(STEP_KEY, 0))


def go(n: int) -> None:
    """Button callback: move to step n (0 ends the tour); the URL follows."""
    session.put(STEP_KEY, n)
    if n:
        st.query_params[PARAM] = str(n)
    elif PARAM in st.query_params:
        del st.query_params[PARAM]


def _set_cache(mode: str) -> None:
    session.put("cache_mode", mode)
    from kvviz.ui.state import persist

    persist.remember("cache_mode")


SCROLLED_KEY = session.TOUR_SCROLLED  # the step whose chart was last scrolled into view


def scroll_js(key: str, arrival: int = 0) -> str:
    """A script that brings ``.st-key-<key>`` into view once the page has been drawn (the app idle,
    so a redraw cannot move it again): its bottom to the window's bottom (so the card above stays in
    view as far as it can), its top when it is taller than the window; nothing when it is in view
    already (the presentation layout). ``arrival`` makes each arrival's text new, so the browser runs
    it again. Our own fixed text, no user or model text: the one script the app runs."""
    return (f"<script>/* arrival {arrival} */ (() => {{ let tries = 0; const go = () => {{"
            " const app = document.querySelector('[data-testid=stApp]');"
            f" const el = document.querySelector('.st-key-{key}');"
            " const ready = app && app.dataset.testScriptState === 'notRunning';"
            " if (!ready || !el || el.getBoundingClientRect().height < 40) {"
            " if (++tries < 300) setTimeout(go, 100); return; }"
            " const r = el.getBoundingClientRect(), vh = window.innerHeight;"
            " if (r.top >= 0 && r.bottom <= vh) return;"
            " el.scrollIntoView({behavior: 'smooth', block: r.height < vh ? 'end' : 'start'}); };"
            " setTimeout(go, 100); })();</script>")


def highlight_css(keys: tuple[str, ...]) -> str:
    sel = ",".join(f".st-key-{k}" for k in keys)
    return (f"<style>{sel}{{outline:4px solid #f08c00;outline-offset:6px;border-radius:.6rem}}"
            ".st-key-tour_card{background:#fff9db;border-radius:.6rem}</style>")


# --- the card on the Generate page, the banner on the others ----------------------------------------

_PAGES: dict[str, object] = {}  # url path -> st.Page, registered by app.py on every run (for links)

BANNERS = {
    "race": "Start the race and watch “no cache” fall behind, then read why the measured speedup is not the "
            "FLOP ratio under the charts.",
    "prefill": "Measure prefill and decode, then read the roofline verdicts: which phase is compute-bound, "
               "which memory-bound, on this machine.",
    "batching": "One decode step can serve many requests: throughput climbs with the batch while each request "
                "waits a little longer, and the cache grows with every request.",
    "calculator": f"Set to step 7's example: Llama-2-70B, {BIG_CONTEXT:,} tokens, an fp16 cache. Read the KV cache "
                  "per token and per conversation, and whether it fits on a GPU; then pick any other preset or "
                  "context length.",
}


def register_pages(**pages: object) -> None:
    _PAGES.update(pages)


def _link(name: str, label: str, icon: str) -> None:
    page = _PAGES.get(name)
    if page is not None:
        st.page_link(page, label=label, icon=icon)  # type: ignore[arg-type]


def card(model: LoadedModel | None, dtype: str = "fp32") -> str | None:
    """The tour's card for the current step (nothing when the tour is off). Returns the page action
    its button asked for ("generate" or "step"), else None."""
    n = current()
    if not n:
        return None
    all_steps = steps(model, dtype)
    n = min(n, len(all_steps))
    s = all_steps[n - 1]
    st.html(highlight_css(s.points_at))
    if s.scroll_to and session.get(SCROLLED_KEY) != n:
        # Once per arrival at the step: the text says "the chart below", which in the normal layout
        # sits about 1,000 px under the fold; later reruns (Step, Generate) leave the scroll alone.
        session.put(SCROLLED_KEY, n)
        arrival = session.get(session.TOUR_ARRIVALS, 0) + 1
        session.put(session.TOUR_ARRIVALS, arrival)
        st.html(scroll_js(s.scroll_to, arrival), unsafe_allow_javascript=True)
    elif not s.scroll_to:
        session.put(SCROLLED_KEY, None)
    asked = None
    with st.container(key="tour_card", border=True):
        # One row of title, action and navigation, each button as wide as its label (fixed columns cut
        # "Back B" to "B… B" at 1366 px); what does not fit wraps to a second row, never cut. The text
        # below runs the card's full width, so a step costs as few lines as it can above its views.
        with st.container(horizontal=True, vertical_alignment="center", gap="small", key="tour_head"):
            st.markdown(f"**Tour, step {n} of {len(all_steps)}: {s.title}**", width="stretch")
            if s.action:
                mode = {"no_cache": "none", "cache": "static"}.get(s.action)
                if st.button(s.action_label, key="tour_action", width="content", icon=":material/play_arrow:",
                             on_click=_set_cache if mode else None, args=(mode,) if mode else None):
                    asked = {"no_cache": "step", "cache": "generate"}.get(s.action, s.action)
            if s.link == "calculator":
                _link("calculator", "Open the calculator", ":material/calculate:")
            elif s.link == "race":
                _link("race", "Open the race", ":material/speed:")
            st.button("Back", key="tour_back", on_click=go, args=(n - 1,), disabled=n == 1, width="content",
                      shortcut="B")
            st.button("Next" if n < len(all_steps) else "Finish", key="tour_next", type="primary", width="content",
                      on_click=go, args=(n + 1 if n < len(all_steps) else 0,), shortcut="N")
            st.button("End tour", key="tour_end", type="tertiary", on_click=go, args=(0,), width="content")
        st.markdown(s.text)
    return asked


def banner(page: str) -> None:
    """On the other pages while the tour is on: what to do here, and the way back."""
    n = current()
    came_from = session.get(LAST_PAGE_KEY)
    session.put(LAST_PAGE_KEY, page)
    if not n or page not in BANNERS:
        return
    if page == "calculator" and came_from != "calculator":
        # Arriving on the calculator during the tour: it shows the example step 7 quotes (set before
        # its widgets exist, so they take these values), as the banner says.
        session.update(CALC_EXAMPLE)
    with st.container(key="tour_banner", border=True):
        text, back = st.columns([6, 1.4], vertical_alignment="center")
        text.markdown(f"**Tour** (step {n}): {BANNERS[page]}")
        with back:
            _link("generate", "Back to the tour", ":material/school:")
    st.html(".st-key-tour_banner{background:#fff9db;border-radius:.6rem}".join(("<style>", "</style>")))


def start_button() -> None:
    """The way in, on the Generate page while the tour is off."""
    st.button("Start the tour", key="tour_start", icon=":material/school:", on_click=go, args=(1,),
              help="Eight short steps through a real run: tokens, Q/K/V, prefill, decode, no cache, attention, "
                   "memory and speed (and hybrid attention on Gemma 3), each pointing at the view it explains. "
                   "Or open the app with ?tour=1.")
