"""Continuous batching changes no request's output: every request served with others (chunked
prefill, preemptions and prefix hits forced by deterministic arrivals and a small pool) generates the
ids it generates alone through ``kvviz.generate`` (greedy, fp32), on a tiny random Llama (GQA),
Gemma 3 (sliding and global layers in three layer groups) and GPT-2; its logits match a
teacher-forced solo forward. The real models: test_serving_smollm2.py, test_serving_gemma3.py."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import kvviz
from kvviz.engine.loaded import wrap_model
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.models.gemma3 import Gemma3, Gemma3Config
from kvviz.engine.serving import ragged_cache
from kvviz.engine.serving.engine import ServeConfig, ServeEngine, ServeResult
from kvviz.engine.serving.requests import ServeRequest
from kvviz.engine.tokenize.tokenizer import ByteTokenizer

# Six layers, every third global, window 5: groups of two layers (one global, two sliding).
GEMMA = dict(vocab_size=256, block_size=128, context_length=128, n_layer=6, n_head=4, n_kv_head=1, n_embd=32,
             head_dim=16, intermediate_size=48, sliding_window=5, sliding_pattern=3, eos_token_id=None)

# fp32 logits, batched (N rows through each matmul, per-request attention) vs a teacher-forced solo
# forward (T rows): the same sums, possibly blocked in another order by the kernel, so each output
# may differ by a few ulps of its reduction (length <= 64 here: ~64 * 1.2e-7 relative), compounded
# over a handful of layers; 1e-4 of the logits' scale (|logits| ~ 10-100 here) bounds that with room,
# and is far below the top-1/top-2 gaps greedy decides on (the models are built to avoid near-ties).
RTOL, ATOL = 1e-4, 1e-4


def tiny_gemma3(seed: int = 0) -> LoadedModel:
    net = Gemma3(Gemma3Config(**GEMMA))  # type: ignore[arg-type]
    net.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # spread the logits so greedy never sits on a float-noise tie
        net.model.norm.weight.fill_(9.0)
        for p in net.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return wrap_model(net, ByteTokenizer(256), "tiny-gemma3", torch.device("cpu"), torch.float32, True, "tests")


@pytest.fixture(scope="module")
def models(make_llama: Callable[..., LoadedModel], make_model: Callable[..., LoadedModel]) -> dict[str, LoadedModel]:
    return {"llama": make_llama(block_size=128), "gemma3": tiny_gemma3(), "gpt2": make_model(block_size=128)}


def workload(seed: int = 1, n: int = 8) -> list[ServeRequest]:
    """Half the requests share a 40-token prefix; lengths 5..54 past it; two arrive per step."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(0, 256, (5 + 7 * i,), generator=g).tolist()
        out.append(ServeRequest(f"r{i}", tuple((shared if i % 2 == 0 else []) + tail), max_tokens=8 + i,
                                ignore_eos=True, arrival=i // 2))
    return out


# A pool of 14 blocks of 8 tokens (one layer group: 112 tokens) under 8 requests of up to 108 forces
# preemptions; a budget of 24 forces chunked prefill; the shared prefix gives prefix hits.
SMALL_POOL = dict(num_blocks=14, block_size=8, max_num_batched_tokens=24, max_num_seqs=4)


def serve(model: LoadedModel, reqs: list[ServeRequest], **over: Any) -> tuple[ServeEngine, ServeResult]:
    groups = 3 if model.name == "tiny-gemma3" else 1  # every layer group holds its own blocks
    cfg = {**SMALL_POOL, "num_blocks": SMALL_POOL["num_blocks"] * groups, "keep_logits": True, **over}
    engine = ServeEngine(model, ServeConfig(**cfg))
    res = engine.run(reqs)
    engine.cache.audit()
    assert res.blocks_leaked == 0
    return engine, res


def solo_ids(model: LoadedModel, r: ServeRequest) -> list[int]:
    run = kvviz.generate(model, list(r.prompt_ids), max_new_tokens=r.max_tokens,
                         sampling=kvviz.SamplingParams(ignore_eos=True), backend="readable")
    return list(run.generated_ids)


def teacher_forced(model: LoadedModel, r: ServeRequest, out: list[int]) -> torch.Tensor:
    """(len(out), V) logits of a no-cache forward over prompt + out: the solo reference."""
    ids = torch.tensor([list(r.prompt_ids) + out[:-1]])
    with torch.inference_mode():
        logits = model.model(ids)  # (1, T, V)
    return logits[0, len(r.prompt_ids) - 1:].float()


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2"])
def test_batched_ids_equal_solo_runs(models: dict[str, LoadedModel], name: str) -> None:
    model, reqs = models[name], workload()
    # Gemma 3's sliding groups give back the blocks out of their window (ragged_cache.remove_skipped),
    # so its pool is two blocks tighter than 3 x 14 to force preemptions all the same; and a block a
    # window let go waits in the LRU, where the pressure evicts some before the last sharer arrives:
    # two of the three later sharers hit their whole 40-token prefix there, all three elsewhere.
    _, res = serve(model, reqs, **({"num_blocks": 40} if name == "gemma3" else {}))
    assert sum(r.preemptions for r in res.requests) >= 2, "the small pool should force preemptions"
    least = 2 * 40 if name == "gemma3" else 3 * 40 // 8 * 8 - 8
    assert res.steps[-1].prefix_hit_tokens >= least, "the shared prefix should hit"
    assert any(s.kind == "prefill" and s.num_tokens == 24 for st in res.steps for s in st.scheduled), \
        "a prompt longer than the budget should be chunked"
    assert any(st.prefill_tokens and st.decode_tokens for st in res.steps), "a step should mix prefill and decode"
    if name == "gemma3":  # its sliding groups let blocks go mid-request, and the ids still equal solo runs
        assert res.steps[-1].window_freed_blocks > 0
    for r, rec in zip(reqs, res.requests):
        assert rec.finish_reason == "length"
        assert rec.output_ids == solo_ids(model, r), r.request_id


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2"])
def test_batched_logits_allclose_to_teacher_forced(models: dict[str, LoadedModel], name: str) -> None:
    model, reqs = models[name], workload(seed=2)
    _, res = serve(model, reqs)
    agree = total = 0
    for r, rec in zip(reqs, res.requests):
        got = torch.stack(res.logits[r.request_id])  # (max_tokens, V)
        ref = teacher_forced(model, r, rec.output_ids)
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL * float(ref.abs().max()))
        agree += int((ref.argmax(-1) == torch.tensor(rec.output_ids)).sum())
        total += len(rec.output_ids)
    assert agree == total  # teacher-forced top-1 agreement: 100% in fp32


def test_mask_attention_equals_the_loop(models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """The rejected variant (one SDPA, a block-diagonal mask) gives the same ids and logits."""
    model, reqs = models["gemma3"], workload(seed=3)
    _, loop = serve(model, reqs)
    monkeypatch.setattr(ragged_cache, "ATTENTION", "mask")
    _, mask = serve(model, reqs)
    for a, b in zip(loop.requests, mask.requests):
        assert a.output_ids == b.output_ids
        ref = torch.stack(loop.logits[a.request_id])
        torch.testing.assert_close(torch.stack(mask.logits[a.request_id]), ref, rtol=RTOL,
                                   atol=ATOL * float(ref.abs().max()))


def test_bf16_runs_and_agrees_top1(make_llama: Callable[..., LoadedModel]) -> None:
    """bf16 (8 mantissa bits): batching may round differently, so ids are not compared; the logits
    stay within bf16's resolution of a teacher-forced bf16 forward (2^-8 relative, a few roundings
    deep), and teacher-forced top-1 agreement is reported and must stay high."""
    model, reqs = make_llama(block_size=128, dtype=torch.bfloat16), workload(seed=4)
    _, res = serve(model, reqs)
    agree = total = 0
    for r, rec in zip(reqs, res.requests):
        ref = teacher_forced(model, r, rec.output_ids)
        got = torch.stack(res.logits[r.request_id])
        torch.testing.assert_close(got, ref, rtol=0.05, atol=0.05 * float(ref.abs().max()))
        agree += int((ref.argmax(-1) == torch.tensor(rec.output_ids)).sum())
        total += len(rec.output_ids)
    print(f"bf16 teacher-forced top-1 agreement: {agree}/{total}")
    assert agree / total >= 0.95


def test_every_policy_gives_the_same_ids(models: dict[str, LoadedModel]) -> None:
    model, reqs = models["llama"], workload(seed=5)
    outs = {}
    for policy in ("continuous", "static", "sequential"):
        _, res = serve(model, reqs, policy=policy, prefix_caching=policy != "static")
        outs[policy] = [r.output_ids for r in res.requests]
    assert outs["continuous"] == outs["static"] == outs["sequential"]


# Gemma 3's tiny model (window 5) in blocks of 4: three layer groups, two of them sliding.
WINDOW_POOL = dict(num_blocks=48, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)


def _audited(engine_box: list[ServeEngine]) -> Callable[[Any], None]:
    def check(step: Any) -> None:
        engine_box[0].cache.audit()  # after every step: free + cached + used == the pool, refs == tables
        assert step.blocks_free + step.blocks_cached + step.blocks_used == step.blocks_total
    return check


def test_sliding_groups_free_the_blocks_out_of_their_window(models: dict[str, LoadedModel]) -> None:
    """vLLM's SlidingWindowManager.remove_skipped_blocks, by hand. One request, a 20-token prompt and
    12 new tokens; step k >= 1 feeds position 19 + k, and before it each sliding group lets go of the
    blocks wholly before num_computed - window + 1 = 15 + k: (15 + k) // 4 blocks, two groups."""
    model = models["gemma3"]
    r = ServeRequest("A", tuple(range(1, 21)), max_tokens=12, ignore_eos=True)
    engine = ServeEngine(model, ServeConfig(**WINDOW_POOL))
    box = [engine]
    res = engine.run([r], on_step=_audited(box))
    freed = [2 * ((15 + k) // 4) if k else 0 for k in range(12)]
    assert freed == [0, 8, 8, 8, 8, 10, 10, 10, 10, 12, 12, 12]
    assert [s.window_freed_blocks for s in res.steps] == freed
    # Held after step k: the global group every block of its 20 + k positions, each sliding group those
    # minus the ones let go (without the freeing: 3 * ceil((20 + k) / 4)); the last step finished A.
    assert [s.blocks_used for s in res.steps] == [15, 10, 10, 10, 10, 11, 11, 11, 11, 12, 12, 0]
    # Each block let go was full and hashed: it stays cached (the pool is large: nothing evicted).
    assert [s.blocks_cached for s in res.steps[:11]] == freed[:11]
    assert res.requests[0].output_ids == solo_ids(model, r)
    assert res.blocks_leaked == 0


def test_a_prefix_hit_takes_only_the_window_of_a_sliding_group(models: dict[str, LoadedModel]) -> None:
    """B shares A's first 24 tokens and arrives after A ended. Its hit is the 6 blocks of the global
    group, but of each sliding group only the block its first query's window reaches (positions
    20..23: block 5); blocks 0-4 are NULL, as vLLM's find_longest_cache_hit takes null blocks."""
    model = models["gemma3"]
    shared = list(range(1, 25))
    a = ServeRequest("A", tuple(shared + [30, 31, 32, 33]), max_tokens=2, ignore_eos=True)
    b = ServeRequest("B", tuple(shared + [40, 41, 42, 43, 44]), max_tokens=3, ignore_eos=True, arrival=3)
    engine = ServeEngine(model, ServeConfig(**WINDOW_POOL))
    box = [engine]
    res = engine.run([a, b], on_step=_audited(box))
    admit = res.steps[3]
    assert [(s.request_id, s.start, s.num_tokens, s.prefix_hit_tokens) for s in admit.scheduled] == \
        [("B", 24, 5, 24)]
    # B holds 8 blocks of its 29 positions in the global group, 3 (blocks 5-7) in each sliding one.
    assert admit.blocks_used == 8 + 2 * 3
    assert [rec.output_ids for rec in res.requests] == [solo_ids(model, a), solo_ids(model, b)]
    assert res.blocks_leaked == 0
