"""What the generation loop reads off each step's logits, in C (``csrc/logits.c``): greedy
decoding's argmax, whether they are all finite, and the top candidates with their softmax
probabilities (the live views' top-5).

torch does this in five ops, a pass over the vocabulary each (isfinite + all, softmax, topk):
about 2 ms a step for Gemma 3's 262,144 logits on a 2-core CPU, a tenth of a decode step, and
0.4 ms of SmolLM2's 49,152. The C side reads the logits once for the argmax and its finiteness
(``argmax_checked``: the loop then need not check them again) and once for the top-k and their
probabilities (``top_probs``). The functions fall back to torch for
what the kernel does not take (CUDA, other dtypes, no C compiler), with the same results: the
same finiteness, the same probabilities to fp32 rounding (torch sums in fp32, C in double over
fp32 blocks), the same tokens but for the order of exact ties (lower index first here). The top-k pass uses AVX2's
exponential; a build without AVX2 keeps torch's softmax for it (the scalar loop would be slower).
"""
from __future__ import annotations

import torch

from kvviz.fast.rowops import load


def _c_row(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and load() is not None


def all_finite(logits: torch.Tensor) -> bool:
    """Whether no logit is NaN or infinite (any shape)."""
    if _c_row(logits):
        return bool(load().kv_all_finite(logits.data_ptr(), logits.numel()))  # type: ignore[union-attr]
    return bool(torch.isfinite(logits).all())


def argmax_checked(logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(B, V) logits -> (B,) int64 ids of each row's first maximum, as ``torch.argmax(logits, -1)``,
    and True when the C pass that found them also found every logit finite (it sums x - x beside the
    maximum), so a caller need not read the logits again to know; False when torch's argmax took
    them: a row with a NaN or an infinity (its rule for NaN), or what the kernel does not read (CUDA,
    other dtypes, no C compiler). False says "not known here", not "not finite".
    """
    if logits.dim() == 2 and logits.shape[-1] > 0 and _c_row(logits):
        lib = load()
        row = logits.stride(0) * logits.element_size()
        ids = [lib.kv_argmax(logits.data_ptr() + i * row, logits.shape[-1])  # type: ignore[union-attr]
               for i in range(logits.shape[0])]
        if min(ids, default=0) >= 0:
            return torch.tensor(ids, dtype=torch.int64), True
    return torch.argmax(logits, dim=-1), False


def top_probs(logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k most likely token ids of one row of finite logits (V,), most likely first, and their
    softmax probabilities over all V; k is clipped to V."""
    k = min(k, logits.shape[-1])
    # kv_dot_simd: this build's AVX2 paths, logits.c's exponential among them (one library, one set of
    # flags); without them the scalar loop would be slower than torch's softmax
    if _c_row(logits) and 1 <= k <= 16 and load().kv_dot_simd():  # type: ignore[union-attr]
        idx = torch.empty(k, dtype=torch.int64)
        prob = torch.empty(k, dtype=torch.float32)
        if load().kv_top_probs(logits.data_ptr(), logits.numel(), k, idx.data_ptr(), prob.data_ptr()) == 0:  # type: ignore[union-attr]
            return idx.tolist(), prob.tolist()
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (V,)
    p, i = torch.topk(probs, k)
    return i.tolist(), p.tolist()
