"""The serving engine on the real SmolLM2-135M (fp32): four requests of real prompts batched with
chunked prefill, a preemption and prefix hits generate exactly what each generates alone."""
from __future__ import annotations

from kvviz.engine.loading.loader import LoadedModel
from serving_checks import check_real_model

# fp32 through 30 layers: batched rows may sum in another order than the solo forward's (a few ulps
# of each reduction of up to 1536 terms), compounded over the layers; measured: 2-3e-6 of the largest
# logit on this CPU. 1e-4 of it leaves room for another CPU's kernels (AVX2 vs AVX-512 blockings) and
# stays far below the top-1 margins greedy decides on here.
REL_TOL = 1e-4


def test_smollm2_batched_equals_solo(smollm2: LoadedModel) -> None:
    top1 = check_real_model(smollm2, REL_TOL)
    print(f"SmolLM2 teacher-forced top-1 agreement: {top1}")
