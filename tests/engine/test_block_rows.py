"""The block kernel on several input rows at once (csrc/blockdot.c's segment(), issue 42).

A forward of m rows (a prefill of a few dozen tokens) unpacks each weight block once and multiplies
it by up to four input rows, each row with its own accumulators (lblocks.c's and kblocks.c's
many-row functions). Each output must be bit for bit what the one-row kernel gives for that row
alone (the same int32 block sums, the same fp32 operations in the same order: two accumulators
over even and odd blocks, then the horizontal sum; the K types' offsets apart), so m rows through
one call must equal (torch.equal) the m one-row calls, for every block type the loader reads,
packed and one int8 a weight (blocks of 32, and of 16: Q6_K's), at row counts that leave every
remainder of the groups of four; and be within test_gguf_codes.py's derived bound of the exact
product on the dequantized weights (the same bound the one-row kernel is held to: the int16
rounding of each block of 32 inputs plus fp32 accumulation, derived there).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402

from kvviz.engine.loading.gguf_codes import block_codes, packed_types  # noqa: E402
from kvviz.fast import rowops  # noqa: E402
from kvviz.fast.blockdot import block_dot  # noqa: E402
from test_gguf_codes import assert_as_specified, probe_rows, random_tensor  # noqa: E402

pytestmark = pytest.mark.skipif(rowops.load() is None, reason=f"no C kernel: {rowops.status()}")

ROWS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 33)  # every remainder of the groups of four, and past 32


def one_at_a_time(op, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.cat([op(x[i:i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "int8"])
@pytest.mark.parametrize("qtype", packed_types(), ids=lambda q: q.name)
def test_many_rows_equal_the_rows_one_at_a_time(qtype: Q, packed: bool, threads: int) -> None:
    # 288 inputs: nine blocks of 32, an odd tail for the two accumulators (Q6_K's int8: 18 of 16); a K
    # type's super-block is 256, so those get 768 (three). 11 outputs: threads split them unevenly.
    n_in = 768 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 288
    w = block_codes(random_tensor(qtype, 11, n_in, 21), packed=packed)
    assert w is not None
    op = block_dot([w], threads)
    assert op is not None, f"{qtype.name}: the kernel refused it"
    for m in ROWS:
        x = probe_rows(m, n_in, 100 + m)
        got = op(x)
        assert torch.equal(got, one_at_a_time(op, x)), f"{qtype.name} packed={packed} m={m}: not the one-row values"
        assert_as_specified(got, w, x, f"{qtype.name} packed={packed} m={m}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_side_by_side_segments_with_biases_and_swiglu_take_many_rows_as_one(threads: int) -> None:
    # gate|up of two types and a q|k|v of three (with and without offsets, blocks of 32 and 16, with
    # biases as Qwen2's): each output column of each segment, for 13 rows, as 13 single rows give it.
    g = torch.Generator().manual_seed(3)
    gate, up = (block_codes(random_tensor(t, 40, 512, s)) for t, s in ((Q.Q4_K, 31), (Q.Q5_0, 32)))
    qkv = [block_codes(random_tensor(t, n, 512, s)) for t, n, s in ((Q.Q4_1, 24, 33), (Q.Q5_K, 8, 34), (Q.Q6_K, 8, 35))]
    biases = [torch.randn(w.shape[0], generator=g) for w in qkv]  # type: ignore[union-attr]
    ops = [block_dot([gate, up], threads, swiglu=True), block_dot(qkv, threads, biases=biases)]  # type: ignore[list-item]
    x = probe_rows(13, 512, 36)
    for op in ops:
        assert op is not None
        got = op(x)
        assert got.shape[0] == 13 and torch.equal(got, one_at_a_time(op, x))
