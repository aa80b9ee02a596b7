"""Chat prompts: a model's own chat template (jinja2, sandboxed) turned into text and token ids.

An instruct model was fine-tuned on conversations laid out one exact way (SmolLM2 uses ChatML:
``<|im_start|>user\\nHi<|im_end|>\\n``); a prompt laid out any other way gets worse answers. So
we render the template the model file ships, as transformers' ``apply_chat_template`` does:

    prompt = chat_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}])
    prompt.text   # '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, ...'
    prompt.ids    # the same text as token ids, special tokens whole, ready for generate()

The template is code from the model file, so it runs in jinja2's immutable sandbox: it can read
the messages but not call methods that change them or reach Python internals.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
import json
from typing import Any, Protocol

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvviz.errors import KVVizError

ROLES = ("system", "user", "assistant")


class ChatTokenizer(Protocol):
    """What chat_prompt needs from a tokenizer (GGUFTokenizer has it)."""

    chat_template: str | None
    special_tokens: Mapping[str, str]  # {"bos_token": "<|im_start|>", "eos_token": ...}

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: the text the template wrote and its token ids."""

    text: str
    ids: tuple[int, ...]


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
                add_generation_prompt: bool = True) -> ChatPrompt:
    """``messages`` rendered with the tokenizer's chat template, and tokenized."""
    template = tokenizer.chat_template
    if not template:
        name = getattr(tokenizer, "name", "this model")
        raise KVVizError(f"{name} has no chat template: use a plain prompt, or an instruct model")
    text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                       special_tokens=tokenizer.special_tokens)
    # No BOS of our own: a template that wants one writes {{ bos_token }} itself (transformers
    # tokenizes the rendered chat with add_special_tokens=False for the same reason).
    return ChatPrompt(text=text, ids=tuple(tokenizer.encode(text, add_bos=False)))
