"""Every example kvviz ships for the chat model, run on the real SmolLM2-135M-Instruct greedily with
its chat template, gets the right answer: the sidebar's example buttons, the Prefill vs decode
lesson's short question and the Chat page's scenario (two turns, then the first message edited).

A 135M model knows little; an example it gets wrong (Spain -> "El Salvador", a KV cache -> "a type
of electronic circuit") teaches the opposite of what the page means to show.
"""
from __future__ import annotations

import pytest

from kvviz.engine.sessions.conversation import Conversation
from kvviz.engine.api import generate
from kvviz.engine.loading.loader import LoadedModel
from kvviz.measure.sweeps import SHORT_QUESTION
from kvviz.ui.pages.chat.chat_scenario import NEW_TOKENS, Q1, Q1_EDITED, Q2
from kvviz.ui.settings import Settings
from kvviz.ui.sidebar import CHAT_EXAMPLES, DEFAULT_CHAT_PROMPT, DEFAULT_NEW_TOKENS
from kvviz import SamplingParams
from kvviz import CacheSpec

# What a right answer contains, for each shipped question (independent of kvviz: plain facts).
ANSWERS = {
    "Why is the sky blue?": "Rayleigh scattering",
    "What is the capital of France?": "Paris",
    "What does RAM stand for in a computer?": "Random Access Memory",
    "What is the boiling point of water in Celsius?": "100",
}


def _answer(model: LoadedModel, question: str, n: int = 48) -> str:
    run = generate(model, prompt=question, chat=True, max_new_tokens=n, sampling=SamplingParams(greedy=True))
    return run.text


def test_every_shipped_question_has_a_known_answer() -> None:
    assert set(CHAT_EXAMPLES.values()) | {SHORT_QUESTION} <= set(ANSWERS)


@pytest.mark.parametrize("question", sorted(set(CHAT_EXAMPLES.values()) | {SHORT_QUESTION}))
def test_smollm2_answers_the_example(smollm2: LoadedModel, question: str) -> None:
    text = _answer(smollm2, question)
    assert ANSWERS[question] in text, text


def test_the_default_answer_runs_long_enough_to_watch_and_stop(smollm2: LoadedModel) -> None:
    """Issue 36: the default answer was 8 tokens (France), over before Stop could be pressed. The
    default question's answer goes on past the default Max new tokens, which Settings shares."""
    assert Settings().max_new_tokens == DEFAULT_NEW_TOKENS >= 100
    run = generate(smollm2, prompt=DEFAULT_CHAT_PROMPT, chat=True, max_new_tokens=DEFAULT_NEW_TOKENS,
                   sampling=SamplingParams(greedy=True))
    assert run.stop_reason == "max_new_tokens" and len(run.generated_ids) == DEFAULT_NEW_TOKENS, run.text
    assert "Rayleigh scattering" in run.text


def test_smollm2_gets_the_chat_scenario_right(smollm2: LoadedModel) -> None:
    """The scenario's chat, as the page runs it (greedy, 24 new tokens): France, Italy, then the
    first message edited to Germany."""
    conv = Conversation(smollm2, cache=CacheSpec(kind="paged", block_size=16), max_new_tokens=NEW_TOKENS)
    assert "Paris" in conv.send(Q1).text
    assert "Rome" in conv.send(Q2).text
    edited = conv.edit(0, Q1_EDITED)
    assert Q1_EDITED == "What is the capital of Germany?" and "Berlin" in edited.text, edited.text
