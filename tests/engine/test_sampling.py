"""Sampling filters and draws against hand-worked distributions."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvviz.errors import KVVizError
from kvviz.engine.generation.sampling import SamplingParams, filter_logits, make_generator, sample

# A distribution that is easy to reason about: p = [0.5, 0.3, 0.15, 0.05] (in a shuffled order).
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)
LOGITS = torch.log(PROBS).float()[None]  # (1, 4)


def _kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def test_greedy_is_argmax_per_row() -> None:
    x = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.9, 0.0], [-3.0, -2.0, -2.5]])
    assert sample(x, SamplingParams(greedy=True), None).tolist() == [1, 0, 1]


def test_temperature_divides_the_logits() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5]])
    out = filter_logits(x, SamplingParams(greedy=False, temperature=0.5))
    torch.testing.assert_close(out, torch.tensor([[2.0, -4.0, 1.0]]))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 10])
def test_top_k_keeps_the_k_largest(k: int) -> None:
    out = filter_logits(LOGITS, SamplingParams(greedy=False, top_k=k))
    order = np.argsort(-PROBS.numpy())  # [1, 3, 0, 2]
    assert _kept(out) == set(order[: min(k, 4)].tolist())
    kept = torch.isfinite(out)
    torch.testing.assert_close(out[kept], LOGITS[kept])  # survivors are untouched


@pytest.mark.parametrize("p, kept", [
    (1e-6, {1}),  # the top token always stays
    (0.4, {1}),  # 0.5 alone reaches 0.4
    (0.75, {1, 3}),  # 0.5 < 0.75 <= 0.8
    (0.85, {1, 3, 0}),  # 0.8 < 0.85 <= 0.95
    (0.99, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_set_reaching_p(p: float, kept: set[int]) -> None:
    assert _kept(filter_logits(LOGITS, SamplingParams(greedy=False, top_p=p))) == kept


def test_top_p_applies_after_temperature_and_top_k() -> None:
    # T=2 flattens p to sqrt(p) renormalised: [0.387, 0.707, 0.224, 0.548] / 1.866
    # = [0.208, 0.379, 0.120, 0.294]; top-k 3 drops index 2; renormalised over {1, 3, 0}:
    # [0.236, 0.431, -, 0.334]; top-p 0.7: 0.431 < 0.7, 0.431 + 0.334 = 0.764 >= 0.7 -> {1, 3};
    # top-p 0.8: 0.764 < 0.8, so index 0 stays too.
    out = filter_logits(LOGITS, SamplingParams(greedy=False, temperature=2.0, top_k=3, top_p=0.7))
    assert _kept(out) == {1, 3}
    out = filter_logits(LOGITS, SamplingParams(greedy=False, temperature=2.0, top_k=3, top_p=0.8))
    assert _kept(out) == {0, 1, 3}


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(greedy=False), [0.15, 0.5, 0.05, 0.3]),
    (SamplingParams(greedy=False, top_k=2), [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]),
    (SamplingParams(greedy=False, top_p=0.85), [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95]),
    (SamplingParams(greedy=False, temperature=0.5),  # p^2 renormalised
     [0.0225 / 0.3650, 0.25 / 0.3650, 0.0025 / 0.3650, 0.09 / 0.3650]),
])
def test_sample_frequencies_match_the_filtered_distribution(params: SamplingParams, expected: list[float]) -> None:
    n = 40_000
    draws = sample(LOGITS.expand(n, 4), params, make_generator(params, torch.device("cpu")))
    freq = np.bincount(draws.numpy(), minlength=4) / n
    # 4 standard errors of a proportion at n=40k is at most 0.01.
    np.testing.assert_allclose(freq, expected, atol=0.01)
    assert all(freq[i] == 0 for i, e in enumerate(expected) if e == 0)


def test_same_seed_same_draws_and_greedy_needs_no_generator() -> None:
    p = SamplingParams(greedy=False, temperature=1.0, seed=5)
    x = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    a = sample(x, p, make_generator(p, torch.device("cpu")))
    b = sample(x, p, make_generator(p, torch.device("cpu")))
    assert torch.equal(a, b)
    c = sample(x, SamplingParams(greedy=False, temperature=1.0, seed=6), make_generator(
        SamplingParams(greedy=False, seed=6), torch.device("cpu")))
    assert not torch.equal(a, c)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(greedy=False, temperature=0.0), "temperature"),
    (dict(greedy=False, temperature=-0.5), "temperature"),
    (dict(greedy=False, temperature=100.5), "temperature"),
    (dict(greedy=False, temperature=math.nan), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
])
def test_bad_params_raise(kwargs: dict, needle: str) -> None:
    with pytest.raises(KVVizError, match=needle):
        SamplingParams(**kwargs)


def test_describe() -> None:
    assert SamplingParams().describe() == "greedy"
    assert SamplingParams(greedy=False, temperature=0.8, top_k=40, top_p=0.9, seed=3).describe() == \
        "T=0.8, top-k=40, top-p=0.9, seed 3"
