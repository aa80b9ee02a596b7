"""What the serving tests of the real models share: a short workload of real prompts that forces
chunked prefill, a preemption and a prefix hit, and the checks against solo runs
(``check_real_model``: all of it, one call per model)."""
from __future__ import annotations

from typing import Any

import torch

import kvviz
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.serving.engine import ServeConfig, ServeEngine, ServeResult
from kvviz.engine.serving.requests import ServeRequest

SHARED = "You are a helpful assistant who answers in one short sentence. "
QUESTIONS = ("What is the capital of France?", "Why is the sky blue?", "Name a prime number larger than ten.",
             "What does a KV cache store?")


def real_workload(model: LoadedModel, max_tokens: int = 6) -> list[ServeRequest]:
    """Four requests: a shared lead (prefix hits), the first two at step 0, the rest at steps 2 and 3."""
    out = []
    for i, q in enumerate(QUESTIONS):
        ids = model.tokenizer.encode(SHARED + q)
        out.append(ServeRequest(f"q{i}", tuple(ids), max_tokens=max_tokens, ignore_eos=True, arrival=max(0, i - 1)))
    return out


def serve_small_pool(model: LoadedModel, reqs: list[ServeRequest], **over: Any) -> ServeResult:
    """A pool of one request's blocks and two more (per layer group), a budget of 16: chunks and preemption."""
    longest = max(len(r.prompt_ids) + r.max_tokens for r in reqs)
    engine = ServeEngine(model, ServeConfig(num_blocks=1, block_size=4))  # for its layer groups
    per_req = -(-longest // 4) * engine.cache.groups.count
    cfg = dict(num_blocks=per_req + 2 * engine.cache.groups.count, block_size=4, max_num_batched_tokens=16,
               max_num_seqs=4, keep_logits=True, **over)
    engine = ServeEngine(model, ServeConfig(**cfg))  # type: ignore[arg-type]
    res = engine.run(reqs)
    engine.cache.audit()
    assert res.blocks_leaked == 0
    return res


def check_against_solo(model: LoadedModel, reqs: list[ServeRequest], res: ServeResult, rel_tol: float) -> str:
    """Ids equal to solo greedy runs; logits within rel_tol of the largest logit of a teacher-forced
    solo forward; returns the teacher-forced top-1 agreement and the largest difference, for the report."""
    agree = total = 0
    worst = 0.0
    for r, rec in zip(reqs, res.requests):
        solo = kvviz.generate(model, list(r.prompt_ids), max_new_tokens=r.max_tokens,
                              sampling=kvviz.SamplingParams(ignore_eos=True), backend="readable")
        assert rec.output_ids == list(solo.generated_ids), r.request_id
        ids = torch.tensor([list(r.prompt_ids) + rec.output_ids[:-1]], device=model.device)
        with torch.inference_mode():
            ref = model.model(ids)[0, len(r.prompt_ids) - 1:].float().cpu()  # (max_tokens, V)
        got = torch.stack(res.logits[r.request_id]).float().cpu()
        scale = float(ref.abs().max())
        torch.testing.assert_close(got, ref, rtol=0, atol=rel_tol * scale)
        worst = max(worst, float((got - ref).abs().max()) / scale)
        agree += int((ref.argmax(-1) == torch.tensor(rec.output_ids)).sum())
        total += len(rec.output_ids)
    return f"{agree}/{total}, largest logit difference {worst:.1e} of the largest logit"


def check_real_model(model: LoadedModel, rel_tol: float) -> str:
    """The real models' one check: ``real_workload`` served on ``serve_small_pool`` preempts at least
    once, hits the prefix cache (vLLM's prefix_cache_hits: first admissions only), chunks a prompt
    to the budget of 16, and every request equals its solo run (``check_against_solo``, whose
    teacher-forced top-1 agreement it returns)."""
    reqs = real_workload(model)
    res = serve_small_pool(model, reqs)
    assert len(res.preemptions) >= 1, "the small pool should force a preemption"
    assert res.steps[-1].prefix_hit_tokens > 0, "the shared lead should hit the prefix cache"
    assert any(s.kind == "prefill" and s.num_tokens == 16 for st in res.steps for s in st.scheduled), \
        "a prompt longer than the budget should be chunked"
    return check_against_solo(model, reqs, res, rel_tol)
