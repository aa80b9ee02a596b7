"""Batch > 1: the static cache, the concat cache and no cache agree token for token and in logits,
and a batch row generates what the same prompt generates alone."""
from __future__ import annotations

import numpy as np
import pytest

from kvviz import Capture
from kvviz.engine.api import generate
from keyword_sets import request_kwargs

ROWS = [[72, 101, 108, 108, 111, 32], [87, 111, 114, 108, 100, 33], [1, 2, 3, 4, 5, 6]]  # (3, 6)


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"temperature": 0.9, "top_k": 20, "seed": 7}])
def test_batched_cached_equals_uncached(small_model, sampling) -> None:  # type: ignore[no-untyped-def]
    runs = {
        mode: generate(small_model,
                       **request_kwargs(prompt_ids=ROWS, max_new_tokens=10, use_cache=mode != "none", cache_kind="static" if mode == "none" else mode, capture=Capture(logits=True), **sampling))
        for mode in ("static", "concat", "none")
    }
    ref = runs["none"]
    assert ref.batch_size == 3 and len(ref.events) == 10
    for mode, run in runs.items():
        assert [e.token_ids for e in run.events] == [e.token_ids for e in ref.events], mode
        for a, b in zip(run.events, ref.events):
            np.testing.assert_allclose(a.logits, b.logits, rtol=1e-4, atol=1e-4)


def test_batch_rows_match_single_runs(small_model) -> None:  # type: ignore[no-untyped-def]
    batched = generate(small_model, prompt=ROWS, max_new_tokens=8)
    for i, row in enumerate(ROWS):
        alone = generate(small_model, prompt=row, max_new_tokens=8)
        assert [e.token_ids[i] for e in batched.events] == alone.generated_ids


def test_repeated_prompt_batch_gives_identical_rows(small_model) -> None:  # type: ignore[no-untyped-def]
    run = generate(small_model, prompt=ROWS[0], max_new_tokens=6, batch_size=4)
    assert all(len(set(e.token_ids)) == 1 and len(e.token_ids) == 4 for e in run.events)
