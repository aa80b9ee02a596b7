"""The serving page's workload builder and its checks, with plain values worked out by hand."""
from __future__ import annotations

import math
import random

from kvviz.ui.pages.serving import workload as wl

TEXTS = [[1, 2, 3, 4, 5], [10, 11, 12]]
SYSTEM = [100, 101, 102]


def test_arrivals() -> None:
    rng = random.Random(0)
    assert wl.arrivals(wl.WorkloadSpec(requests=4, arrival="once"), rng) == [0, 0, 0, 0]
    assert wl.arrivals(wl.WorkloadSpec(requests=5, arrival="steady", rate=0.5), rng) == [0, 2, 4, 6, 8]
    assert wl.arrivals(wl.WorkloadSpec(requests=4, arrival="steady", rate=2.0), rng) == [0, 0, 1, 1]
    assert wl.arrivals(wl.WorkloadSpec(requests=7, arrival="bursts", burst_size=3, burst_every=5), rng) == \
        [0, 0, 0, 5, 5, 5, 10]
    # Poisson: exponential gaps of mean 1/rate from the seed, summed, floored; the first at step 0.
    ref, t = [], 0.0
    r = random.Random(7)
    for _ in range(6):
        ref.append(math.floor(t))
        t += r.expovariate(0.25)
    got = wl.arrivals(wl.WorkloadSpec(requests=6, arrival="poisson", rate=0.25), random.Random(7))
    assert got == ref and got == sorted(got) and got[0] == 0 and got[-1] > 0


def test_build_fixed_lengths_and_an_even_shared_spread() -> None:
    spec = wl.WorkloadSpec(requests=4, arrival="once", prompt="fixed", prompt_len=4, output="fixed", output_len=3,
                           shared_fraction=0.5, shared_len=5)
    reqs = wl.build(spec, TEXTS, SYSTEM)
    assert [r["id"] for r in reqs] == ["r000", "r001", "r002", "r003"]
    # half of 4, spread: the count of shared ones steps up at requests 1 and 3
    assert [r["shared"] for r in reqs] == [False, True, False, True]
    assert reqs[0]["prompt_ids"] == [1, 2, 3, 4]
    assert reqs[1]["prompt_ids"] == [100, 101, 102, 100, 101] + [10, 11, 12, 10]  # the system prompt cycled to 5
    # round two reads each text from offset 7: text 0 (5 ids) from 7 % 5 = 2
    assert reqs[2]["prompt_ids"] == [3, 4, 5, 1]
    assert all(r["max_tokens"] == 3 and r["ignore_eos"] is True and r["arrival"] == 0 for r in reqs)


def test_build_uniform_lengths_are_seeded_and_bounded() -> None:
    spec = wl.WorkloadSpec(requests=50, prompt="uniform", prompt_len=3, prompt_max=9, output="uniform", output_len=2,
                           output_max=5, shared_fraction=0.0, seed=3)
    a, b = wl.build(spec, TEXTS, SYSTEM), wl.build(spec, TEXTS, SYSTEM)
    assert a == b  # the same seed, the same workload
    assert {len(r["prompt_ids"]) for r in a} == set(range(3, 10))
    assert {r["max_tokens"] for r in a} == {2, 3, 4, 5}
    assert a != wl.build(wl.WorkloadSpec(**{**spec.__dict__, "seed": 4}), TEXTS, SYSTEM)


def test_real_prompts_are_taken_in_turn() -> None:
    spec = wl.WorkloadSpec(requests=3, prompt="real", shared_fraction=0.0, output="fixed", output_len=1)
    reqs = wl.build(spec, TEXTS, SYSTEM, real=[[7, 8], [9]])
    assert [r["prompt_ids"] for r in reqs] == [[7, 8], [9], [7, 8]]
    # shared ones take the prompt with the system message laid out in it, not a prefix
    spec = wl.WorkloadSpec(requests=2, prompt="real", shared_fraction=0.5, shared_len=3, output="fixed", output_len=1)
    reqs = wl.build(spec, TEXTS, SYSTEM, real=[[7, 8]], real_shared=[[1, 100, 7, 8]])
    assert [r["prompt_ids"] for r in reqs] == [[7, 8], [1, 100, 7, 8]] and [r["shared"] for r in reqs] == [False, True]
    # without a template, a shared real prompt gets the system prompt's ids in front
    reqs = wl.build(spec, TEXTS, SYSTEM, real=[[7, 8]])
    assert [r["prompt_ids"] for r in reqs] == [[7, 8], [100, 101, 102, 7, 8]]


def test_problems_each_in_one_sentence() -> None:
    ok = wl.WorkloadSpec(requests=2, prompt="fixed", prompt_len=10, output="fixed", output_len=6, shared_fraction=0)
    reqs = wl.build(ok, TEXTS, SYSTEM)
    assert wl.problems(ok, reqs, context=64, num_blocks=4, block_size=4, budget=16) == []
    assert wl.problems(wl.WorkloadSpec(requests=0), [], context=64, num_blocks=4, block_size=4, budget=16) == \
        ["A workload needs at least 1 request."]
    (msg,) = wl.problems(ok, reqs, context=64, num_blocks=4, block_size=16, budget=8)
    assert msg.startswith("The token budget (8) is smaller than one block (16 tokens)")
    (msg,) = wl.problems(ok, reqs, context=15, num_blocks=4, block_size=4, budget=16)
    assert "needs 16 tokens (prompt + output), past this model's context of 15" in msg
    # a 10-token prompt and its first token: ceil(11 / 4) = 3 blocks
    (msg,) = wl.problems(ok, reqs, context=64, num_blocks=2, block_size=4, budget=16)
    assert "The pool (2 blocks of 4 tokens) is smaller than one request's prompt (3 blocks)" in msg


def test_pool_from_mib_and_max_concurrency() -> None:
    # SmolLM2-135M in fp32: 2 x 30 layers x 3 K/V heads x 64 x 4 B = 46,080 B a token; 16 tokens a block
    assert wl.pool_blocks_from_mib(4.0, 46_080, 16) == 4 * 2 ** 20 // (46_080 * 16) == 5
    assert wl.max_concurrency(32, 16, 100) == 32 / 7  # ceil(100 / 16) = 7 blocks a request
    assert wl.max_concurrency(32, 16, 0) == 0.0
