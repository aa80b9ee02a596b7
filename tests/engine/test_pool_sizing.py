"""How many blocks a paged pool gets when nobody says, at each place that sizes one: the paged cache
itself, a conversation, beam search and speculative decoding, and the Chat page's widget default.
One formula (engine/kvcache/paged_pool.pool_blocks): every layer group keeps its own table per
sequence, so rows x blocks per row x groups. The figures below are worked out by hand.

The tiny Gemma 3 (test_gemma3_tiny.TINY): a 64-token context, layers (sliding, sliding, global):
kinds of 2 and 1 layers, groups the size of the smallest kind (1 layer), so 3 groups. The tiny
Llama: one group, a 256-token context; random:tiny, one group, a 1,024-token context."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvviz import Beam, CacheSpec, LoadedModel, Speculative, iter_generate
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.kvcache.paged_pool import config_groups, pool_blocks
from kvviz.engine.sessions.conversation import Conversation
from chat_fixtures import chat_model
from test_gemma3_tiny import tiny


def _blocks(cache: object) -> int:
    return cache.pool.blocks.num_blocks  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def llama(make_llama: Callable[..., LoadedModel]) -> LoadedModel:
    return make_llama(block_size=256)


def test_the_formula() -> None:
    assert pool_blocks(groups=1, blocks_per_row=32) == 32
    assert pool_blocks(groups=3, blocks_per_row=16, rows=2) == 96
    assert pool_blocks(groups=6, blocks_per_row=5, rows=3) == 90


def test_the_groups_of_the_tiny_models(llama: LoadedModel) -> None:
    assert config_groups(tiny().config).count == 3 and config_groups(llama.config).count == 1


def test_a_paged_cache_holds_every_row_to_the_context(llama: LoadedModel) -> None:
    # 2 rows x ceil(256 / 16) = 2 x 16 = 32; the Gemma: 1 row x ceil(64 / 4) x 3 groups = 48
    assert _blocks(make_cache("paged", llama.config, 2, "cpu", torch.float32, block_size=16)) == 32
    assert _blocks(make_cache("paged", tiny().config, 1, "cpu", torch.float32, block_size=4)) == 48


def test_a_conversation_holds_its_context_twice(llama: LoadedModel) -> None:
    """One sequence's context, and as much again for the blocks kept by prefix hash."""
    # 2 x ceil(256 / 8) = 64; the Gemma: 2 x ceil(64 / 4) x 3 groups = 96
    assert _blocks(Conversation(chat_model(llama), cache=CacheSpec(kind="paged", block_size=8)).cache) == 64
    assert _blocks(Conversation(chat_model(tiny()), cache=CacheSpec(kind="paged", block_size=4)).cache) == 96
    # a pool asked for is that pool
    assert _blocks(Conversation(chat_model(llama), cache=CacheSpec(kind="paged", block_size=8, blocks=40)).cache) == 40


def test_beams_and_drafts_get_a_spare_block_per_row(random_models: dict[str, LoadedModel]) -> None:
    model = random_models["tiny"]  # the byte tokenizer: "hello" is 5 tokens
    beams = iter_generate(model, "hello", max_new_tokens=7, cache=CacheSpec(kind="paged", block_size=4),
                          strategy=Beam(num_beams=3))
    list(beams)
    # 3 beams x (ceil((5 + 7) / 4) + 1) = 3 x 4 = 12
    assert _blocks(beams.cache) == 12
    drafts = iter_generate(model, "hello", max_new_tokens=7, cache=CacheSpec(kind="paged", block_size=4),
                           strategy=Speculative(draft_tokens=4, ngram=1))
    list(drafts)
    # 1 row x (ceil((5 + 7 + 4) / 4) + 1) = 5
    assert _blocks(drafts.cache) == 5
    gemma = iter_generate(tiny(), "hello", max_new_tokens=7, cache=CacheSpec(kind="paged", block_size=4),
                          strategy=Beam(num_beams=3))
    list(gemma)
    assert _blocks(gemma.cache) == 36  # 3 beams x 4 blocks x 3 groups


def test_the_chat_pages_default_pool() -> None:
    """64 blocks per layer group, at most the widget's 512."""
    from kvviz.ui.pages.chat.chat_page import default_pool_blocks

    assert [default_pool_blocks(g) for g in (0, 1, 3, 6, 8, 9)] == [64, 64, 192, 384, 512, 512]
