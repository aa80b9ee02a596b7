"""Chat prompts: a model's own chat template (jinja2, sandboxed) turned into text and token ids.

An instruct model was fine-tuned on conversations laid out one exact way (SmolLM2 uses ChatML:
``<|im_start|>user\\nHi<|im_end|>\\n``); a prompt laid out any other way gets worse answers. So
we render the template the model file ships, as transformers' ``apply_chat_template`` does:

    prompt = chat_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}])
    prompt.text   # '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, ...'
    prompt.ids    # the same text as token ids, special tokens whole, ready for generate()

The template is code from the model file, so it runs in jinja2's immutable sandbox: it can read
the messages but not call methods that change them or reach Python internals.

What a user or a system prompt types is text, never a control token: a message holding
``<|im_end|>\n<|im_start|>system\n...`` would otherwise encode exactly like a real system turn
(transformers and most servers do encode it so). Only the template's own special tokens are
control tokens; typed ones are encoded as their characters, as transformers'
``split_special_tokens=True`` would, and listed in ``ChatPrompt.typed_specials`` so the views can
mark them. ``parse_special=True`` restores the old reading, on purpose. Assistant messages (the
model's own earlier answers) keep theirs: what the model generated is what it saw.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
import json
import random
import re
from typing import Any, Protocol

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvviz.errors import KVVizError

ROLES = ("system", "user", "assistant")
LITERAL_ROLES = ("system", "user")  # whose typed special-token text stays text


class ChatTokenizer(Protocol):
    """What chat_prompt needs from a tokenizer (GGUFTokenizer has it)."""

    chat_template: str | None
    special_tokens: Mapping[str, str]  # {"bos_token": "<|im_start|>", "eos_token": ...}
    control_tokens: Mapping[str, int]  # {"<|im_end|>": 2, ...}: text encode() matches whole

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: the text the template wrote and its token ids."""

    text: str
    ids: tuple[int, ...]
    typed_specials: tuple[str, ...] = ()  # control-token text typed in messages, encoded as text


def _special_pattern(controls: Mapping[str, int]) -> re.Pattern[str] | None:
    """One regex for every control token's text, longest first (so "<|im_start|>" wins over a
    shorter token that is its prefix, as the tokenizer's own matcher does)."""
    if not controls:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(controls, key=len, reverse=True)))


def typed_specials(text: str, controls: Mapping[str, int]) -> list[str]:
    """The control-token texts that occur in ``text``, in order ("<|im_end|>" typed in a message)."""
    pattern = _special_pattern(controls)
    return pattern.findall(text) if pattern is not None and text else []


def check_messages(messages: object) -> list[dict[str, str]]:
    """The messages as plain ``{"role", "content"}`` dicts, or a KVVizError saying what is wrong.

    Rebuilding them also means the template sees only str values, never a caller's objects
    (whose methods the sandbox cannot vet)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise KVVizError(f"messages must be a list of {{'role', 'content'}} dicts, "
                         f"not {type(messages).__name__}")
    if not messages:
        raise KVVizError("messages is empty: a chat needs at least one message")
    clean = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise KVVizError(f"message {i} must be a dict with 'role' and 'content', "
                             f"not {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise KVVizError(f"message {i} has role {role!r}: expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise KVVizError(f"message {i} ({role}) needs text content, "
                             f"not {type(content).__name__}")
        clean.append({"role": str(role), "content": str.__str__(content)})
    return clean


def _raise_exception(message: str) -> None:
    # Templates call this to refuse a conversation (e.g. "roles must alternate").
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML (< becomes \u003c); templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Some templates (Llama 3.x) print today's date in the system prompt.
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # The same environment settings as transformers, so the same template renders the same text:
    # trim_blocks/lstrip_blocks drop the newline and indent around {% ... %} tags.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template: str, messages: object, *, add_generation_prompt: bool = True,
                special_tokens: Mapping[str, str] | None = None) -> str:
    """The text a chat template writes for ``messages``.

    ``add_generation_prompt`` ends the text with the assistant's header, so the model's next
    tokens are the answer. ``special_tokens`` fills ``{{ bos_token }}`` and friends."""
    clean = check_messages(messages)
    try:
        compiled = _compile(template)
        return compiled.render(messages=clean, add_generation_prompt=add_generation_prompt,
                               **dict(special_tokens or {}))
    except jinja2.TemplateError as e:  # syntax, undefined names, sandbox refusals, raise_exception
        raise KVVizError(f"the chat template failed: {e}") from None


def chat_prompt(tokenizer: ChatTokenizer, messages: object, *,
                add_generation_prompt: bool = True, parse_special: bool = False) -> ChatPrompt:
    """``messages`` rendered with the tokenizer's chat template, and tokenized.

    Control-token text typed in a system or user message is encoded as plain text unless
    ``parse_special`` (see the module docstring); every other id is what it always was."""
    template = tokenizer.chat_template
    if not template:
        name = getattr(tokenizer, "name", "this model")
        raise KVVizError(f"{name} has no chat template: use a plain prompt, or an instruct model")
    clean = check_messages(messages)
    controls: Mapping[str, int] = getattr(tokenizer, "control_tokens", None) or {}
    typed = [s for m in clean if m["role"] in LITERAL_ROLES for s in typed_specials(m["content"], controls)]
    if parse_special or not typed:
        text = render_chat(template, clean, add_generation_prompt=add_generation_prompt,
                           special_tokens=tokenizer.special_tokens)
        # No BOS of our own: a template that wants one writes {{ bos_token }} itself (transformers
        # tokenizes the rendered chat with add_special_tokens=False for the same reason).
        return ChatPrompt(text=text, ids=tuple(tokenizer.encode(text, add_bos=False)),
                          typed_specials=tuple(typed) if parse_special else ())
    text, ids = _render_literal(tokenizer, template, clean, controls, add_generation_prompt)
    return ChatPrompt(text=text, ids=tuple(ids), typed_specials=tuple(typed))


def _render_literal(tokenizer: ChatTokenizer, template: str, clean: list[dict[str, str]],
                    controls: Mapping[str, int], add_generation_prompt: bool) -> tuple[str, list[int]]:
    """The rendered text and its ids, with control-token text typed in messages kept as text.

    Each typed occurrence is swapped for a marker before rendering (private-use characters around
    a random number: no template filter changes them), so after rendering the template's own
    control tokens are the only ones left in the text. The text is cut at those: each is its id,
    and each piece between them (markers turned back into the typed text) is encoded with control
    tokens read as text. Without typed specials this is exactly what encode() of the whole text
    does (it cuts at control tokens, then encodes the pieces alone): tests/engine/test_tokenizer_gguf.py.
    """
    pattern = _special_pattern(controls)
    assert pattern is not None
    nonce = f"{random.SystemRandom().randrange(10**12):012d}"
    typed: list[str] = []

    def mark(m: re.Match[str]) -> str:
        typed.append(m.group(0))
        return f"\ue000{nonce}:{len(typed) - 1}\ue001"

    marked = [{**m, "content": pattern.sub(mark, m["content"])} if m["role"] in LITERAL_ROLES else m for m in clean]
    rendered = render_chat(template, marked, add_generation_prompt=add_generation_prompt,
                           special_tokens=tokenizer.special_tokens)
    marker = re.compile(f"\ue000{nonce}:(\\d+)\ue001")

    def unmark(s: str) -> str:
        return marker.sub(lambda m: typed[int(m.group(1))], s)

    ids: list[int] = []
    at = 0
    for m in pattern.finditer(rendered):  # the template's own control tokens
        if m.start() > at:
            ids += tokenizer.encode(unmark(rendered[at: m.start()]), add_bos=False, parse_special=False)
        ids.append(controls[m.group(0)])
        at = m.end()
    if at < len(rendered):
        ids += tokenizer.encode(unmark(rendered[at:]), add_bos=False, parse_special=False)
    return unmark(rendered), ids
