"""The serving engine on the real Gemma 3 270M (fp32; three global and fifteen sliding layers in
six layer groups): four requests of real prompts batched with chunked prefill, a preemption and
prefix hits generate exactly what each generates alone."""
from __future__ import annotations

from kvviz.engine.loading.loader import LoadedModel
from serving_checks import check_real_model

# fp32 through 18 layers: batched rows may sum in another order than the solo forward's (a few ulps
# of each reduction of up to 2048 terms), compounded over the layers; measured: 2-3e-6 of the largest
# logit on this CPU. 1e-4 of it leaves room for another CPU's kernels (AVX2 vs AVX-512 blockings) and
# stays far below the top-1 margins greedy decides on here.
REL_TOL = 1e-4


def test_gemma3_batched_equals_solo(gemma3: LoadedModel) -> None:
    top1 = check_real_model(gemma3, REL_TOL)
    print(f"Gemma 3 teacher-forced top-1 agreement: {top1}")
