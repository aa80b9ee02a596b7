"""The scheduler's decisions against schedules computed by hand (vLLM V1's rules: budget, chunked
prefill, preemption of the most recently admitted, prefix hits never past prompt length - 1 and
rounded down to a block, LRU eviction tail first), the policies, and the pool's invariants after
runs that end early (an exception mid-step, a Stop)."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.serving.engine import ServeConfig, ServeEngine, ServeResult
from kvviz.engine.serving.requests import ServeRequest
from kvviz.errors import KVVizError


@pytest.fixture(scope="module")
def model(make_llama: Callable[..., LoadedModel]) -> LoadedModel:
    return make_llama(block_size=128)


def ids(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def run(model: LoadedModel, reqs: list[ServeRequest], **cfg: Any) -> tuple[ServeEngine, ServeResult]:
    engine = ServeEngine(model, ServeConfig(**cfg))
    res = engine.run(reqs)
    engine.cache.audit()
    return engine, res


def plan(res: ServeResult) -> list[list[tuple[str, str, int, int]]]:
    return [[(s.request_id, s.kind, s.start, s.num_tokens) for s in st.scheduled] for st in res.steps]


def test_budget_split_and_chunked_prefill(model: LoadedModel) -> None:
    # Budget 16: A's 20-token prompt takes 16 (all of it), then its last 4 beside B's 10.
    reqs = [ServeRequest("A", ids(20, 1), max_tokens=3, ignore_eos=True),
            ServeRequest("B", ids(10, 2), max_tokens=3, ignore_eos=True)]
    _, res = run(model, reqs, num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    assert plan(res) == [
        [("A", "prefill", 0, 16)],
        [("A", "prefill", 16, 4), ("B", "prefill", 0, 10)],
        [("A", "decode", 20, 1), ("B", "decode", 10, 1)],
        [("A", "decode", 21, 1), ("B", "decode", 11, 1)],
    ]
    assert [st.prefill_tokens for st in res.steps] == [16, 14, 0, 0]
    assert res.steps[0].waiting == ("B",) and res.steps[0].running == ("A",)
    assert res.steps[-1].finished == ("A", "B")
    assert res.steps[-1].prefix_query_tokens == 30 and res.steps[-1].prefix_hit_tokens == 0
    assert [r.first_token_step for r in res.requests] == [1, 1]


def test_preemption_picks_the_most_recently_admitted(model: LoadedModel) -> None:
    # 6 blocks of 4. Step 0 fills them (A 8, B 8, C 7). Step 1: A's 9th position needs a block:
    # C (admitted last) is preempted, losing 7; B takes C's hashed first block (evicted from the LRU).
    # Step 5: A needs its 4th block: B is preempted (12 computed tokens, 3 full hashed blocks, released
    # tail first so its tail block is evicted first); A finishes. Step 6: B takes back its first two
    # blocks (8 hit tokens, its third was evicted), C is recomputed from scratch.
    reqs = [ServeRequest("A", ids(8, 1), max_tokens=6, ignore_eos=True),
            ServeRequest("B", ids(8, 2), max_tokens=6, ignore_eos=True),
            ServeRequest("C", ids(7, 3), max_tokens=2, ignore_eos=True)]
    _, res = run(model, reqs, num_blocks=6, block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    assert plan(res) == [
        [("A", "prefill", 0, 8), ("B", "prefill", 0, 8), ("C", "prefill", 0, 7)],
        [("A", "decode", 8, 1), ("B", "decode", 8, 1)],
        [("A", "decode", 9, 1), ("B", "decode", 9, 1)],
        [("A", "decode", 10, 1), ("B", "decode", 10, 1)],
        [("A", "decode", 11, 1), ("B", "decode", 11, 1)],
        [("A", "decode", 12, 1)],
        [("B", "prefill", 8, 5), ("C", "prefill", 0, 8)],
    ]
    assert [(p.step, p.request_id, p.lost_tokens, p.recomputed_at) for p in res.preemptions] == \
        [(1, "C", 7, 6), (5, "B", 12, 6)]
    assert res.steps[1].preempted == ("C",) and res.steps[1].waiting == ("C",)
    assert res.steps[6].scheduled[0].prefix_hit_tokens == 8
    a, b, c = res.requests
    assert (b.preemptions, b.lost_tokens, b.prefix_hit_tokens) == (1, 12, 8)
    assert (c.preemptions, c.lost_tokens) == (1, 7)
    # vLLM 0.33's counters: the first admissions (A 8, B 8, C 7 tokens, no hit) in queries/hits; the
    # re-admissions of the preempted (B with 8 + 5 tokens and its 8-token hit, C with 7 + 1) apart.
    assert (res.steps[-1].prefix_query_tokens, res.steps[-1].prefix_hit_tokens) == (8 + 8 + 7, 0)
    assert (res.steps[-1].preempted_query_tokens, res.steps[-1].preempted_hit_tokens) == (13 + 8, 8)
    assert all(r.finish_reason == "length" for r in res.requests)


def test_an_admission_that_waits_for_blocks_is_counted_once(model: LoadedModel) -> None:
    # 6 blocks of 4. Step 0: A's 16-token prompt takes 4 blocks; B (12 tokens, 3 blocks) finds 2
    # free: its admission fails. Step 1: A's 17th position takes a 5th block; B finds 1. A ends after
    # step 3 (its 4 tokens: prefill + 3 decodes), its 5 blocks go back; step 4 admits B. B looked up
    # the prefix cache in steps 0-4, but vLLM 0.33 records a lookup at admission only: queries
    # 16 + 12 (older vLLM, counting in get_computed_blocks, had 16 + 5 * 12).
    reqs = [ServeRequest("A", ids(16, 21), max_tokens=4, ignore_eos=True),
            ServeRequest("B", ids(12, 22), max_tokens=2, ignore_eos=True)]
    _, res = run(model, reqs, num_blocks=6, block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    assert plan(res) == [
        [("A", "prefill", 0, 16)],
        [("A", "decode", 16, 1)],
        [("A", "decode", 17, 1)],
        [("A", "decode", 18, 1)],
        [("B", "prefill", 0, 12)],
        [("B", "decode", 12, 1)],
    ]
    assert [s.waiting for s in res.steps[:4]] == [("B",)] * 4 and not res.preemptions
    assert (res.steps[-1].prefix_query_tokens, res.steps[-1].prefix_hit_tokens) == (16 + 12, 0)
    assert (res.steps[-1].preempted_query_tokens, res.steps[-1].preempted_hit_tokens) == (0, 0)


def test_prefix_hit_is_whole_blocks_and_never_the_last_prompt_token(model: LoadedModel) -> None:
    shared = ids(40, 7)
    reqs = [ServeRequest("A", shared + ids(5, 8), max_tokens=4, ignore_eos=True),
            ServeRequest("B", shared + ids(6, 9), max_tokens=2, ignore_eos=True, arrival=2),
            ServeRequest("C", shared[:32], max_tokens=2, ignore_eos=True, arrival=2)]
    _, res = run(model, reqs, num_blocks=32, block_size=16, max_num_batched_tokens=64, max_num_seqs=4)
    b_step, c_step = res.steps[2].scheduled[1:]
    # a 40-token shared prompt holds 2 full blocks of 16: B takes 32 tokens from A's blocks.
    assert (b_step.request_id, b_step.start, b_step.num_tokens, b_step.prefix_hit_tokens) == ("B", 32, 14, 32)
    # C's whole 32-token prompt is cached, but its last token must run for its logits: 16 hit tokens.
    assert (c_step.request_id, c_step.start, c_step.num_tokens, c_step.prefix_hit_tokens) == ("C", 16, 16, 16)
    st = res.steps[2]
    assert st.block_state.count("shared") == 2  # A's first block held by A, B and C; its second by A and B
    first = [i for i, s in enumerate(st.block_state) if s == "shared"]
    assert sorted(len(st.block_owner[b]) for b in first) == [2, 3]
    assert res.steps[-1].prefix_hit_tokens == 48 and res.steps[-1].prefix_query_tokens == 45 + 46 + 32
    # without prefix caching nothing hits
    _, off = run(model, reqs, num_blocks=32, block_size=16, max_num_batched_tokens=64, max_num_seqs=4,
                 prefix_caching=False)
    assert off.steps[-1].prefix_hit_tokens == 0 and off.steps[-1].prefix_query_tokens == 0
    assert [r.output_ids for r in off.requests] == [r.output_ids for r in res.requests]


def test_finished_blocks_stay_cached_for_a_later_hit(model: LoadedModel) -> None:
    shared = ids(32, 11)
    reqs = [ServeRequest("A", shared + ids(3, 12), max_tokens=1, ignore_eos=True),
            ServeRequest("B", shared + ids(3, 13), max_tokens=1, ignore_eos=True, arrival=3)]
    _, res = run(model, reqs, num_blocks=8, block_size=16, max_num_batched_tokens=64, max_num_seqs=2)
    assert res.steps[0].finished == ("A",)
    assert res.steps[1].blocks_cached == 2 and res.steps[1].blocks_used == 0 and res.steps[1].blocks_free == 6
    assert res.steps[3].scheduled[0].prefix_hit_tokens == 32


def test_idle_steps_and_the_step_counter(model: LoadedModel) -> None:
    reqs = [ServeRequest("A", ids(5, 1), max_tokens=2, ignore_eos=True, arrival=3)]
    _, res = run(model, reqs, num_blocks=8, block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    assert [len(st.scheduled) for st in res.steps] == [0, 0, 0, 1, 1]
    assert [st.step for st in res.steps] == [0, 1, 2, 3, 4]
    assert res.requests[0].finished_step == 4 and res.requests[0].first_token_step == 3


@pytest.mark.parametrize("policy,admitted", [("continuous", 1), ("static", 5), ("sequential", 5)])
def test_policies_admit_differently(model: LoadedModel, policy: str, admitted: int) -> None:
    # A runs steps 0..4 (prefill + 5 tokens); B arrives at step 1: continuous admits it at once,
    # static and one-at-a-time only once A's batch has ended.
    reqs = [ServeRequest("A", ids(10, 1), max_tokens=5, ignore_eos=True),
            ServeRequest("B", ids(10, 2), max_tokens=2, ignore_eos=True, arrival=1)]
    _, res = run(model, reqs, num_blocks=16, block_size=4, max_num_batched_tokens=32, max_num_seqs=4, policy=policy)
    assert res.requests[0].finished_step == 4
    assert res.requests[1].admitted_step == admitted


def test_static_batch_waits_for_its_last_request(model: LoadedModel) -> None:
    reqs = [ServeRequest(f"r{i}", ids(6, i), max_tokens=m, ignore_eos=True) for i, m in enumerate((2, 6, 1))]
    _, st = run(model, reqs, num_blocks=32, block_size=4, max_num_batched_tokens=64, max_num_seqs=2, policy="static")
    assert [r.admitted_step for r in st.requests] == [0, 0, 6]  # r2 waits for r1, the batch's longest
    _, seq = run(model, reqs, num_blocks=32, block_size=4, max_num_batched_tokens=64, max_num_seqs=2,
                 policy="sequential")
    assert [r.admitted_step for r in seq.requests] == [0, 2, 8]
    assert max(len(s.running) for s in seq.steps) == 1


def test_a_forward_that_raises_leaves_the_pool_whole(model: LoadedModel) -> None:
    calls = {"n": 0}

    def boom(*_: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected")

    reqs = [ServeRequest(f"r{i}", ids(9 + i, i), max_tokens=6, ignore_eos=True) for i in range(4)]
    engine = ServeEngine(model, ServeConfig(num_blocks=40, block_size=4, max_num_batched_tokens=12, max_num_seqs=4))
    hook = model.model.model.layers[1].register_forward_pre_hook(boom)  # mid-forward: layer 0 has written
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.run(reqs)
    finally:
        hook.remove()
    engine.cache.audit()
    bp = engine.cache.blocks
    assert not bp.used and len(bp.free) + len(bp.lru) == bp.num_blocks
    assert not engine.cache.seqs


@pytest.mark.parametrize("how", ["callback", "abort"])
def test_a_stop_ends_the_run_cleanly(model: LoadedModel, how: str) -> None:
    reqs = [ServeRequest(f"r{i}", ids(9 + i, i), max_tokens=20, ignore_eos=True) for i in range(4)]
    engine = ServeEngine(model, ServeConfig(num_blocks=40, block_size=4, max_num_batched_tokens=12, max_num_seqs=4))

    def on_step(rec: Any) -> bool:
        if rec.step == 3 and how == "abort":
            engine.abort()
        return not (rec.step == 3 and how == "callback")

    res = engine.run(reqs, on_step=on_step)
    engine.cache.audit()
    assert res.stopped == "aborted" and len(res.steps) == 4 and res.blocks_leaked == 0
    assert all(r.finish_reason == "aborted" for r in res.requests)
    assert sum(len(r.output_ids) for r in res.requests) > 0  # what was generated is kept
    # the engine runs again after a stop
    again = engine.run(reqs[:1])
    assert again.stopped is None and again.requests[0].finish_reason == "length"


def test_bad_input_is_named(model: LoadedModel) -> None:
    engine = ServeEngine(model, ServeConfig(num_blocks=4, block_size=4, max_num_batched_tokens=16, max_num_seqs=2))
    with pytest.raises(KVVizError, match="0 requests"):
        engine.run([])
    with pytest.raises(KVVizError, match="past the model's context of 128"):
        engine.run([ServeRequest("x", ids(120, 1), max_tokens=10)])
    with pytest.raises(KVVizError, match="pool holds 16 tokens"):
        engine.run([ServeRequest("x", ids(12, 1), max_tokens=10)])
    with pytest.raises(KVVizError, match="smaller than one block"):
        ServeEngine(model, ServeConfig(num_blocks=8, block_size=16, max_num_batched_tokens=8)).run(
            [ServeRequest("x", ids(4, 1), max_tokens=2)])
    with pytest.raises(KVVizError, match="share the id"):
        engine.run([ServeRequest("x", ids(2, 1), max_tokens=1), ServeRequest("x", ids(2, 2), max_tokens=1)])
    with pytest.raises(KVVizError, match="empty prompt"):
        ServeRequest("x", (), max_tokens=1)
    engine.cache.audit()


def test_arrival_in_seconds(model: LoadedModel) -> None:
    reqs = [ServeRequest("A", ids(6, 1), max_tokens=2, ignore_eos=True),
            ServeRequest("B", ids(6, 2), max_tokens=2, ignore_eos=True, arrival=0.2)]
    _, res = run(model, reqs, num_blocks=16, block_size=4, max_num_batched_tokens=16, max_num_seqs=2,
                 arrival="seconds")
    a, b = res.requests
    assert a.arrival_ms == 0.0 and b.arrival_ms == 200.0
    assert b.admitted_step is not None and res.steps[b.admitted_step].t_ms >= 200.0
    assert any(not st.scheduled for st in res.steps)  # the engine idled until B arrived
    assert b.ttft_ms is not None and b.ttft_ms > 0 and b.e2e_ms is not None and b.e2e_ms >= b.ttft_ms


def test_a_stop_string_ends_a_request(model: LoadedModel) -> None:
    import kvviz

    prompt = ids(6, 5)
    solo = kvviz.generate(model, list(prompt), max_new_tokens=12, sampling=kvviz.SamplingParams(ignore_eos=True),
                          backend="readable")
    text = model.tokenizer.decode(list(solo.generated_ids))
    stop = text[3:5]
    cut = text.find(stop)
    reqs = [ServeRequest("A", prompt, max_tokens=12, ignore_eos=True, stop=(stop,)),
            ServeRequest("B", ids(6, 6), max_tokens=12, ignore_eos=True)]
    _, res = run(model, reqs, num_blocks=16, block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    a = res.requests[0]
    assert a.finish_reason == "stop" and a.output_text == text[:cut]
    assert a.output_ids == list(solo.generated_ids)[:len(a.output_ids)] and len(a.output_ids) < 12
    assert res.requests[1].finish_reason == "length"
