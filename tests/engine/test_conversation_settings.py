"""Issue 37: a conversation is never thrown away by a setting. What applies to the next turn
(max new tokens, sampling) keeps the turns and the cache; another model or cache keeps the
transcript and rebuilds the cache from it (the rebuild turn reuses nothing); a turn in flight
when the model changes is kept as interrupted. Issue 36: each turn's TTFT without reuse is
measured on the same turn."""
from __future__ import annotations

import math
from typing import Callable

import pytest

from chat_fixtures import chat_model
from kvviz.engine.sessions.conversation import Conversation, TurnInterrupted, common_prefix
from kvviz.engine.loading.loader import LoadedModel
from kvviz.errors import KVVizError
from kvviz import CacheSpec, SamplingParams


@pytest.fixture(scope="module")
def model_a(make_llama: Callable[..., LoadedModel]) -> LoadedModel:
    return chat_model(make_llama(block_size=256))


@pytest.fixture(scope="module")
def model_b(make_llama: Callable[..., LoadedModel]) -> LoadedModel:
    return chat_model(make_llama(seed=1, block_size=256))  # other weights, the same byte tokenizer


@pytest.mark.parametrize("kind", ["paged", "static"])
def test_next_turn_settings_keep_the_turns_and_the_cache(model_a: LoadedModel, kind: str) -> None:
    conv = Conversation(model_a, cache=CacheSpec(kind=kind, block_size=8), max_new_tokens=4)
    t1 = conv.send("Tell me about the sea.")
    conv.configure(max_new_tokens=5)  # 4 -> 5: the 24 -> 25
    t2 = conv.send("And the sky?")
    assert conv.turns == [t1, t2] and conv.carried == 0
    # The cache survived the change: turn 2 reuses turn 1's prompt and answer, as it would have anyway.
    held = list(t1.prompt_ids) + list(t1.generated_ids[:-1])
    assert t2.cached_before == len(held) and t2.reused_tokens == common_prefix(held, list(t2.prompt_ids))
    assert t2.reused_tokens > t1.prompt_tokens
    assert (t1.max_new_tokens, t2.max_new_tokens) == (4, 5) and t2.generated_tokens <= 5
    # Sampling applies to the next turn too; each turn is checked with its own settings.
    conv.configure(max_new_tokens=6, sampling=SamplingParams(greedy=False, temperature=0.9, top_k=20, seed=7))
    t3 = conv.send("Say more.")
    assert t3.reused_tokens > t2.prompt_tokens and not t3.params.greedy and t3.params.seed == 7
    assert [conv.matches_scratch(k) for k in range(3)] == [True, True, True]


def test_configure_rejects_a_bad_length_and_changes_nothing(model_a: LoadedModel) -> None:
    conv = Conversation(model_a, cache=CacheSpec(kind="static"), max_new_tokens=3)
    conv.send("hi")
    with pytest.raises(KVVizError, match="positive integer"):
        conv.configure(max_new_tokens=0)
    assert conv.max_new_tokens == 3 and len(conv.turns) == 1


def test_another_model_keeps_the_transcript_and_rebuilds_the_cache(model_a: LoadedModel,
                                                                   model_b: LoadedModel) -> None:
    conv = Conversation(model_a, cache=CacheSpec(kind="paged", block_size=8), max_new_tokens=4)
    t1, t2 = conv.send("Tell me about the sea."), conv.send("And the sky?")
    messages = list(conv.messages)
    conv.rebuild(model_b, cache=CacheSpec(kind="static"), reason="the model was switched")
    assert conv.turns == [t1, t2] and conv.messages == messages and conv.carried == 2
    assert conv.held == [] and conv.cache.pos == 0 and conv.model is model_b
    assert "paged cache, blocks of 8" in t1.made_on and conv.label().endswith("static cache")
    # The rebuild turn prefills the whole transcript: nothing reused, and the counters say so.
    t3 = conv.send("Now the stars.")
    assert (t3.cached_before, t3.reused_tokens, t3.prefilled_tokens) == (0, 0, t3.prompt_tokens)
    assert list(t3.prompt_ids[: len(t2.prompt_ids)]) == list(t2.prompt_ids)  # the kept transcript is its prompt
    t4 = conv.send("And the moon?")
    assert t4.reused_tokens > t3.prompt_tokens  # the cache is rebuilt: reuse as before
    assert conv.matches_scratch(2) and conv.matches_scratch(3)  # on model B
    with pytest.raises(KVVizError, match="earlier cache"):
        conv.matches_scratch(0)  # model A's turn: another model's ids
    # Editing a carried message replaces it: the carried turns before it stay carried.
    conv.edit(1, "And the clouds?")
    assert conv.carried == 1 and len(conv.turns) == 2 and conv.matches_scratch(1)


def test_a_turn_in_flight_when_the_model_changes_is_kept_as_interrupted(model_a: LoadedModel,
                                                                        model_b: LoadedModel) -> None:
    conv = Conversation(model_a, cache=CacheSpec(kind="paged", block_size=8), max_new_tokens=8)
    t1 = conv.send("Tell me about the sea.")
    it = conv.iter_send("Go on please.")
    next(it), next(it), next(it)  # three tokens answered
    conv.rebuild(model_b, cache=CacheSpec(kind="paged", block_size=8), reason="the model was switched")
    (cut,) = conv.interrupted
    assert (cut.user, cut.after, cut.generated_tokens, cut.reason) == ("Go on please.", 1, 3, "the model was switched")
    with pytest.raises(TurnInterrupted):
        next(it)
    assert conv.turns == [t1] and not conv.running
    # A message rendered for the old model but not yet begun is kept too, never run on the new one.
    late = conv.iter_send("Are you there?")
    conv.rebuild(model_a, cache=CacheSpec(kind="static"), reason="the model was switched")
    with pytest.raises(TurnInterrupted):
        next(late)
    assert [c.user for c in conv.interrupted] == ["Go on please.", "Are you there?"]
    assert conv.interrupted[1].generated_tokens == 0 and conv.turns == [t1]
    t2 = conv.send("Go on please.")
    assert t2.reused_tokens == 0 and conv.matches_scratch(1)


def test_a_cache_that_cannot_be_built_changes_nothing(model_a: LoadedModel) -> None:
    conv = Conversation(model_a, cache=CacheSpec(kind="paged", block_size=8), max_new_tokens=4)
    conv.send("hi")
    cache = conv.cache
    with pytest.raises(KVVizError):
        conv.rebuild(model_a, cache=CacheSpec(kind="paged", block_size=0))
    assert conv.cache is cache and conv.carried == 0 and len(conv.turns) == 1


def test_each_turn_is_timed_without_reuse_on_the_same_prompt(model_a: LoadedModel, model_b: LoadedModel) -> None:
    conv = Conversation(model_a, cache=CacheSpec(kind="paged", block_size=8), max_new_tokens=4)
    conv.send("Tell me about the sea.")
    conv.send("And the sky?")
    ms = conv.time_without_reuse()
    t = conv.turns[-1]
    # A real timing of real work: positive and finite, kept on the turn, measured once.
    assert ms is not None and math.isfinite(ms) and ms > 0 and t.no_reuse_ttft_ms == ms
    assert conv.time_without_reuse() == ms and conv.turns[-1] is t
    assert conv.turns[0].no_reuse_ttft_ms is None  # only the turn it was asked for
    assert t.to_dict()["no_reuse_ttft_ms"] == ms
    conv.rebuild(model_b, cache=CacheSpec(kind="static"))
    assert conv.time_without_reuse() is None  # the last turn is model A's: not this cache's to time


def test_the_no_reuse_prefill_computes_what_the_turn_computed(model_a: LoadedModel) -> None:
    """The timing runs the real prefill: on a fresh cache of the same kind, the whole prompt gives
    the first token the turn sampled (greedy), so the comparison times the same work."""
    import torch

    from kvviz.engine.kvcache.paged_cache import PagedKVCache
    from kvviz.engine.sessions.conversation_checks import feed

    conv = Conversation(model_a, cache=CacheSpec(kind="paged", block_size=8), max_new_tokens=4)
    conv.send("Tell me about the sea.")
    t = conv.send("And the sky?")
    m, ids = model_a, list(t.prompt_ids)
    with torch.inference_mode():
        cache = PagedKVCache(m.config, 1, m.device, m.dtype, 8, conv.cache.pool.blocks_for_sequence(len(ids) + 1))
        logits = feed(m, cache, "fast", torch.tensor([ids]), torch.arange(m.config.block_size))
    assert int(logits[0, -1].argmax()) == t.generated_ids[0] and cache.pos == len(ids)
