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
    _, res = serve(model, reqs)
    assert sum(r.preemptions for r in res.requests) >= 2, "the small pool should force preemptions"
    assert res.steps[-1].prefix_hit_tokens >= 3 * 40 // 8 * 8 - 8, "the shared prefix should hit"
    assert any(s.kind == "prefill" and s.num_tokens == 24 for st in res.steps for s in st.scheduled), \
        "a prompt longer than the budget should be chunked"
    assert any(st.prefill_tokens and st.decode_tokens for st in res.steps), "a step should mix prefill and decode"
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
