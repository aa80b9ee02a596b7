"""kvviz.fast.logits: the loop's argmax, finiteness check and top-k probabilities in C, against torch
(isfinite().all(); softmax then topk). Probabilities to 2e-6 relative: torch sums the exponentials
in fp32 over the whole row, C in fp32 blocks of 64 added in double with its own exp (error < 2e-7
relative, rowcommon.h), so the two normalizers differ by a few fp32 ulps of a sum of up to 262,144
terms; the ids are equal (the test values have no ties but the one placed on purpose)."""
from __future__ import annotations

import pytest
import torch

from kvviz.fast import rowops
from kvviz.fast.logits import all_finite, argmax, top_probs

pytestmark = pytest.mark.skipif(rowops.load() is None, reason=f"no C kernel: {rowops.status()}")


def torch_top(x: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    p, i = torch.topk(torch.softmax(x, dim=-1, dtype=torch.float32), k)
    return i.tolist(), p.tolist()


@pytest.mark.parametrize("n", [5, 63, 64, 65, 49_152, 262_144])
@pytest.mark.parametrize("k", [1, 5])
def test_top_probs_equal_torch_softmax_topk(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, generator=g) * 4.0
    x[n // 3] = 30.0  # one clear winner, far from the front (the block skip must still find it)
    ids, probs = top_probs(x, k)
    want_ids, want = torch_top(x, k)
    assert ids == want_ids
    torch.testing.assert_close(torch.tensor(probs), torch.tensor(want), rtol=2e-6, atol=0)


def test_ties_keep_the_lower_index_first_and_k_is_clipped() -> None:
    x = torch.zeros(200)
    x[150], x[7], x[120] = 2.0, 2.0, 1.0
    ids, probs = top_probs(x, 3)
    assert ids == [7, 150, 120] and probs[0] == probs[1]
    e = torch.exp(torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64))
    assert abs(probs[0] - float(e[0] / (2 * e[0] + e[1] + 197 * e[2]))) < 1e-7
    assert top_probs(torch.tensor([1.0, 3.0]), 5)[0] == [1, 0]


def test_negative_and_huge_logits() -> None:
    x = torch.full((1000,), -1e30)  # finite, exp underflows to zero but for the maximum
    x[999] = -1e29
    ids, probs = top_probs(x, 2)
    assert ids[0] == 999 and probs[0] == 1.0 and probs[1] == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_sees_nan_and_both_infinities(bad: float) -> None:
    x = torch.randn(2, 49_152)
    assert all_finite(x)
    x[1, 40_000] = bad
    assert not all_finite(x) and not bool(torch.isfinite(x).all())
    assert not all_finite(x[1]) and all_finite(x[0])


def test_what_the_kernel_does_not_take_falls_back_to_torch() -> None:
    x = torch.randn(300, dtype=torch.float64)
    assert top_probs(x, 5) == torch_top(x, 5)
    y = torch.randn(2, 300)[:, ::2]  # not contiguous
    assert all_finite(y) and top_probs(y[0], 3)[0] == torch_top(y[0], 3)[0]


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 129, 49_152, 262_144])
def test_argmax_equals_torch_argmax(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=g) * 4.0
    assert argmax(x).tolist() == torch.argmax(x, dim=-1).tolist()


def test_argmax_takes_the_first_of_equal_maxima_across_and_within_blocks() -> None:
    x = torch.zeros(4, 300)
    x[0, 250], x[0, 70] = 5.0, 5.0  # two blocks of 64 apart: the earlier block's
    x[1, 130], x[1, 129] = 5.0, 5.0  # in one block: the lower index
    x[2, :] = -3.0  # all equal: index 0
    x[3, 299] = float("-inf")  # a -inf is not finite: torch's argmax decides (index 0 here)
    assert argmax(x).tolist() == [70, 129, 0, 0] == torch.argmax(x, dim=-1).tolist()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_argmax_of_rows_with_non_finite_values_is_torchs(bad: float) -> None:
    x = torch.randn(2, 1000, generator=torch.Generator().manual_seed(3))
    x[1, 517] = bad
    assert argmax(x).tolist() == torch.argmax(x, dim=-1).tolist()


def test_argmax_reads_strided_rows_and_other_dtypes_through_torch() -> None:
    wide = torch.randn(3, 400, generator=torch.Generator().manual_seed(4))
    rows = wide[:, :300]  # rows 400 apart: not contiguous, torch's own
    assert argmax(rows).tolist() == torch.argmax(rows, dim=-1).tolist()
    cols = wide.t()  # not contiguous: torch's own
    assert argmax(cols).tolist() == torch.argmax(cols, dim=-1).tolist()
    half = wide.to(torch.bfloat16)
    assert argmax(half).tolist() == torch.argmax(half, dim=-1).tolist()
