"""A chat template over the byte tokenizer, so conversation tests can run on make_llama's models."""
from __future__ import annotations

import dataclasses

from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.tokenize.tokenizer import ByteTokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class ChatBytes(ByteTokenizer):
    """Byte tokens that round-trip exactly (latin-1: one byte, one character), with a template."""

    chat_template = TEMPLATE
    special_tokens: dict[str, str] = {}

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:  # type: ignore[override]
        return list(text.encode("latin-1"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("latin-1")


def chat_model(model: LoadedModel, eos: int | None = None) -> LoadedModel:
    """``model`` with the chat byte tokenizer (a new LoadedModel; the weights are shared, read-only)."""
    return dataclasses.replace(model, tokenizer=ChatBytes(eos_token_id=eos))
