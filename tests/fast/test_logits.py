"""kvviz.fast.logits: the loop's argmax, finiteness check and top-k probabilities in C, against torch
(isfinite().all(); softmax then topk). Probabilities to 2e-6 relative: torch sums the exponentials
in fp32 over the whole row, C in fp32 blocks of 64 added in double with its own exp (error < 2e-7
relative, rowcommon.h), so the two normalizers differ by a few fp32 ulps of a sum of up to 262,144
terms; the ids are equal (the test values have no ties but the one placed on purpose)."""
from __future__ import annotations

import math

import pytest
import torch

from kvviz.fast import rowops
from kvviz.fast.logits import all_finite, argmax_checked, top_probs

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


# The one-pass top_probs against float64. Its error, relative, for p_i = t_i / S (t_j = exp(x_j - max)):
#   each term: exp_poly's polynomial (< 2e-7, rowcommon.h) and its fp32 evaluation (three roundings
#   near 1: 3 * 2^-24), so EPS_EXP = 4e-7; plus the fp32 rounding of the argument x_j - M, a relative
#   2^-24 of it, which moves the term by 2^-24 |x_j - M| (M the maximum the term was taken against,
#   at most the final one: x_j - M' is smaller in magnitude than x_j - max);
#   the sum: each term passes at most 16 fp32 additions (8 in its lane, 8 adding the lanes) before
#   the double sum, 16 * 2^-24; the rescales exp(M' - M) and the double additions: ~1e-16 each;
#   the division and the fp32 result: 2 * 2^-24.
# So |p - p64| / p64 <= 2 EPS_EXP + 2^-24 (|x_i - max| + span + 18), span = max - min of the finite
# logits (the sum's terms are all taken from within it).
U = 2.0 ** -24
EPS_EXP = 4e-7


def ref_top(x: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor]:
    """The k largest finite values' ids (ties: lower index first) and their softmax in float64 over
    the finite values."""
    x64 = x.double()
    fin = torch.isfinite(x64)
    keyed = sorted((-float(v), i) for i, v in enumerate(x64.tolist()) if fin[i])
    ids = [i for _, i in keyed[:k]]
    e = torch.exp(x64[fin] - x64[fin].max())
    return ids, torch.exp(x64[ids] - x64[fin].max()) / e.sum()


def within_bound(x: torch.Tensor, k: int) -> tuple[list[int], float, float]:
    """top_probs(x, k)'s ids (checked equal to the reference's) and the largest relative error of
    its probabilities against the derived bound for each."""
    ids, probs = top_probs(x, k)
    want_ids, want = ref_top(x, k)
    assert ids == want_ids
    fin = x[torch.isfinite(x)].double()
    span = float(fin.max() - fin.min())
    err = (torch.tensor(probs, dtype=torch.float64) - want).abs() / want
    bound = 2 * EPS_EXP + U * ((fin.max() - x.double()[ids]).abs() + span + 18)
    assert bool((err <= bound).all()), (err, bound)
    return ids, float(err.max()), float(bound.max())


@pytest.mark.parametrize("n", [5, 63, 64, 65, 300, 49_152, 262_144])
@pytest.mark.parametrize("k", [1, 5, 16])
def test_top_probs_within_the_derived_bound_of_float64(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(7 * n + k)
    x = torch.randn(n, generator=g) * 4.0
    within_bound(x, min(k, n))


@pytest.mark.parametrize("order", ["ascending", "descending", "late_winner"])
def test_the_sum_rescales_whenever_a_block_raises_the_maximum(order: str) -> None:
    """Ascending: every block of 64 raises the running maximum (4,096 rescales of the sum taken so
    far); descending: none after the first; late_winner: the mass sits in the early blocks and the
    maximum arrives in the last one (a sum not rescaled would be off by e^2)."""
    n = 262_144
    g = torch.Generator().manual_seed(11)
    if order == "late_winner":
        x = torch.randn(n, generator=g) * 0.5 + 10.0
        x[-1] = 14.0
    else:
        x = torch.linspace(-20.0, 10.0, n) + torch.rand(n, generator=g) * 1e-3
        if order == "descending":
            x = x.flip(0).contiguous()
    ids, err, bound = within_bound(x, 5)
    assert err < bound


def test_ties_across_a_rescale_keep_the_lower_index_first() -> None:
    x = torch.zeros(1000)
    x[900], x[3], x[500] = 4.0, 4.0, 4.0  # the maximum first in block 0, equalled in blocks 7 and 14
    x[100] = 1.0  # block 1 raises nothing
    ids, probs = top_probs(x, 4)
    assert ids == [3, 500, 900, 100] and probs[0] == probs[1] == probs[2]
    within_bound(x, 4)


def test_non_finite_logits_go_as_they_went_in_two_passes() -> None:
    """What the kernel does with values the loop never hands it (it checks finiteness first), as the
    two-pass form did: -inf never enters the top k and adds nothing; a NaN never enters, and adds
    nothing where exp8's lanes read it (their clamp takes -88) but makes every probability NaN in the
    scalar tail (a row not a multiple of 8); +inf comes first and makes every probability NaN; places
    left unfilled keep id -1, probability 0 (NaN when nothing is finite)."""
    g = torch.Generator().manual_seed(5)
    for n in (300, 262_144):
        x = torch.randn(n, generator=g) * 3.0
        x[[0, 150, n - 1]] = float("-inf")
        within_bound(x, 5)  # the reference drops the -inf values
    x = torch.randn(300, generator=g) * 3.0
    x[150] = float("nan")  # in block 2, read in lanes
    ids, probs = top_probs(x, 5)
    y = x.clone()
    y[150] = float("-inf")
    assert ids == top_probs(y, 5)[0] and probs == top_probs(y, 5)[1]
    x[299] = float("nan")  # 300 = 37 * 8 + 4: index 299 is in the scalar tail
    ids, probs = top_probs(x, 5)
    assert 150 not in ids and 299 not in ids and all(p != p for p in probs)
    x = torch.randn(1000, generator=g)
    x[[700, 5]] = float("inf")
    ids, probs = top_probs(x, 5)
    assert ids[:2] == [5, 700] and all(p != p for p in probs)
    x = torch.full((300,), float("-inf"))
    x[10], x[200] = 1.0, 2.0
    ids, probs = top_probs(x, 5)
    assert ids == [200, 10, -1, -1, -1] and probs[2:] == [0.0, 0.0, 0.0]
    assert abs(probs[0] - 1 / (1 + math.exp(-1.0))) < 1e-7
    ids, probs = top_probs(torch.full((300,), float("-inf")), 3)
    assert ids == [-1, -1, -1] and all(p != p for p in probs)


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
    assert argmax_checked(x)[0].tolist() == torch.argmax(x, dim=-1).tolist()


def test_argmax_takes_the_first_of_equal_maxima_across_and_within_blocks() -> None:
    x = torch.zeros(4, 300)
    x[0, 250], x[0, 70] = 5.0, 5.0  # two blocks of 64 apart: the earlier block's
    x[1, 130], x[1, 129] = 5.0, 5.0  # in one block: the lower index
    x[2, :] = -3.0  # all equal: index 0
    x[3, 299] = float("-inf")  # a -inf is not finite: torch's argmax decides (index 0 here)
    assert argmax_checked(x)[0].tolist() == [70, 129, 0, 0] == torch.argmax(x, dim=-1).tolist()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_argmax_of_rows_with_non_finite_values_is_torchs(bad: float) -> None:
    x = torch.randn(2, 1000, generator=torch.Generator().manual_seed(3))
    x[1, 517] = bad
    assert argmax_checked(x)[0].tolist() == torch.argmax(x, dim=-1).tolist()


def test_argmax_checked_says_the_logits_are_finite_only_when_its_pass_saw_it() -> None:
    x = torch.randn(2, 262_144, generator=torch.Generator().manual_seed(6))
    ids, checked = argmax_checked(x)
    assert checked and ids.tolist() == torch.argmax(x, dim=-1).tolist()
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 100_000] = bad
        ids, checked = argmax_checked(y)
        assert not checked and ids.tolist() == torch.argmax(y, dim=-1).tolist()
    # what torch takes is not checked here, finite or not
    assert argmax_checked(x.to(torch.bfloat16))[1] is False and argmax_checked(x[:, ::2])[1] is False


def test_argmax_reads_strided_rows_and_other_dtypes_through_torch() -> None:
    wide = torch.randn(3, 400, generator=torch.Generator().manual_seed(4))
    rows = wide[:, :300]  # rows 400 apart: not contiguous, torch's own
    assert argmax_checked(rows)[0].tolist() == torch.argmax(rows, dim=-1).tolist()
    cols = wide.t()  # not contiguous: torch's own
    assert argmax_checked(cols)[0].tolist() == torch.argmax(cols, dim=-1).tolist()
    half = wide.to(torch.bfloat16)
    assert argmax_checked(half)[0].tolist() == torch.argmax(half, dim=-1).tolist()
